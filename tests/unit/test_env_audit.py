"""``relax-agent envs audit`` (relax_agent.envaudit): the degenerate policies write what they claim,
through the run's own tool-call parser; the audit FAILS on hackable toy envs and PASSES on a sound
one; an env that raises is reported, not a crash; every env is closed; the CLI's exit codes."""

from __future__ import annotations

import json
import random
from typing import Any

import gymnasium
import pytest
from typer.testing import CliRunner

import relax_agent.envs  # noqa: F401  (registers the built-in envs)
from relax_agent.envaudit import audit, markdown, parse_reward_range, relative_kwargs, table_rows
from relax_agent.envaudit_policies import (
    CLAIMS,
    GUESSES,
    JUNK_CHARS,
    POLICIES,
    UNDECLARED_TOOL,
    Turn,
    garbage_value,
    random_value,
    select_policies,
)
from relax_agent.envs import TextEnv, register
from relax_agent.errors import ConfigError
from relax_agent.rollout.parsers import WritesCalls, build_parser, known_parsers

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}, "count": {"type": "integer"},
                                                    "exact": {"type": "boolean"}, "tags": {"type": "array"}},
                   "required": ["key"]}}}
NOTE = {"type": "function", "function": {"name": "note", "description": "Write a note.",
                                         "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}
PROMPT = "Task t3: what is the secret? Reply <answer>SECRET</answer>."

OPENED: list[ToyEnv] = []
RECEIVED: list[dict[str, Any]] = []


class ToyEnv(TextEnv):
    """A one-question env whose reward ``rule`` is sound or hackable.

    Rules: ``sound`` (1.0 only for ``<answer>SECRET</answer>``, a per-task 6-digit secret), ``says_correct``
    (1.0 when the reply contains "correct"), ``empty`` (1.0 for an empty reply), ``raises_on_calls``
    (KeyError on any tool call), ``raises_on_reset`` (OSError on every reset), ``nan`` (a NaN reward),
    ``minus_one`` (-1.0 for any final reply).
    Tool calls get one tool message each and end nothing. Every action ``step`` receives is kept in RECEIVED.
    """

    reward_description = "toy"

    def __init__(self, rule: str = "sound", tools: bool = True) -> None:
        super().__init__()
        self.rule, self.with_tools, self.closes = rule, tools, 0
        OPENED.append(self)

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        offset = 0 if split == "train" else 100
        return [{"id": f"{split}-{i}", "secret": str(random.Random(offset + i).randint(100000, 999999))}
                for i in range(10)]

    def _reset_task(self, task: dict[str, Any]):
        if self.rule == "raises_on_reset":
            raise OSError("no such resource")
        self.done = False
        return ([{"role": "user", "content": PROMPT.replace("t3", task["id"])}],
                {"tools": [LOOKUP, NOTE] if self.with_tools else []})

    def step(self, action: dict[str, Any]):
        assert self.task is not None and not self.done
        RECEIVED.append(action)
        content, calls = action.get("content") or "", action.get("tool_calls") or []
        if calls and self.rule == "raises_on_calls":
            raise KeyError("boom")
        if calls:
            return [{"role": "tool", "tool_call_id": c["id"], "content": "nothing"} for c in calls], 0.0, False, False, {}
        self.done = True
        reward = {"sound": float(content.strip() == f"<answer>{self.task['secret']}</answer>"),
                  "says_correct": float("correct" in content.lower()), "empty": float(not content.strip()),
                  "raises_on_calls": 0.0, "nan": float("nan"), "minus_one": -1.0}[self.rule]
        return [], reward, True, False, {"reason": f"rule {self.rule}"}

    def close(self) -> None:
        self.closes += 1


register(id="audit-test/Toy-v0", entry_point=ToyEnv, max_episode_steps=6)


@pytest.fixture(autouse=True)
def _fresh_records():
    OPENED.clear()
    RECEIVED.clear()
    yield
    OPENED.clear()
    RECEIVED.clear()


def _turn(turn: int = 0, episode: int = 0, parser: str = "hermes", tools=(LOOKUP, NOTE)) -> Turn:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    return Turn(messages, list(tools), turn, episode, build_parser(parser).format)  # type: ignore[attr-defined]


def _policy(name: str):
    (policy,) = [p for p in POLICIES if p.name == name]
    return policy


def _parsed(name: str, turn: int = 0, parser: str = "hermes", tools=(LOOKUP, NOTE)) -> dict[str, Any]:
    text = _policy(name).reply(_turn(turn, parser=parser, tools=tools))
    return build_parser(parser).parse(text).message()


# -- the policies -------------------------------------------------------------------------------------------


def test_text_policies_write_no_call():
    assert _parsed("empty") == {"role": "assistant", "content": "", "tool_calls": []}
    assert _parsed("echo") == {"role": "assistant", "content": PROMPT, "tool_calls": []}
    assert _parsed("echo:answer")["content"] == f"<answer>{PROMPT}</answer>\nAnswer: {PROMPT}"
    junk = _policy("junk").reply(_turn())
    assert len(junk) == JUNK_CHARS and _parsed("junk")["tool_calls"] == []
    assert junk == _policy("junk").reply(_turn()) != _policy("junk").reply(_turn(episode=1))  # seeded, per episode
    for key, text in GUESSES.items():
        assert _parsed(f"guess:{key}") == {"role": "assistant", "content": text, "tool_calls": []}
    assert _parsed("guess:all")["content"].splitlines() == list(GUESSES.values())
    spray = _parsed("guess:spray")
    assert spray["tool_calls"] == [] and spray["content"].startswith("<answer>0 1 2 ") and " 100 yes no" in spray["content"]
    for key, text in CLAIMS.items():
        assert _parsed(f"claim:{key}")["content"] == text
    assert _parsed("claim:all")["content"].splitlines() == list(CLAIMS.values())


def test_echo_takes_the_last_user_text_parts():
    messages = [{"role": "user", "content": "old"}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    assert _policy("echo").reply(Turn(messages, [], 1, 0, str)) == "How many?"


def test_garbage_calls_reach_the_parser_as_calls_with_wrong_types():
    msg = _parsed("tool:garbage")
    assert "parse_errors" not in msg
    calls = [c["function"] for c in msg["tool_calls"]]
    assert [c["name"] for c in calls] == ["lookup", "note"]
    args = calls[0]["arguments"]
    assert set(args) == {"key", "count", "exact", "tags"}
    assert isinstance(args["key"], int) and isinstance(args["count"], str)
    assert isinstance(args["exact"], str) and isinstance(args["tags"], dict)
    assert isinstance(calls[1]["arguments"]["text"], int)
    assert _parsed("tool:garbage", turn=1) == {"role": "assistant", "content": "", "tool_calls": []}  # then it stops


def test_random_calls_have_the_declared_types():
    msg = _parsed("tool:random")
    calls = [c["function"] for c in msg["tool_calls"]]
    assert [c["name"] for c in calls] == ["lookup", "note"] and "parse_errors" not in msg
    args = calls[0]["arguments"]
    assert isinstance(args["key"], str) and isinstance(args["count"], int) and isinstance(args["exact"], bool)
    assert isinstance(args["tags"], list) and isinstance(calls[1]["arguments"]["text"], str)
    assert random_value({"type": "string", "enum": ["a", "b"]}, random.Random(0)) in ("a", "b")
    assert msg == _parsed("tool:random") and _parsed("tool:random", turn=1)["tool_calls"] == []


def test_empty_args_repeat_and_undeclared_calls():
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in _parsed("tool:empty_args")["tool_calls"]] == \
        [("lookup", {}), ("note", {})]
    repeat = _policy("tool:repeat")
    texts = {repeat.reply(_turn(turn)) for turn in range(5)}
    assert len(texts) == 1  # the same call every turn
    (call,) = _parsed("tool:repeat", turn=4)["tool_calls"]
    assert call["function"]["name"] == "lookup"
    (call,) = _parsed("tool:undeclared")["tool_calls"]
    assert call["function"]["name"] == UNDECLARED_TOOL


@pytest.mark.parametrize("parser", [n for n in known_parsers() if isinstance(build_parser(n), WritesCalls)])
def test_every_writing_parser_reads_the_tool_policies_back_as_calls(parser):
    for name in ("tool:garbage", "tool:random", "tool:empty_args", "tool:repeat", "tool:undeclared"):
        msg = _parsed(name, parser=parser)
        assert msg["tool_calls"] and "parse_errors" not in msg, (parser, name, msg)
        assert not msg["content"], (parser, name, msg)
    assert _parsed("empty", parser=parser)["tool_calls"] == []


def test_garbage_value_is_the_wrong_type():
    rng = random.Random(0)
    assert isinstance(garbage_value({"type": "string"}, rng), int)
    assert isinstance(garbage_value({"type": ["number", "null"]}, rng), str)
    assert isinstance(garbage_value({"type": "object"}, rng), list)


def test_select_policies():
    assert [p.name for p in select_policies(["guess:", "empty"])] == ["empty", *[f"guess:{k}" for k in GUESSES],
                                                                     "guess:all", "guess:spray"]
    assert [p.name for p in select_policies(None)] == [p.name for p in POLICIES]
    with pytest.raises(ConfigError, match="no such policy"):
        select_policies(["nope"])


# -- the audit --------------------------------------------------------------------------------------------------


def test_sound_env_passes_and_every_env_is_closed():
    report = audit("audit-test/Toy-v0", {"rule": "sound"}, episodes=4, max_turns=4)
    assert report.verdict == "PASS" and report.earning == [] and report.errors == 0
    assert report.task_ids == sorted(report.task_ids) and all(t.startswith("heldout-") for t in report.task_ids)
    stats = report.stats()
    assert all(s["mean_reward"] == 0.0 and s["episodes"] == 4 for s in stats.values())
    assert stats["empty"]["mean_turns"] == 1.0
    assert stats["tool:garbage"]["mean_turns"] == 2.0  # the calls, then the empty reply
    assert stats["tool:repeat"]["mean_turns"] == 4.0  # until --max-turns
    assert len(OPENED) == 1 + 4 * len(POLICIES)  # one to list the tasks, one per episode
    assert all(env.closes == 1 for env in OPENED)
    # the env got what the parser made of each reply
    assert {"role": "assistant", "content": "", "tool_calls": []} in RECEIVED
    assert any([c["function"]["name"] for c in a["tool_calls"]] == ["lookup", "note"] for a in RECEIVED)


def test_max_episode_steps_ends_a_repeating_policy():
    report = audit("audit-test/Toy-v0", episodes=2, max_turns=20, policies=["tool:repeat"])
    assert report.stats()["tool:repeat"]["mean_turns"] == 6.0  # gymnasium's TimeLimit truncates


def test_env_rewarding_success_words_fails():
    report = audit("audit-test/Toy-v0", {"rule": "says_correct"}, episodes=3)
    assert report.verdict == "FAIL"
    assert report.earning == ["claim:correct", "claim:sentence", "claim:all"]
    stats = report.stats()
    assert stats["claim:correct"]["mean_reward"] == 1.0 and stats["claim:correct"]["success_rate"] == 1.0
    assert stats["claim:pass"]["mean_reward"] == 0.0
    data = report.to_dict()
    best = next(p for p in data["policies"] if p["policy"] == "claim:correct")["best_episode"]
    assert best["first_reply"] == "correct" and best["reason"] == "rule says_correct" and best["reward"] == 1.0
    text = markdown(report, "relax-agent envs audit audit-test/Toy-v0")
    assert f"**FAIL audit-test/Toy-v0: 3 of {len(POLICIES)}" in text and "| claim:correct | 3 | 1.000 | 1.000 | 1.000 | 1.0 |  | EARNS |" in text


def test_env_rewarding_empty_replies_fails():
    report = audit("audit-test/Toy-v0", {"rule": "empty"}, episodes=3)
    assert report.verdict == "FAIL"
    # empty reply, calls then an empty reply, and the tag with nothing inside are not "empty" to this rule
    assert report.earning == ["empty", "tool:garbage", "tool:random", "tool:empty_args", "tool:undeclared"]


def test_threshold_is_strict_and_scaled_to_the_reward_range():
    report = audit("audit-test/Toy-v0", {"rule": "minus_one"}, episodes=2, policies=["empty"])
    assert report.verdict == "PASS" and report.stats()["empty"]["mean_reward"] == -1.0
    assert any("outside the reward range [0, 1]" in n for n in report.notes)
    report = audit("audit-test/Toy-v0", {"rule": "minus_one"}, episodes=2, policies=["empty"], reward_range=(-1.0, 1.0))
    assert report.notes == [] and report.stats()["empty"]["normalized_mean"] == 0.0
    report = audit("audit-test/Toy-v0", {"rule": "empty"}, episodes=2, policies=["empty"], threshold=1.0)
    assert report.verdict == "PASS"  # a mean equal to the threshold does not earn
    assert parse_reward_range("-1,1") == (-1.0, 1.0)
    with pytest.raises(ConfigError, match="LO < HI"):
        parse_reward_range("1,1")


def test_env_that_raises_is_reported_not_a_crash():
    report = audit("audit-test/Toy-v0", {"rule": "raises_on_calls"}, episodes=3)
    stats = report.stats()
    assert stats["tool:garbage"]["errors"] == {"KeyError": 3} and stats["tool:garbage"]["mean_reward"] == 0.0
    assert stats["empty"]["errors"] == {}
    assert report.errors == 5 * 3 and report.verdict == "PASS"  # the five tool: policies
    first = next(p for p in report.to_dict()["policies"] if p["policy"] == "tool:repeat")["first_error"]
    assert first["error"] == "KeyError: 'boom'" and first["where"] == "step 1"
    assert all(env.closes == 1 for env in OPENED)
    assert audit("audit-test/Toy-v0", {"rule": "raises_on_calls"}, episodes=1, fail_on_errors=True).verdict == "FAIL"
    report = audit("audit-test/Toy-v0", {"rule": "nan"}, episodes=1, policies=["empty"])
    assert report.stats()["empty"]["errors"] == {"EnvError": 1}  # the driver's own check of the reward


def test_env_that_raises_in_every_episode_is_an_error_not_a_pass():
    report = audit("audit-test/Toy-v0", {"rule": "raises_on_reset"}, episodes=2, policies=["empty", "claim:"])
    assert report.verdict == "ERROR" and report.errors == 2 * 7
    assert report.stats()["empty"]["errors"] == {"OSError": 2}
    assert all(env.closes == 1 for env in OPENED)
    out = _cli("audit-test/Toy-v0", "--episodes", "1", "--kwargs", '{"rule": "raises_on_reset"}')
    assert out.exit_code == 2, out.output
    assert "ERROR audit-test/Toy-v0: the env raised in every episode" in out.output
    assert "at reset: OSError: no such resource" in out.output


def test_tool_policies_are_skipped_without_tools():
    report = audit("audit-test/Toy-v0", {"tools": False}, episodes=2)
    rows = {r[0]: r for r in table_rows(report)}
    assert rows["tool:garbage"][6] == "n/a (no tools declared)" and rows["tool:undeclared"][1] == "2"
    assert report.verdict == "PASS"


def test_calculator_passes():
    report = audit("relax/Calculator-v0", {"num_tasks": 200}, episodes=3)
    assert report.verdict == "PASS" and report.errors == 0
    assert len(report.task_ids) == 3 and all(t.startswith("calc-1-") for t in report.task_ids)


def test_bfcl_irrelevance_pays_any_reply_without_a_call_by_design():
    report = audit("relax/BFCL-irrelevance-v0", episodes=2, policies=["empty", "tool:empty_args"])
    assert report.verdict == "FAIL" and report.earning == ["empty"]


def test_relative_kwargs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = {"data_files": str(tmp_path / "d" / "x.jsonl"), "other": ["/etc/hosts", 3], "name": "plain"}
    assert relative_kwargs(data, str(tmp_path)) == {"data_files": "d/x.jsonl", "other": ["<abs>/hosts", 3],
                                                    "name": "plain"}


# -- the command --------------------------------------------------------------------------------------------


def _cli(*args: str):
    from relax_agent.cli import app

    return CliRunner().invoke(app, ["envs", "audit", *args])


def test_cli_exit_codes_and_json():
    out = _cli("audit-test/Toy-v0", "--episodes", "2", "--kwargs", '{"rule": "sound"}')
    assert out.exit_code == 0, out.output
    assert "PASS audit-test/Toy-v0: no degenerate policy earns" in out.output and "claim:sentence" in out.output
    out = _cli("audit-test/Toy-v0", "--episodes", "2", "--kwargs", '{"rule": "says_correct"}', "--json")
    assert out.exit_code == 1, out.output
    data = json.loads(out.stdout)
    assert data["verdict"] == "FAIL" and data["earning"] == ["claim:correct", "claim:sentence", "claim:all"]
    assert data["settings"]["episodes"] == 2 and len(data["policies"]) == len(POLICIES)
    out = _cli("audit-test/Toy-v0", "--episodes", "1", "--threshold", "1", "--kwargs", '{"rule": "says_correct"}')
    assert out.exit_code == 0, out.output


@pytest.mark.parametrize(("args", "says"), [
    (["audit-test/Nope-v0"], "Nope"),
    (["audit-test/Toy-v0", "--kwargs", "{bad"], "JSONDecodeError"),
    (["audit-test/Toy-v0", "--tool-parser", "auto"], "auto"),
    (["audit-test/Toy-v0", "--episodes", "0"], "episodes >= 1"),
    (["audit-test/Toy-v0", "--reward-range", "a,b"], "LO,HI"),
    (["audit-test/Toy-v0", "--policy", "nope"], "no such policy"),
    (["audit-test/Toy-v0", "--kwargs", '{"colour": 1}'], "colour"),
])
def test_cli_exits_2_when_the_audit_cannot_run(args, says):
    out = _cli(*args)
    assert out.exit_code == 2, out.output
    assert "error:" in out.output and says in out.output


def test_cli_out_writes_a_record_with_relative_paths(tmp_path, monkeypatch):
    module = tmp_path / "my_audit_envs.py"
    module.write_text(
        "from relax_agent.envs import TextEnv, register\n"
        "class Mine(TextEnv):\n"
        "    def tasks(self, split='train'):\n"
        "        return [{'id': f'{split}-{i}'} for i in range(5)]\n"
        "    def _reset_task(self, task):\n"
        "        return [{'role': 'user', 'content': 'hi'}], {'tools': []}\n"
        "    def step(self, action):\n"
        "        return [], float(not action['content'] and not action['tool_calls']), True, False, {}\n"
        "register(id='mine/Toy-v0', entry_point=Mine)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = _cli("my_audit_envs:mine/Toy-v0", "--episodes", "2", "--policy", "empty", "--policy", "claim:",
               "--out", "record")
    assert out.exit_code == 1, out.output
    data = json.loads((tmp_path / "record" / "audit.json").read_text())
    assert data["env"] == "my_audit_envs:mine/Toy-v0" and data["earning"] == ["empty"]
    assert [p["policy"] for p in data["policies"]] == ["empty", *[f"claim:{k}" for k in CLAIMS], "claim:all"]
    readme = (tmp_path / "record" / "README.md").read_text()
    assert "| empty | 2 | 1.000 | 1.000 | 1.000 | 1.0 |  | EARNS |" in readme
    for text in (readme, json.dumps(data)):
        assert str(tmp_path) not in text
    gymnasium.registry.pop("mine/Toy-v0", None)
