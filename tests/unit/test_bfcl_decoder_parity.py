"""The BFCL env and the BFCL reward service give BFCL's own verdict on raw replies.

Each text is read three ways: by ``hermes_strict`` then ``BFCLEnv.step``, by ``hermes_strict``
then the BFCL reward service, and by BFCL itself (``QwenFCHandler._parse_query_response_prompting``
drops the reasoning, ``decode_ast`` reads the calls, then the eval runner's rules: a decode failure
is wrong for a task that expects calls and "no call" for irrelevance; ``ast_checker`` judges the
rest). ``qwen_fc.py`` imports every BFCL handler through its base class (tree-sitter, openai, ...):
it is executed from the wheel's file with those imports (and ``overrides``) stubbed (the decoder uses none), as
``test_bfcl_checker.py`` does for ``ast_checker.py``.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import types
from typing import Any

import pytest

from relax_agent.envs.bfcl.data import data_dir, load_tasks
from relax_agent.envs.bfcl.env import BFCLEnv
from relax_agent.reward_services import RewardItem
from relax_agent.reward_services.bfcl_reward import BFCLReward
from relax_agent.rollout.parsers import build_parser

pytest.importorskip("bfcl_eval")

AREA = '{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}'
GOOD = f"<tool_call>\n{AREA}\n</tool_call>"
PLAY_1 = '<tool_call>\n{"name": "spotify.play", "arguments": {"artist": "Taylor Swift", "duration": 20}}\n</tool_call>'
PLAY_2 = '<tool_call>\n{"name": "spotify.play", "arguments": {"artist": "Maroon 5", "duration": 15}}\n</tool_call>'

TEXTS = {
    "one good call": GOOD,
    "text around a good call": f"Sure.\n{GOOD}\nDone.",
    "plain answer": "None of the functions can help with that.",
    "malformed block after a good one": f'{GOOD}\n<tool_call>\n{{"name": "calculate_triangle_area", "arguments": {{"base": 10,\n</tool_call>',
    "malformed block before a good one": f"<tool_call>\n{{not json}}\n</tool_call>\n{GOOD}",
    "good call then a cut-off block": f'{GOOD}\n<tool_call>\n{{"name": "calculate_triangle_area", "argu',
    "one-line block": f"<tool_call>{AREA}</tool_call>",
    "no newline before the closing tag": f"<tool_call>\n{AREA}</tool_call>",
    "no newline after the opening tag": f"<tool_call>{AREA}\n</tool_call>",
    "junk after the JSON inside the block": f"<tool_call>\n{AREA} thanks\n</tool_call>",
    "non-string name": '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
    "good call and a non-string name": f'{GOOD}\n<tool_call>\n{{"name": 7, "arguments": {{}}}}\n</tool_call>',
    "null name": '<tool_call>\n{"name": null, "arguments": {"base": 10}}\n</tool_call>',
    "list as name": '<tool_call>\n{"name": ["calculate_triangle_area"], "arguments": {}}\n</tool_call>',
    "list of calls in a block": f"<tool_call>\n[{AREA}]\n</tool_call>",
    "parameters instead of arguments": GOOD.replace('"arguments"', '"parameters"'),
    "arguments as a JSON string": ('<tool_call>\n{"name": "calculate_triangle_area", '
                                   '"arguments": "{\\"base\\": 10, \\"height\\": 5}"}\n</tool_call>'),
    "no arguments": '<tool_call>\n{"name": "calculate_triangle_area"}\n</tool_call>',
    "good call and a list block": f"{GOOD}\n<tool_call>\n[1, 2]\n</tool_call>",
    "call inside <think>": f"<think>\nI could call:\n{GOOD}\n</think>\n\nThe area is 25.",
    "call after </think>": f"<think>\nEasy.\n</think>\n\n{GOOD}",
    "think left open": f"<think>\nhmm\n{GOOD}",
    "two good calls": f"{GOOD}\n{GOOD}",
    "parallel calls": f"{PLAY_1}\n{PLAY_2}",
    "parallel calls, the first unframed": f"{PLAY_1.replace(chr(10) + '</tool_call>', '</tool_call>')}\n{PLAY_2}",
}

TASK_IDS = ["simple_python_0", "irrelevance_0", "parallel_0"]


class _KeepDots(dict):
    def __missing__(self, key):
        return types.SimpleNamespace(underscore_to_dot=False)


def _load(path, name: str, stubs: dict[str, types.ModuleType]):
    if not path.is_file():
        pytest.skip(f"{path} not in the installed bfcl-eval")
    with pytest.MonkeyPatch.context() as mp:
        for key, module in stubs.items():
            mp.setitem(sys.modules, key, module)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bfcl_verdict():
    """BFCL's verdict on a raw reply ``text`` for ``task`` (module docstring)."""
    root = data_dir().parent
    config = types.ModuleType("bfcl_eval.constants.model_config")
    config.MODEL_CONFIG_MAPPING = _KeepDots()
    checker = _load(root / "eval_checker" / "ast_eval" / "ast_checker.py", "_bfcl_parity_ast_checker",
                    {"bfcl_eval.constants.model_config": config})
    base = types.ModuleType("bfcl_eval.model_handler.local_inference.base_oss_handler")
    base.OSSHandler = object
    utils = types.ModuleType("bfcl_eval.model_handler.utils")
    utils.convert_to_function_call = lambda calls: calls
    overrides = types.ModuleType("overrides")
    overrides.override = lambda method: method
    qwen = _load(root / "model_handler" / "local_inference" / "qwen_fc.py", "_bfcl_parity_qwen_fc",
                 {"bfcl_eval.model_handler.local_inference.base_oss_handler": base,
                  "bfcl_eval.model_handler.utils": utils, "overrides": overrides})
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.utils import is_empty_output, is_function_calling_format_output

    handler = object.__new__(qwen.QwenFCHandler)

    def verdict(text: str, task: dict[str, Any]) -> bool:
        reply = types.SimpleNamespace(choices=[types.SimpleNamespace(text=text)],
                                      usage=types.SimpleNamespace(prompt_tokens=0, completion_tokens=0))
        answer = handler._parse_query_response_prompting(reply)["model_responses"]
        try:
            decoded = handler.decode_ast(answer, Language.PYTHON, False)
        except Exception:
            return task["expect"] == "no_call"
        if task["expect"] == "no_call":
            return is_empty_output(decoded)
        if not is_function_calling_format_output(decoded):
            return False
        result = checker.ast_checker(copy.deepcopy(task["functions"]), decoded, copy.deepcopy(task["possible_answer"]),
                                     Language.PYTHON, task["category"], "stub-model")
        return bool(result["valid"])

    return verdict


