"""LocalReward: signatures, sync/async, batched, per-item errors and timeouts, target loading."""

import asyncio
import threading
import time

import pytest

from relax_agent.errors import ConfigError
from relax_agent.reward_services import LocalReward, RewardItem, RewardResult, RewardStatus, load_target


def run(coro):
    return asyncio.run(coro)


def items(*ids, **fields):
    return [RewardItem(id=i, **fields) for i in ids]


def test_per_item_keyword_parameters_and_return_forms():
    def fn(response, ground_truth, metadata):
        if metadata.get("form") == "dict":
            return {"reward": 0.5, "metrics": {"len": len(response)}, "extra": {"gt": ground_truth}}
        if metadata.get("form") == "result":
            return RewardResult(id="ignored", reward=2.0)
        return float(response == ground_truth)

    out = run(LocalReward(fn).score([
        RewardItem(id="a", response="x", ground_truth="x"),
        RewardItem(id="b", response="y", ground_truth="x"),
        RewardItem(id="c", response="abc", ground_truth="g", metadata={"form": "dict"}),
        RewardItem(id="d", metadata={"form": "result"}),
    ]))
    assert [(r.id, r.reward) for r in out] == [("a", 1.0), ("b", 0.0), ("c", 0.5), ("d", 2.0)]
    assert out[2].metrics == {"len": 3.0} and out[2].extra == {"gt": "g"}


def test_item_and_var_kwargs_parameters():
    assert run(LocalReward(lambda item: len(item.id)).score(items("abc")))[0].reward == 3.0
    assert run(LocalReward(lambda **kw: len(kw["messages"])).score(items("a", messages=[{}, {}])))[0].reward == 2.0


def test_sync_functions_run_off_the_event_loop():
    loop_thread = []

    def fn(id):
        loop_thread.append(threading.current_thread() is threading.main_thread())
        time.sleep(0.2)
        return 1.0

    started = time.monotonic()
    out = run(LocalReward(fn, max_concurrency=8).score(items(*"abcdefgh")))
    assert all(r.ok for r in out)
    assert loop_thread == [False] * 8
    assert time.monotonic() - started < 1.0  # 8 x 0.2 s ran concurrently


def test_exception_fails_only_that_item():
    def fn(id):
        if id == "bad":
            raise KeyError("no such field")
        return 1.0

    out = run(LocalReward(fn).score(items("a", "bad", "c")))
    assert [r.status for r in out] == [RewardStatus.OK, RewardStatus.ERROR, RewardStatus.OK]
    assert out[1].reward is None and "KeyError: 'no such field' at " in out[1].extra["error"]


def test_bad_return_values_fail_the_item():
    values = {"s": "1.0", "n": float("nan"), "d": {"score": 1}}
    out = run(LocalReward(lambda id: values[id]).score(items(*values)))
    assert all(r.status is RewardStatus.ERROR for r in out)
    assert "expected a number" in out[0].extra["error"] and "finite in float32" in out[1].extra["error"]


def test_per_item_timeout_async_and_sync():
    async def slow_async(id):
        await asyncio.sleep(5 if id == "slow" else 0)
        return 1.0

    def slow_sync(id):
        time.sleep(2 if id == "slow" else 0)
        return 1.0

    for fn in (slow_async, slow_sync):
        started = time.monotonic()
        out = run(LocalReward(fn, timeout_s=0.3).score(items("fast", "slow")))
        assert [r.status for r in out] == [RewardStatus.OK, RewardStatus.TIMEOUT]
        assert "timeout_s=0.3" in out[1].extra["error"]
        assert time.monotonic() - started < 1.5


def test_batched_signature_gets_one_call():
    calls = []

    async def batch(items):
        calls.append([i.id for i in items])
        return [1.0, ValueError("bad item"), {"reward": 0.0}]

    out = run(LocalReward(batch).score(items("a", "b", "c")))
    assert calls == [["a", "b", "c"]]
    assert [r.status for r in out] == [RewardStatus.OK, RewardStatus.ERROR, RewardStatus.OK]
    assert "ValueError: bad item" in out[1].extra["error"]


def test_batched_failures_and_wrong_length():
    def raises(items):
        raise RuntimeError("model down")

    out = run(LocalReward(raises).score(items("a", "b")))
    assert all(r.status is RewardStatus.ERROR and "model down" in r.extra["error"] for r in out)
    out = run(LocalReward(lambda items: [1.0]).score(items("a", "b")))
    assert all("returned 1 values for 2 items" in r.extra["error"] for r in out)

    def slow(items):
        time.sleep(1)

    out = run(LocalReward(slow, timeout_s=0.2).score(items("a", "b")))
    assert all(r.status is RewardStatus.TIMEOUT for r in out)


def test_bad_signatures_are_config_errors():
    with pytest.raises(ConfigError, match="required parameter 'answer'"):
        LocalReward(lambda answer: 1.0)
    with pytest.raises(ConfigError, match="only 'items'"):
        LocalReward(lambda items, scale: 1.0)
    with pytest.raises(ConfigError, match="timeout_s must be > 0"):
        LocalReward(lambda id: 1.0, timeout_s=0)


def test_load_target_module_and_path_forms(tmp_path, monkeypatch):
    mod = tmp_path / "my_reward_mod.py"
    mod.write_text("def score(id):\n    return 7.0\n\nclass Scaled:\n    def __init__(self, k=2.0):\n        self.k = k\n"
                   "    def __call__(self, id):\n        return self.k\n")
    assert load_target(f"{mod}:score")(id="x") == 7.0
    monkeypatch.chdir(tmp_path)
    assert load_target("my_reward_mod:score")(id="x") == 7.0  # cwd is searched like `python -m`
    assert run(LocalReward.from_target("my_reward_mod.py:Scaled", {"k": 3.0}).score(items("a")))[0].reward == 3.0
    assert run(LocalReward.from_target("my_reward_mod:Scaled").score(items("a")))[0].reward == 2.0


@pytest.mark.parametrize("target, message", [
    ("no_colon", "must look like"),
    ("missing_module_xyz:score", "no module named 'missing_module_xyz'"),
    ("relax_agent.reward_services.protocol:nope", "has no attribute 'nope'"),
    ("does/not/exist.py:score", "does not exist"),
    ("relax_agent.reward_services.protocol:API_VERSION", "expected a function"),
])
def test_load_target_errors(target, message):
    with pytest.raises(ConfigError, match=message):
        LocalReward.from_target(target)


def test_aclose_closes_the_callable():
    class Judge:
        closed = False

        async def __call__(self, id):
            return 1.0

        async def aclose(self):
            Judge.closed = True

    reward = LocalReward(Judge())
    run(reward.score(items("a")))
    run(reward.aclose())
    assert Judge.closed


def test_survives_asyncio_run_per_step():
    async def fn(id):
        await asyncio.sleep(0.01)
        return 1.0

    reward = LocalReward(fn, max_concurrency=1)  # the limit is contended in every loop
    for _ in range(3):
        assert [r.reward for r in run(reward.score(items("a", "b", "c")))] == [1.0, 1.0, 1.0]


def test_results_are_always_serialisable():
    class Opaque:
        def __str__(self):
            return "opaque!"

    out = run(LocalReward(lambda id: {"reward": 1.0, "metrics": {"ratio": float("nan"), "n": 2},
                                      "extra": {"obj": Opaque(), "ok": [1, "a"]}}).score(items("a")))
    assert out[0].ok and out[0].metrics == {"n": 2.0}
    assert out[0].extra == {"obj": "opaque!", "ok": [1, "a"], "dropped_metrics": ["ratio"]}
    out[0].model_dump_json()
