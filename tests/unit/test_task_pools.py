"""Disjoint task pools (relax_agent.pools): the warm-up's demonstrations, RL's tasks and the held-out
tasks never share a task, nor a near-duplicate of one; the cut is deterministic."""

from __future__ import annotations

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401  (registers the relax/ ids)
from relax_agent.config import load_config
from relax_agent.errors import ConfigError
from relax_agent.pools import jaccard, near_duplicate, split_pools, task_words

CATEGORIES = ["multiple", "live_simple", "parallel"]


def _splits(**kwargs):
    env = gymnasium.make("relax/BFCL-simple-v0", **kwargs)
    try:
        return env.unwrapped.tasks("train"), env.unwrapped.tasks("heldout")
    finally:
        env.close()


def _by_id(tasks):
    return {t["id"]: t for t in tasks}


def _task(category, question, functions=("f",), task_id="t"):
    return {"id": task_id, "category": category, "question": [{"role": "user", "content": question}],
            "functions": [{"name": name} for name in functions]}


def test_bfcl_own_near_duplicates_are_caught_at_0_5_and_distinct_tasks_are_not():
    tasks = _by_id(load_all := _splits()[0] + _splits()[1])
    assert len(load_all) == 400
    # the pairs named in the issue: same function, reworded question
    assert jaccard(task_words(tasks["simple_python_11"]), task_words(tasks["simple_python_0"])) == pytest.approx(12 / 15)
    assert jaccard(task_words(tasks["simple_python_97"]), task_words(tasks["simple_python_1"])) == pytest.approx(5 / 9)
    assert near_duplicate(tasks["simple_python_11"], tasks["simple_python_0"], 0.5)
    assert near_duplicate(tasks["simple_python_97"], tasks["simple_python_1"], 0.5)
    assert not near_duplicate(tasks["simple_python_0"], tasks["simple_python_1"], 0.5)  # other function, other words
    # same words but other functions is no duplicate; same functions and words is
    assert not near_duplicate(_task("a", "add two and three", ["add"]), _task("a", "add two and three", ["sum"]), 0.5)
    assert near_duplicate(_task("a", "Add two and three!", ["add"]), _task("b", "add two, and three", ["add"]), 1.0)


def test_the_three_pools_are_disjoint_by_id_and_by_near_duplicate_check_with_other_categories():
    train, heldout = _splits(train_categories=CATEGORIES)
    assert len(train) == 327 + 161 + 211 + 162 and len(heldout) == 73  # held-out stays simple_python's
    assert {t["category"] for t in heldout} == {"simple_python"}
    pools = split_pools(train, heldout, warmup_fraction=0.5, near_duplicate_jaccard=0.5)
    warm, rl, held = ({t["id"] for t in p} for p in (pools.warmup, pools.rl, heldout))
    assert not warm & rl and not warm & held and not rl & held
    assert len(warm) == len(pools.warmup) and len(rl) == len(pools.rl)  # no task twice within a pool
    # every train task is in exactly one pool or dropped as a held-out near-duplicate
    assert warm | rl | set(pools.dropped) == {t["id"] for t in train}
    assert {"simple_python_0", "simple_python_1"} <= set(pools.dropped)  # _11 and _97 are held out
    for kept in pools.warmup + pools.rl:
        assert not any(near_duplicate(kept, h, 0.5) for h in heldout), kept["id"]
    for w in pools.warmup:
        assert not any(near_duplicate(w, r, 0.5) for r in pools.rl), w["id"]  # a cluster goes to one pool
    # the categories are spread over both pools, about half each
    for category in ["simple_python", *CATEGORIES]:
        n_warm = sum(t["category"] == category for t in pools.warmup)
        n_rl = sum(t["category"] == category for t in pools.rl)
        assert 0.35 < n_warm / (n_warm + n_rl) < 0.65, (category, n_warm, n_rl)


