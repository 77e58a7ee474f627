"""BFCL multi-turn environments: episodes, per-turn user messages, rewards, isolation, limits."""

from __future__ import annotations

import json
from typing import Any

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401  (registers the envs)
from relax_agent.envs.bfcl import MULTI_TURN_ENV_IDS
from relax_agent.envs.bfcl.multi_turn import ADDED_FUNCTIONS_PROMPT, BFCLMultiTurnEnv
from relax_agent.envs.bfcl.multi_turn_api import MAX_EXPONENT, ApiSession, format_result, parse_call
from relax_agent.envs.bfcl.multi_turn_checker import ground_truth_calls
from relax_agent.envs.bfcl.multi_turn_data import load_tasks, task_docs
from relax_agent.errors import ConfigError, DataError, EnvError

pytest.importorskip("bfcl_eval")


def _task(task_id: str) -> dict[str, Any]:
    category = task_id.rsplit("_", 1)[0]
    return next(t for t in load_tasks(category) if t["id"] == task_id)


def _message(calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        for i, c in enumerate(calls)]}


ANSWER = {"role": "assistant", "content": "Done."}


def _play(env: BFCLMultiTurnEnv, task: dict[str, Any], calls: list[list[list[dict[str, Any]]]]):
    """Play ``calls`` (per turn, per step); returns (summed reward, last info, observations)."""
    _, _ = env.reset(options={"task": task})
    total, observations = 0.0, []
    for turn in calls:
        for step in turn:
            obs, reward, terminated, _, info = env.step(_message(step))
            total += reward
            observations.append(obs)
        obs, reward, terminated, _, info = env.step(ANSWER)
        total += reward
        observations.append(obs)
    assert terminated
    return total, info, observations


def test_four_ids_are_registered_with_their_category() -> None:
    assert set(MULTI_TURN_ENV_IDS) == {"relax/BFCL-multi-turn-base-v0", "relax/BFCL-multi-turn-miss-func-v0",
                                       "relax/BFCL-multi-turn-miss-param-v0", "relax/BFCL-multi-turn-long-context-v0"}
    for env_id, category in MULTI_TURN_ENV_IDS.items():
        env = gymnasium.make(env_id)
        assert env.unwrapped.category == category
        env.close()


def test_splits_are_disjoint_and_hold_out_at_least_50_tasks() -> None:
    env = BFCLMultiTurnEnv()
    train, heldout = env.tasks("train"), env.tasks("heldout")
    assert len(train) + len(heldout) == 200 and len(heldout) >= 50
    assert not {t["id"] for t in train} & {t["id"] for t in heldout}


def test_classes_filter_and_compact_docs() -> None:
    env = BFCLMultiTurnEnv(classes=["TradingBot"], compact_docs=True)
    tasks = env.tasks("train")
    assert tasks and all(t["involved_classes"] == ["TradingBot"] for t in tasks)
    _, info = env.reset(options={"task": tasks[0]})
    assert not any("This tool belongs to" in t["function"]["description"] for t in info["tools"])
    assert "This tool belongs to" in BFCLMultiTurnEnv().reset(options={"task": tasks[0]})[1]["tools"][0]["function"]["description"]
    with pytest.raises(ConfigError, match="Trading"):
        BFCLMultiTurnEnv(classes=["Trading"])


def test_ground_truth_episode_earns_full_reward_and_user_turns_arrive_in_order() -> None:
    task = _task("multi_turn_base_0")
    env = BFCLMultiTurnEnv()
    messages, info = env.reset(options={"task": task})
    assert messages == task["turns"][0]
    assert {t["function"]["name"] for t in info["tools"]} >= {"cd", "mv", "post_tweet"}
    calls = ground_truth_calls(task)
    total, info, observations = _play(env, task, calls)
    assert total == pytest.approx(1.0)
    assert info["correct"] == info["task_correct"] == 1.0 and info["turn_accuracy"] == 1.0
    assert info["num_calls"] == sum(len(t) for t in task["ground_truth"]) and info["well_formed"] == 1.0
    # a tool message per call; the step that ends turn k brings turn k+1's user message
    first = observations[0]
    assert [m["role"] for m in first] == ["tool"] * len(task["ground_truth"][0])
    assert first[0]["content"] == '{"current_working_directory": "document"}'
    assert observations[1] == task["turns"][1]