@pytest.fixture(scope="module")
def tasks() -> dict[str, dict[str, Any]]:
    by_id = {}
    for category in ("simple_python", "irrelevance", "parallel"):
        by_id.update({t["id"]: t for t in load_tasks(category) if t["id"] in TASK_IDS})
    return by_id


def _env_verdict(message: dict[str, Any], task: dict[str, Any]) -> bool:
    env = BFCLEnv(category=task["category"])
    env.reset(options={"task": task})
    _, _, _, _, info = env.step(message)
    return info["correct"] == 1.0


@pytest.mark.parametrize("task_id", TASK_IDS)
@pytest.mark.parametrize("label", list(TEXTS))
def test_env_and_reward_service_give_bfcls_verdict(label, task_id, tasks, bfcl_verdict):
    text, task = TEXTS[label], tasks[task_id]
    message = build_parser("hermes_strict").parse(text).message()
    expected = bfcl_verdict(text, task)
    assert _env_verdict(message, task) is expected, f"{label!r} on {task_id}: the env differs from BFCL"
    served = BFCLReward()(RewardItem(id="a", response=message, ground_truth=task))
    assert (served["metrics"]["correct"] == 1.0) is expected, f"{label!r} on {task_id}: the reward service differs"


def test_the_table_holds_both_verdicts(tasks, bfcl_verdict):
    """The texts are not all of one verdict: each task has texts BFCL accepts and texts it refuses."""
    for task in tasks.values():
        verdicts = {bfcl_verdict(text, task) for text in TEXTS.values()}
        assert verdicts == {True, False}, task["id"]


def test_a_turn_bfcl_cannot_decode_is_named_in_the_reason(tasks):
    message = build_parser("hermes_strict").parse(TEXTS["good call and a list block"]).message()
    assert message["rejected_calls"] == [[1, 2]]
    env = BFCLEnv(category="simple_python")
    env.reset(options={"task": tasks["simple_python_0"]})
    _, reward, _, _, info = env.step(message)
    assert reward == 0.0 and "does not decode as BFCL reads it" in info["reason"] and info["num_calls"] == 2


def test_the_reward_service_takes_the_envs_bfcl_compat(tasks):
    """Reversed parallel calls: our pairing accepts them, BFCL's greedy pairing (bfcl_compat) may not;
    env and service agree in both modes."""
    task = next(t for t in load_tasks("parallel") if t["id"] == "parallel_178")
    calls = list(reversed(BFCLEnv(category="parallel").demonstration(task)["tool_calls"]))
    message = {"role": "assistant", "content": "", "tool_calls": calls}
    for compat in (False, True):
        env = BFCLEnv(category="parallel", bfcl_compat=compat)
        env.reset(options={"task": task})
        served = BFCLReward(bfcl_compat=compat)(RewardItem(id="a", response=message, ground_truth=task))
        assert served["metrics"]["correct"] == env.step(message)[4]["correct"] == (0.0 if compat else 1.0)
