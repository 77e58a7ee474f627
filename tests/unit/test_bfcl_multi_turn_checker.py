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
    turn = next(i for i, (a, b) in enumerate(zip(calls, bad, strict=False)) if a != b)
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
    disagreements, passed, compared = [], [], 0
    for task in load_tasks(category):
        calls = _json_round_trip(ground_truth_calls(task))
        variants = {"drop": drop_call(task, calls), "change": change_argument(task, calls),
                    "swap": swap_calls(task, calls), "wrong": wrong_function(task, calls)}
        for kind, bad in variants.items():
            if bad is None:
                continue
            ours, theirs = check_task(task, bad).correct, bfcl_verdict(task, bad)
            compared += 1
            if ours != theirs or check_task(task, bad, bfcl_compat=True).correct != theirs:
                disagreements.append((task["id"], kind, ours, theirs))
            if effective(task, calls, bad):
                counts[kind] += 1
                if ours:
                    passed.append((task["id"], kind))
    print(f"\n{category}: {compared - len(disagreements)}/{compared} corrupted sequences agree with BFCL")
    assert disagreements == []
    assert passed == []
    assert counts["drop"] > 180 and counts["change"] > 150 and counts["swap"] > 20 and counts["wrong"] > 180, counts


# ---------------------------------------------------------------- decode rule and bfcl_compat
TWITTER_TASK = {
    "id": "compat_twitter", "category": "multi_turn_base",
    "turns": [[{"role": "user", "content": "Post 'hi'."}], [{"role": "user", "content": "Comment 'nice' on it."}]],
    "initial_config": {"TwitterAPI": {"username": "ann", "password": "pw", "authenticated": True, "tweets": {},
                                      "comments": {}, "retweets": {}, "following_list": [], "tweet_counter": 0}},
    "involved_classes": ["TwitterAPI"], "missed_functions": {}, "long_context": False,
    "ground_truth": [["post_tweet(content='hi')"], ["comment(tweet_id=0, comment_content='nice')"]],
}
"""A task where BFCL's shared ``mentions=[]`` default decides the verdict: the model's extra
``mention`` extends the one default list, which the ground truth's tweet holds too."""


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def test_compat_shares_mutable_defaults_as_bfcl_does() -> None:
    from relax_agent.envs.bfcl.multi_turn_api import api_class

    twitter = api_class("TwitterAPI")
    saved = copy.deepcopy(twitter.post_tweet.__defaults__)
    calls = [[[_call("post_tweet", content="hi")]],
             [[_call("comment", tweet_id=0, comment_content="nice"), _call("mention", tweet_id=0, mentioned_usernames=["@bob"])]]]
    try:
        theirs = bfcl_verdict(TWITTER_TASK, calls)
    finally:  # BFCL's run extended the real default list: put it back for every later session
        twitter.post_tweet.__defaults__ = saved
    assert twitter.post_tweet.__defaults__ == ([], [])
    assert theirs is True
    assert check_task(TWITTER_TASK, calls, bfcl_compat=True).correct is True
    ours = check_task(TWITTER_TASK, calls)
    assert ours.correct is False and "tweets" in ours.turns[1].reason
    # without the extra mention both agree
    plain = [calls[0], [[calls[1][0][0]]]]
    assert check_task(TWITTER_TASK, plain).correct and check_task(TWITTER_TASK, plain, bfcl_compat=True).correct


def test_compat_env_matches_offline_check() -> None:
    from relax_agent.envs.bfcl.multi_turn import BFCLMultiTurnEnv

    def message(*calls: dict[str, Any]) -> dict[str, Any]:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": c} for i, c in enumerate(calls)]}

    for compat, expected in ((False, 0.0), (True, 1.0)):
        env = BFCLMultiTurnEnv(bfcl_compat=compat)
        env.reset(options={"task": TWITTER_TASK})
        env.step(message(_call("post_tweet", content="hi")))
        env.step({"role": "assistant", "content": "Posted."})
        env.step(message(_call("comment", tweet_id=0, comment_content="nice"),
                         _call("mention", tweet_id=0, mentioned_usernames=["@bob"])))
        _, _, terminated, _, info = env.step({"role": "assistant", "content": "Done."})
        assert terminated and info["correct"] == expected, compat
        env.close()


def test_undecodable_step_is_dropped_whole() -> None:
    """BFCL drops a step whose calls do not all decode; the good call in it does not run either."""
    task = load_tasks("multi_turn_base")[0]
    calls = _json_round_trip(ground_truth_calls(task))
    assert check_task(task, calls).correct
    spoiled = copy.deepcopy(calls)
    spoiled[0][0].append({"name": "cd", "arguments": "{not json"})
    assert not check_task(task, spoiled).correct and not check_task(task, spoiled, bfcl_compat=True).correct
    extra = copy.deepcopy(calls)
    extra[0].append([_call("cd", folder="document"), {"name": None, "arguments": None, "error": "not JSON"}])
    assert check_task(task, extra).correct  # the dropped step's cd never ran