def test_no_calls_earn_nothing_and_partial_turns_earn_their_share() -> None:
    task = _task("multi_turn_base_0")
    env = BFCLMultiTurnEnv()
    empty = [[] for _ in task["turns"]]
    total, info, _ = _play(env, task, empty)
    assert total == 0.0 and info["correct"] == 0.0 and info["num_calls"] == 0 and info["well_formed"] == 0.0
    calls = ground_truth_calls(task)
    first_only = [calls[0]] + empty[1:]
    total, info, _ = _play(env, task, first_only)
    judged = sum(1 for gt in task["ground_truth"] if gt)
    assert total == pytest.approx(1 / judged) and info["turn_accuracy"] == pytest.approx(1 / judged)
    assert info["correct"] == 0.0


def test_each_episode_gets_fresh_instances_and_the_task_is_not_mutated() -> None:
    task = _task("multi_turn_base_90")  # posts a tweet, then extends its mentions
    before = json.dumps(task, sort_keys=True)
    env = BFCLMultiTurnEnv()
    calls = ground_truth_calls(task)
    for _ in range(2):  # the second episode starts from the same state and scores the same
        total, info, _ = _play(env, task, calls)
        assert total == pytest.approx(1.0) and info["correct"] == 1.0
    assert json.dumps(task, sort_keys=True) == before
    env.reset(options={"task": task})
    fresh = ApiSession(task["involved_classes"], task["initial_config"])
    assert env.unwrapped._session.state() == fresh.state()


def test_omitted_mutable_default_is_not_shared_between_episodes() -> None:
    task = _task("multi_turn_base_90")
    sessions = [ApiSession(task["involved_classes"], task["initial_config"]) for _ in range(2)]
    for s in sessions:
        s.call("authenticate_twitter", {"username": "wanderlust_emma", "password": "Tr@vel2023Secure"})
    posted = json.loads(sessions[0].call("post_tweet", {"content": "hi"}))
    sessions[0].call("mention", {"tweet_id": posted["id"], "mentioned_usernames": ["@a"]})
    assert json.loads(sessions[1].call("post_tweet", {"content": "hi"}))["mentions"] == []


def test_miss_func_withholds_the_doc_until_its_turn() -> None:
    task = _task("multi_turn_miss_func_0")  # 'sort' arrives at turn 3
    env = gymnasium.make("relax/BFCL-multi-turn-miss-func-v0")
    _, info = env.reset(options={"task": task})
    assert "sort" not in {t["function"]["name"] for t in info["tools"]}
    for _ in range(3):
        obs, _, _, _, info = env.step(ANSWER)
    assert [t["function"]["name"] for t in info["tools_added"]] == ["sort"]
    assert obs[-1]["role"] == "user" and obs[-1]["content"].endswith(ADDED_FUNCTIONS_PROMPT.split("\n", 1)[1])
    assert '"name": "sort"' in obs[-1]["content"]
    offered, added = task_docs(task)
    assert [d["name"] for d in added[3]] == ["sort"] and "sort" not in {d["name"] for d in offered}
    assert task_docs(json.loads(json.dumps(task)))[1].keys() == {3}  # a task sent as JSON has str keys


@pytest.mark.parametrize("category", ["multi_turn_miss_func", "multi_turn_miss_param"])
def test_miss_variants_ground_truth_earns_full_reward(category: str) -> None:
    env = BFCLMultiTurnEnv(category=category)
    for task in load_tasks(category)[:20]:
        total, info, _ = _play(env, task, ground_truth_calls(task))
        assert total == pytest.approx(1.0) and info["correct"] == 1.0, task["id"]


def test_bad_calls_become_error_results_not_crashes() -> None:
    task = _task("multi_turn_base_0")
    env = BFCLMultiTurnEnv()
    env.reset(options={"task": task})
    action = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "no_such_tool", "arguments": {}}},
        {"id": "b", "type": "function", "function": {"name": "cd", "arguments": {"dir": "x"}}},
        {"id": "d", "type": "function", "function": {"name": "_load_scenario", "arguments": {}}}]}
    obs, reward, terminated, _, info = env.step(action)
    assert [m["tool_call_id"] for m in obs] == ["a", "b", "d"] and reward == 0.0 and not terminated
    assert obs[0]["content"] == "Error during execution: name 'no_such_tool' is not defined"
    assert obs[1]["content"].startswith("Error during execution: ") and "dir" in obs[1]["content"]
    assert obs[2]["content"] == "Error during execution: name '_load_scenario' is not defined"
    assert info["num_calls"] == 3 and info["well_formed"] == 0.0 and info["turn"] == 0


