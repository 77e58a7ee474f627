"""Each family parser against vLLM's own parser for that family, text by text.

vLLM runs in its own venv (``scripts/setup_vllm.sh``; ``$RELAX_VLLM_PYTHON``): one subprocess runs
``vllm_parse_reference.py`` over every family's texts, and each text's calls (name and decoded
arguments) must be ours too, except the differences listed in ``DIFFERENCES`` (where the reference
is wrong for training; each says why and pins our reading). Skipped, saying so, without that venv.
The reference pairs: ``qwen3`` hermes + qwen3 reasoning, ``llama3`` llama3_json, ``mistral``
mistral (the v11 ``NAME[ARGS]{...}`` form: with a Hugging Face tokenizer vLLM reads only that one),
``deepseek_v3`` deepseek_v31 + deepseek_v3 reasoning, ``glm45`` glm45 + glm45 reasoning,
``kimi_k2`` kimi_k2 + kimi_k2 reasoning, ``qwen3_coder`` qwen3_coder, ``gemma`` gemma4 + gemma4
reasoning. (gpt-oss has no text parser in vLLM: harmony reads tokens.)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from relax_agent.errors import ConfigError
from relax_agent.rollout.parsers import build_parser, parse_reply

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "integer"}},
        "units": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "string"}}}}},
]
WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
TIME = {"name": "get_time", "arguments": {"tz": "UTC"}}
ZIP = {"name": "get_weather", "arguments": {"zip": "75001", "metric": True}}
NESTED = {"name": "get_weather", "arguments": {"city": "Zürich", "hours": [6, 12], "units": {"temp": "C"}}}
QUOTED = {"name": "get_weather", "arguments": {"city": 'the "Big Apple", NY'}}
EMPTY = {"name": "get_time", "arguments": {}}
UNKNOWN = {"name": "get_news", "arguments": {"topic": "rain"}}

REFERENCE = {"qwen3": ("hermes", "qwen3"), "llama3": ("llama3_json", None), "mistral": ("mistral", None),
             "deepseek_v3": ("deepseek_v31", "deepseek_v3"), "glm45": ("glm45", "glm45"),
             "kimi_k2": ("kimi_k2", "kimi_k2"), "qwen3_coder": ("qwen3_coder", None), "gemma": ("gemma4", "gemma4")}


def _mistral(calls: list[dict[str, Any]]) -> str:
    return "".join(f"[TOOL_CALLS]{c['name']}[ARGS]{json.dumps(c['arguments'])}" for c in calls)


def texts(family: str) -> dict[str, str]:
    """The family's replies: its own call syntax (``format``) in the issue's situations."""
    write = _mistral if family == "mistral" else build_parser(family).format  # type: ignore[attr-defined]
    one, two = write([WEATHER]), write([WEATHER, TIME])
    second = write([TIME]) if family != "mistral" else _mistral([TIME])
    cut_at = len(two) - len(second) // 2
    return {
        "one call": one, "two calls": two, "string that spells a number": write([ZIP]),
        "text before the call": "Let me check. " + one, "text after the call": one + " Done.",
        "second call cut": two[:cut_at], "only call cut": one[: len(one) // 2], "plain answer": "It is sunny.",
        "call after reasoning": "<think>\nhmm\n</think>\n\n" + one,
        "call inside reasoning": "<think>\n" + one + "\n</think>\n\nNo call.",
        "reasoning without </think> then a call": "<think>\nI will look it up.\n" + one,
        "three calls": write([WEATHER, TIME, ZIP]), "nested and unicode values": write([NESTED]),
        "quotes in a string value": write([QUOTED]), "no arguments": write([EMPTY]),
        "a function the tools lack": write([UNKNOWN]), "whitespace around the reply": "\n\n" + one + "\n\n",
        "text between two calls": one + "\nAnd the time:\n" + write([TIME]),
        "the same call twice": write([WEATHER, WEATHER]),
    }


NO_CALL: list[dict[str, Any]] = []
CUT = "a reply cut inside a call (at the token limit) is a parse error, never half a call: vLLM returns the cut call with the arguments read so far"
IN_THINK = ("a call written inside a closed reasoning block is thought about, not made (the model closed its "
            "reasoning after it and answered): vLLM's reasoning parsers end the reasoning at the first call marker")
LLAMA = ("vLLM's llama3_json reads every JSON object with a name anywhere in the reply as a call (prose around it, "
         "inside reasoning); the Llama 3 template asks for the call as the whole reply (or after <|python_tag|>), "
         "so a reply with text around the JSON is an answer, and a JSON example quoted in prose never runs")
DIFFERENCES: dict[tuple[str, str], tuple[list[dict[str, Any]], str]] = {
    ("qwen3", "second call cut"): ([WEATHER], "vLLM's hermes parser drops every call of a turn when one block "
                                   "does not decode; we keep the complete ones, as BFCL's decoder does"),
    ("glm45", "second call cut"): ([WEATHER], CUT), ("glm45", "only call cut"): (NO_CALL, CUT),
    ("qwen3_coder", "second call cut"): ([WEATHER], CUT), ("qwen3_coder", "only call cut"): (NO_CALL, CUT),
    ("gemma", "second call cut"): ([WEATHER], CUT), ("gemma", "only call cut"): (NO_CALL, CUT),
    ("kimi_k2", "second call cut"): ([WEATHER], CUT), ("kimi_k2", "only call cut"): (NO_CALL, CUT),
    ("mistral", "second call cut"): ([WEATHER], CUT), ("mistral", "only call cut"): (NO_CALL, CUT),
    **{(family, "call inside reasoning"): (NO_CALL, IN_THINK) for family in ("qwen3", "deepseek_v3", "glm45", "kimi_k2")},
    **{("llama3", label): (NO_CALL, LLAMA) for label in (
        "text before the call", "text after the call", "call after reasoning", "call inside reasoning",
        "reasoning without </think> then a call", "text between two calls")},
    ("glm45", "a function the tools lack"): ([UNKNOWN], "a call to a function the tools lack is still a call: the env "
                                             "judges it (a wrong name is a wrong answer); vLLM's GLM parser drops it"),
}


def _ours(family: str, text: str) -> list[dict[str, Any]]:
    action = parse_reply(build_parser(family), text, TOOLS)
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in action.tool_calls]


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, dict[str, Any]]]:
    """vLLM's reading of every family's texts: ``{family: {label: {"calls", "error"}}}``."""
    from relax_agent.rollout.engines.vllm_engine import find_vllm_python

    try:
        python = find_vllm_python()
    except ConfigError as exc:
        pytest.skip(f"no vLLM venv: {exc}")
    jobs = [{"parser": parser, "reasoning": reasoning, "tools": TOOLS, "texts": list(texts(family).values())}
            for family, (parser, reasoning) in REFERENCE.items()]
    script = Path(__file__).with_name("vllm_parse_reference.py")
    done = subprocess.run([str(python), str(script)], input=json.dumps(jobs), capture_output=True, text=True,
                          timeout=600, check=False)
    if done.returncode != 0:
        pytest.fail(f"vLLM reference failed (exit {done.returncode}): {done.stderr[-2000:]}")
    replies = json.loads(done.stdout.strip().splitlines()[-1])
    return {family: dict(zip(texts(family), out, strict=True)) for family, out in zip(REFERENCE, replies, strict=True)}


CASES = [(family, label) for family in REFERENCE for label in texts(family)]


@pytest.mark.parametrize("family, label", CASES, ids=[f"{f}-{label}" for f, label in CASES])
def test_family_parser_reads_calls_as_vllm_does(family, label, reference):
    ref = reference[family][label]
    ours = _ours(family, texts(family)[label])
    if (family, label) in DIFFERENCES:
        expected, why = DIFFERENCES[(family, label)]
        assert ours == expected, why
        assert ref["calls"] != ours, f"vLLM now agrees with us; drop the documented difference: {why}"
    else:
        assert ours == ref["calls"], f"vLLM reads {ref}"


@pytest.mark.parametrize("family", ["glm45", "qwen3_coder"])
def test_values_are_typed_by_the_tool_schema(family):
    """A string parameter's ``75001`` is the string "75001", an integer parameter's ``3`` the number 3."""
    text = build_parser(family).format([{"name": "get_weather", "arguments": {"zip": "75001", "days": 3}}])
    assert _ours(family, text) == [{"name": "get_weather", "arguments": {"zip": "75001", "days": 3}}]
    untyped = build_parser(family).parse(text).tool_calls[0]["function"]["arguments"]
    assert untyped == {"zip": 75001, "days": 3}  # without the schema the text cannot say



@pytest.mark.parametrize("family, label, expected", [
    ("qwen3", "reasoning without </think> then a call", [WEATHER]),
    ("glm45", "reasoning without </think> then a call", [WEATHER]),
    ("deepseek_v3", "reasoning without </think> then a call", [WEATHER]),
    ("kimi_k2", "reasoning without </think> then a call", [WEATHER]),
    ("deepseek_v3", "second call cut", [WEATHER]),
    ("deepseek_v3", "text after the call", [WEATHER]),
    ("kimi_k2", "text after the call", [WEATHER]),
    ("mistral", "text after the call", [WEATHER]),
    ("mistral", "text between two calls", [WEATHER, TIME]),
    ("deepseek_v3", "text between two calls", [WEATHER, TIME]),
    ("kimi_k2", "text between two calls", [WEATHER, TIME]),
])
def test_readings_that_now_agree_with_vllm(family, label, expected):
    """The texts these parsers read differently from vLLM before (checked here without vLLM's venv)."""
    text = texts(family)[label]
    assert _ours(family, text) == expected
    if label == "text after the call":
        assert build_parser(family).parse(text).content.endswith("Done.")