def test_pools_are_deterministic_in_train_order_and_independent_of_the_input_order():
    train, heldout = _splits(train_categories=["multiple"])
    a = split_pools(train, heldout, 0.3, 0.5)
    b = split_pools(list(reversed(train)), heldout, 0.3, 0.5)
    assert [t["id"] for t in a.warmup] == [t["id"] for t in split_pools(train, heldout, 0.3, 0.5).warmup]
    assert {t["id"] for t in a.warmup} == {t["id"] for t in b.warmup}
    assert {t["id"] for t in a.rl} == {t["id"] for t in b.rl}
    order = {t["id"]: i for i, t in enumerate(train)}
    assert [order[t["id"]] for t in a.rl] == sorted(order[t["id"]] for t in a.rl)
    assert 0.2 < len(a.warmup) / (len(a.warmup) + len(a.rl)) < 0.4
    # a larger fraction only moves clusters from RL's pool to the warm-up's
    c = split_pools(train, heldout, 0.6, 0.5)
    assert {t["id"] for t in a.warmup} < {t["id"] for t in c.warmup}


def test_near_duplicate_train_tasks_land_in_the_same_pool():
    train = [_task("x", f"please compute the sum of {n} and seven now", ["add"], f"t{n}") for n in range(20)]
    train += [_task("x", f"a different request number {n} entirely", ["mul"], f"u{n}") for n in range(20)]
    heldout = [_task("x", "please compute the sum of 3 and seven now", ["sub"], "h0")]
    pools = split_pools(train, heldout, 0.5, 0.8)
    assert pools.dropped == []  # the held-out task offers another function
    groups = [{t["id"][0] for t in p} for p in (pools.warmup, pools.rl)]
    # the "t" tasks form one cluster (one pool); the "u" ones share too few words and spread over both
    assert sum("t" in g for g in groups) == 1
    pools = split_pools(train, [_task("x", "please compute the sum of 3 and seven now", ["add"], "h0")], 0.5, 0.8)
    assert sorted(pools.dropped) == sorted(f"t{n}" for n in range(20))


def test_no_split_keeps_one_pool_and_the_check_off_keeps_every_task():
    train, heldout = _splits()
    pools = split_pools(train, heldout)
    assert pools.warmup == pools.rl == train and pools.dropped == []
    pools = split_pools(train, heldout, 0.0, 0.5)
    assert pools.warmup == pools.rl and len(pools.rl) == len(train) - len(pools.dropped) == 325


@pytest.mark.parametrize(("fraction", "threshold", "bad"), [(1.0, 0.0, "warmup_fraction=1.0"), (-0.1, 0.0, "warmup_fraction"),
                                                            (0.5, 1.5, "near_duplicate_jaccard=1.5")])
def test_bad_fractions_are_refused_naming_the_key(fraction, threshold, bad):
    with pytest.raises(ConfigError, match=bad):
        split_pools([], [], fraction, threshold)


def test_config_surface_validates_the_pool_keys():
    cfg = load_config(None, ["env.warmup_fraction=0.5", "env.near_duplicate_jaccard=0.5"])
    assert (cfg.env.warmup_fraction, cfg.env.near_duplicate_jaccard) == (0.5, 0.5)
    with pytest.raises(ConfigError, match="env.warmup_fraction"):
        load_config(None, ["env.warmup_fraction=1.0"])


def test_bfcl_train_categories_are_checked_and_judged_by_their_own_rules():
    with pytest.raises(ConfigError, match="train_categories"):
        gymnasium.make("relax/BFCL-simple-v0", train_categories=["nope"])
    with pytest.raises(ConfigError, match="train_categories"):
        gymnasium.make("relax/BFCL-simple-v0", train_categories=["simple_python"])
    env = gymnasium.make("relax/BFCL-simple-v0", train_categories=["multiple"])
    try:
        task = next(t for t in env.unwrapped.tasks("train") if t["category"] == "multiple")
        reply = env.unwrapped.demonstration(task)
        env.reset(seed=0, options={"task": task})
        assert env.step(reply)[1:3] == (1.0, True)
        env.reset(seed=0, options={"task": task})
        wrong = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": task["functions"][0]["name"], "arguments": "{}"}}]}
        assert env.step(wrong)[4]["correct"] == 0.0
    finally:
        env.close()