@pytest.mark.parametrize("undecodable", [
    {"parse_errors": ["tool call is not valid JSON"]},
    {"tool_calls": [{"id": "c", "type": "function", "function": {"name": "cd", "arguments": "{not json"}}]},
])
def test_a_message_with_an_undecodable_call_is_dropped_whole(undecodable: dict[str, Any]) -> None:
    """As BFCL: none of the message's calls run (the good ``cd`` neither), and the turn ends."""
    task = _task("multi_turn_base_0")
    env = BFCLMultiTurnEnv()
    env.reset(options={"task": task})
    good = {"id": "g", "type": "function", "function": {"name": "cd", "arguments": {"folder": "document"}}}
    action = {"role": "assistant", "content": "", "tool_calls": [good, *undecodable.get("tool_calls", [])],
              **{k: v for k, v in undecodable.items() if k != "tool_calls"}}
    obs, reward, terminated, _, info = env.step(action)
    assert [m["role"] for m in obs] == ["user"] and obs == task["turns"][1]  # the next user turn, no tool results
    assert info["turn"] == 1 and reward == 0.0 and not terminated
    assert info["num_calls"] == 2 and info["well_formed"] == 0.0
    assert "no tool call" in info["reason"]


def test_step_limit_force_ends_the_turn_and_fails_the_task() -> None:
    task = _task("multi_turn_base_0")
    env = BFCLMultiTurnEnv(max_steps_per_turn=1)
    env.reset(options={"task": task})
    calls = ground_truth_calls(task)
    obs, reward, *_ = env.step(_message(calls[0][0][:1]))
    assert [m["role"] for m in obs] == ["tool"]
    obs, reward, terminated, _, info = env.step(_message(calls[0][0][1:]))  # a 2nd message with calls
    assert obs[-1:] == task["turns"][1] and info["turn"] == 1 and info["forced_turn_end"] == 1.0
    judged = sum(1 for gt in task["ground_truth"] if gt)
    assert reward == pytest.approx(1 / judged)  # the turn itself is right
    for turn in calls[1:]:
        for step in turn:
            env.step(_message(step))
        *_, info = env.step(ANSWER)
    assert info["turn_accuracy"] == 1.0 and info["correct"] == 0.0  # BFCL fails a force-quit task


def test_long_results_are_truncated_for_the_model() -> None:
    task = _task("multi_turn_base_0")
    env = BFCLMultiTurnEnv(max_observation_chars=100)
    env.reset(options={"task": task})
    obs, *_ = env.step(_message([{"name": "echo", "arguments": {"content": "x" * 500}}]))
    assert obs[0]["content"].startswith('{"terminal_output": "xxx') and len(obs[0]["content"]) < 200
    assert obs[0]["content"].endswith("truncated 423 characters]")


def test_huge_exponent_is_refused_quickly() -> None:
    session = ApiSession(["MathAPI"], {})
    assert session.call("power", {"base": 10, "exponent": MAX_EXPONENT * 1000}).startswith("Error during execution: ")
    assert json.loads(session.call("power", {"base": 2, "exponent": 10})) == {"result": 1024}


def test_contract_errors() -> None:
    env = BFCLMultiTurnEnv()
    with pytest.raises(EnvError, match="reset"):
        env.step(ANSWER)
    env.reset(seed=0)
    with pytest.raises(EnvError, match="assistant message"):
        env.step("hello")
    with pytest.raises(ConfigError, match="category"):
        BFCLMultiTurnEnv(category="multi_turn_composite")
    with pytest.raises(ConfigError, match="max_steps_per_turn"):
        BFCLMultiTurnEnv(max_steps_per_turn=-1)


def test_reset_without_task_is_deterministic_under_seed() -> None:
    env = BFCLMultiTurnEnv(split="heldout")
    first, info_a = env.reset(seed=3)
    again, info_b = env.reset(seed=3)
    assert first == again and info_a["task_id"] == info_b["task_id"]
    assert info_a["task_id"] in {t["id"] for t in env.tasks("heldout")}


def test_parse_call_and_result_format() -> None:
    assert parse_call("sort('a.txt')") == ("sort", ["a.txt"], {})
    assert parse_call("mv(source='a', destination=['b', 1])") == ("mv", [], {"source": "a", "destination": ["b", 1]})
    with pytest.raises(DataError):
        parse_call("__import__('os').system('ls')")
    with pytest.raises(DataError):
        parse_call("cd(folder=x)")
    assert format_result({"a": 1}) == '{"a": 1}' and format_result(3) == "3" and format_result("s") == "s"


@pytest.mark.parametrize("env_id", sorted(MULTI_TURN_ENV_IDS))
def test_contract_suite_and_gymnasium_checker_pass(env_id: str) -> None:
    from relax_agent.envs.testing import run_contract

    assert run_contract(lambda: gymnasium.make(env_id)) == {}
