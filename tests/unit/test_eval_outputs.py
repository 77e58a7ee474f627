"""Evaluation outputs: per-sample records, failure-reason table, BFCL leaderboard grouping."""

from __future__ import annotations

import pytest

from relax_agent.evaluation import bfcl_leaderboard, failure_table, reason_kind, sample_record
from relax_agent.records import Trajectory


def _traj(messages, correct: float, reward: float = 0.0, error=None) -> Trajectory:
    return Trajectory(sample_id="e/g0/0", group_id="e/g0", task_id="t1", token_ids=(1, 2), loss_mask=(0, 1),
                      rollout_logprobs=(0.0, -1.0), prompt_len=1, turns=(), reward=reward, messages=tuple(messages),
                      metrics={"correct": correct}, error=error, reward_status="error" if error else "ok")


def test_sample_record_splits_prompt_response_and_calls():
    example = {"role": "assistant", "content": "<tool_call>{...}</tool_call>"}  # a worked example: no tool_calls key
    sampled = {"role": "assistant", "content": '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
               "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
               "parse_errors": ["bad block"]}
    tool = {"role": "tool", "tool_call_id": "call_0", "content": "42"}
    traj = _traj([{"role": "system", "content": "s"}, example, {"role": "user", "content": "q"}, sampled, tool], 1.0, 1.0)
    record = sample_record(traj, {"id": "t1"}, 3, None)
    assert [m["role"] for m in record["prompt"]] == ["system", "assistant", "user"]
    assert record["response"] == [sampled["content"]] and record["conversation"] == [tool]
    assert record["parsed_calls"] == [{"calls": [{"name": "f", "arguments": {"x": 1}}], "parse_errors": ["bad block"]}]
    assert record["verdict"]["correct"] == 1.0 and record["verdict"]["reason"] == "ok" and record["seed"] == 3
    failed = sample_record(_traj([], 0.0, error="EnvError: boom"), {"id": "t1"}, 0, None)
    assert failed["verdict"]["reason"] == "episode failed: EnvError: boom"
    assert sample_record(traj, {"id": "t1"}, 0, "wrong city")["verdict"]["reason"] == "wrong city"


def test_failure_table_groups_reasons_of_one_kind():
    assert reason_kind("call 0 (f): parameter 'city': 'Rome' is not one of ['Paris']") == \
        reason_kind("call 1 (g): parameter 'unit': 'K' is not one of ['C', 'F']")
    records = [{"verdict": {"correct": 0.0, "reason": r}} for r in
               ["parameter 'a': 1 is not one of [2]", "parameter 'b': 3 is not one of [4]", "no tool call"]]
    records.append({"verdict": {"correct": 1.0, "reason": "ok"}})
    assert failure_table(records) == [("parameter …: N is not one of …", 2), ("no tool call", 1)]


def test_leaderboard_groups_as_bfcl_v4():
    acc = {"simple_python": 0.9, "simple_java": 0.6, "simple_javascript": 0.3, "multiple": 0.8, "parallel": 0.7,
           "parallel_multiple": 0.5, "live_simple": 0.6, "live_multiple": 0.4, "live_parallel": 1.0,
           "live_parallel_multiple": 0.0, "irrelevance": 0.9, "live_irrelevance": 0.7, "live_relevance": 0.5,
           "multi_turn_base": 0.4, "multi_turn_miss_func": 0.2, "multi_turn_miss_param": 0.3,
           "multi_turn_long_context": 0.1}
    counts = {c: 10 for c in acc} | {"live_multiple": 30}
    board = bfcl_leaderboard({c: (a, counts[c]) for c, a in acc.items()})
    assert board["non_live_ast"] == pytest.approx(((0.9 + 0.6 + 0.3) / 3 + 0.8 + 0.7 + 0.5) / 4)
    assert board["live"] == pytest.approx((0.6 * 10 + 0.4 * 30 + 1.0 * 10 + 0.0 * 10) / 60)  # weighted by tasks
    assert board["multi_turn"] == pytest.approx(0.25) and board["irrelevance"] == pytest.approx(0.8)
    assert board["relevance"] == pytest.approx(0.5)
    expected = (10 * board["non_live_ast"] + 10 * board["live"] + 10 * board["irrelevance"] + 30 * board["multi_turn"]) / 60
    assert board["overall"] == pytest.approx(expected)
    partial = bfcl_leaderboard({"simple_python": (1.0, 5), "irrelevance": (1.0, 5), "live_irrelevance": (0.0, 5)})
    assert partial == {"irrelevance": 0.5}  # groups with a category missing are left out, and so is overall
