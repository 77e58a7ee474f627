"""Our multi-turn checker against BFCL's own, on the shipped data.

BFCL's ``multi_turn_checker`` imports without bfcl-eval's heavy dependencies, so it is run
directly: on every task's ground-truth call sequence (all must pass) and on corrupted sequences
(a dropped call, a changed argument value, swapped calls, a wrong function), where both checkers
must agree and the corrupted sequences must fail.
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest

from relax_agent.envs.bfcl.multi_turn_api import ApiSession
from relax_agent.envs.bfcl.multi_turn_checker import check_task, ground_truth_calls, missing_results
from relax_agent.envs.bfcl.multi_turn_data import CATEGORIES, class_docs, load_tasks

bfcl_checker = pytest.importorskip("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker")
bfcl_utils = pytest.importorskip("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils")

_RUN_IDS = itertools.count()
Calls = list[list[list[dict[str, Any]]]]


def _to_string(call: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in call["arguments"].items())
    return f"{call['name']}({args})"


def bfcl_verdict(task: dict[str, Any], calls: Calls) -> bool:
    """BFCL's ``multi_turn_checker`` on ``calls`` (as the call strings its decoder produces)."""
    model_name = f"relax_check_{next(_RUN_IDS)}"
    decoded = [[[_to_string(c) for c in step] for step in turn if step] for turn in calls]
    entry = {"id": task["id"], "initial_config": task["initial_config"], "involved_classes": task["involved_classes"]}
    try:
        result = bfcl_checker.multi_turn_checker(decoded, task["ground_truth"], entry, task["category"], model_name)
    finally:  # BFCL keeps instances in module globals keyed by model name: drop this run's
        for key in [k for k in vars(bfcl_utils) if k.startswith(model_name)]:
            del vars(bfcl_utils)[key]
    return bool(result["valid"])


def _judged_turns(calls: Calls, task: dict[str, Any]) -> list[int]:
    return [i for i, gt in enumerate(task["ground_truth"]) if gt]


def drop_call(task: dict[str, Any], calls: Calls) -> Calls:
    """Remove the last call of the last judged turn."""
    out = copy.deepcopy(calls)
    turn = _judged_turns(calls, task)[-1]
    out[turn][0].pop()
    out[turn] = [s for s in out[turn] if s]
    return out


def _changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 7
    if isinstance(value, str):
        return value + "_changed"
    if isinstance(value, list):
        return value + value[:1] if value else ["changed"]
    return None


def change_argument(task: dict[str, Any], calls: Calls) -> Calls | None:
    """Change the first scalar/list argument value of the last judged turn that has one."""
    out = copy.deepcopy(calls)
    for turn in reversed(_judged_turns(calls, task)):
        for call in out[turn][0]:
            for key, value in call["arguments"].items():
                if _changed(value) is not None:
                    call["arguments"][key] = _changed(value)
                    return out
    return None


def swap_calls(task: dict[str, Any], calls: Calls) -> Calls | None:
    """Swap the first two different calls of a judged turn that has them (dependent or not)."""
    out = copy.deepcopy(calls)
    for turn in _judged_turns(calls, task):
        step = out[turn][0]
        if len(step) >= 2 and step[0] != step[1]:
            step[0], step[1] = step[1], step[0]
            return out
    return None


def wrong_function(task: dict[str, Any], calls: Calls) -> Calls:
    """Replace the last call of the last judged turn with another function of the task, same arguments."""
    out = copy.deepcopy(calls)
    turn = _judged_turns(calls, task)[-1]
    call = out[turn][0][-1]
    names = sorted(d["name"] for c in task["involved_classes"] for d in class_docs(c) if d["name"] != call["name"])
    call["name"] = names[len(call["name"]) % len(names)]
    return out


def _replay(task: dict[str, Any], calls: Calls) -> list[tuple[list[str], str]]:
    """Per turn: the sorted results and the state after it, on a fresh session."""
    session, out = ApiSession(task["involved_classes"], task["initial_config"]), []
    for turn in calls:
        results = sorted(session.call(c["name"], c["arguments"]) for step in turn for c in step)
        out.append((results, repr(session.state())))
    return out


def effective(task: dict[str, Any], calls: Calls, bad: Calls) -> bool:
    """The corruption changes some turn's results or state, and the corrupted turn's ground-truth
    results did not already come back in an earlier turn.

    No-op corruptions may pass: swapping two independent calls, adding a stock that is already
    on the watch list. So may corrupting a turn whose results the model already has: BFCL looks
    for a turn's ground-truth results among the results of all turns so far
    (``multi_turn_base_139``: ``add_to_watchlist`` returns the watch list that ``get_watchlist``
    returns in the next turn).
    """
    replay = _replay(task, calls)
    if replay == _replay(task, bad):
        return False
    turn = next(i for i, (a, b) in enumerate(zip(calls, bad)) if a != b)
    earlier = [r for results, _ in replay[:turn] for r in results]
    return bool(missing_results(earlier, replay[turn][0]))


def _json_round_trip(calls: Calls) -> Calls:
    return json.loads(json.dumps(calls))  # what a model's JSON tool calls can express


@pytest.mark.slow
@pytest.mark.parametrize("category", CATEGORIES)
def test_ground_truth_passes_both_checkers(category: str) -> None:
    tasks = load_tasks(category)
    assert len(tasks) == 200
    for task in tasks:
        calls = _json_round_trip(ground_truth_calls(task))
        ours = check_task(task, calls)
        assert ours.correct and ours.turn_accuracy == 1.0, (task["id"], ours)
        assert bfcl_verdict(task, calls), task["id"]


@pytest.mark.slow
@pytest.mark.parametrize("category", CATEGORIES)
def test_corrupted_sequences_fail_in_both_checkers(category: str) -> None:
    counts = {"drop": 0, "change": 0, "swap": 0, "wrong": 0}
    disagreements, passed = [], []
    for task in load_tasks(category):
        calls = _json_round_trip(ground_truth_calls(task))
        variants = {"drop": drop_call(task, calls), "change": change_argument(task, calls),
                    "swap": swap_calls(task, calls), "wrong": wrong_function(task, calls)}
        for kind, bad in variants.items():
            if bad is None:
                continue
            ours, theirs = check_task(task, bad).correct, bfcl_verdict(task, bad)
            if ours != theirs:
                disagreements.append((task["id"], kind, ours, theirs))
            if effective(task, calls, bad):
                counts[kind] += 1
                if ours:
                    passed.append((task["id"], kind))
    assert disagreements == []
    assert passed == []
    assert counts["drop"] > 180 and counts["change"] > 150 and counts["swap"] > 20 and counts["wrong"] > 180, counts
