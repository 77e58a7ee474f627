"""Reward faults that used to crash, hang or corrupt a run: each becomes an error result or a clear answer."""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import httpx
import numpy as np
import pytest

from relax_agent.errors import ConfigError
from relax_agent.reward_services import (
    CombinedReward,
    Component,
    EnvReward,
    FakeReward,
    LocalReward,
    RetryPolicy,
    RewardClient,
    RewardConfig,
    RewardItem,
    RewardResult,
    RewardStatus,
    build_reward,
    create_app,
)

ONCE = RetryPolicy(max_attempts=1, backoff_initial_s=0.01, backoff_max_s=0.01, max_elapsed_s=0.0)


def run(coro):
    return asyncio.run(coro)


def guarded(coro):
    """``asyncio.run(coro)``, turning a SystemExit or KeyboardInterrupt that escapes into a test failure
    (so that the code before the fix fails this test instead of ending pytest)."""
    try:
        return asyncio.run(coro)
    except (SystemExit, KeyboardInterrupt) as exc:
        pytest.fail(f"{type(exc).__name__} escaped the reward: {exc!r}")


def answering(value):
    """A RewardClient whose service answers every item with ``reward = value`` (and status ok)."""
    async def handler(request):
        ids = [i["id"] for i in json.loads(request.content)["items"]]
        return httpx.Response(200, content=json.dumps({"results": [{"id": i, "reward": value, "status": "ok"}
                                                                    for i in ids]}).encode())
    return RewardClient("http://127.0.0.1:9", transport=httpx.MockTransport(handler), retry=ONCE)


async def score_one(reward, item=None):
    try:
        (result,) = await reward.score([item or RewardItem(id="a")])
        return result
    finally:
        await reward.aclose()


def via_local(value):
    return run(score_one(LocalReward(lambda id: value)))


def via_local_dict(value):
    return run(score_one(LocalReward(lambda id: {"reward": value})))


def via_http(value):
    return run(score_one(answering(value)))


def via_env(value):
    return run(score_one(EnvReward(), RewardItem(id="a", metadata={"env_reward": value})))


PATHS = [via_local, via_local_dict, via_http, via_env]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("value, why", [
    (1e39, "must be finite in float32"),
    (-3.5e38, "must be finite in float32"),
    ("0.7", "str '0.7'"),
    (True, "must be a number, got bool True"),
    ([0.5], "list [0.5]"),
])
def test_a_reward_that_is_not_a_float32_finite_number_fails_its_item_on_every_path(path, value, why):
    result = path(value)
    assert result.status is RewardStatus.ERROR and result.reward is None
    assert why in result.extra["error"]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("value", [1, 0.25, -2, 3.4e38])
def test_numbers_finite_in_float32_are_rewards_on_every_path(path, value):
    result = path(value)
    assert result.ok and result.reward == float(value) and isinstance(result.reward, float)


def test_numpy_scalars_are_numbers_and_numpy_bools_are_not():
    assert via_local(np.float32(0.5)).reward == 0.5 and via_local(np.int64(2)).reward == 2.0
    assert not via_local(np.bool_(True)).ok


def test_the_http_error_names_the_service_and_the_value():
    result = via_http(1e39)
    assert "reward service at http://127.0.0.1:9" in result.extra["error"] and "1e+39" in result.extra["error"]


def test_a_combined_reward_whose_weighted_sum_overflows_float32_is_an_error_not_inf():
    big = CombinedReward([Component("a", 1.0, FakeReward(3e38)), Component("b", 1.0, FakeReward(3e38))])
    (result,) = run(big.score([RewardItem(id="x")]))
    assert result.status is RewardStatus.ERROR and "weighted sum" in result.extra["error"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e39, "high", True, None, [1]])
def test_a_bad_metric_is_dropped_and_named_and_the_reward_kept(bad):
    answer = {"reward": 0.5, "metrics": {"m": bad, "ok": 1}}
    for result in (RewardResult.model_validate({"id": "a", **answer}), run(score_one(LocalReward(lambda id: answer)))):
        assert result.ok and result.reward == 0.5
        assert result.metrics == {"ok": 1.0} and result.extra["dropped_metrics"] == ["m"]


def test_a_non_numeric_metric_over_http_keeps_the_real_reward():
    async def handler(request):
        return httpx.Response(200, json={"results": [{"id": "a", "reward": 0.75, "metrics": {"judge": "good", "n": 3}}]})

    client = RewardClient("http://127.0.0.1:9", transport=httpx.MockTransport(handler), retry=ONCE)
    result = run(score_one(client))
    assert result.ok and result.reward == 0.75
    assert result.metrics == {"n": 3.0} and result.extra["dropped_metrics"] == ["judge"]


# --- reward functions that exit ------------------------------------------------------------------

def sync_exit(id):
    if id == "bad":
        sys.exit(3)
    return 1.0


async def async_exit(id):
    if id == "bad":
        sys.exit("bye")
    return 1.0


def sync_interrupt(id):
    if id == "bad":
        raise KeyboardInterrupt
    return 1.0


async def async_interrupt(id):
    if id == "bad":
        raise KeyboardInterrupt
    return 1.0


def batched_exit(items):
    sys.exit(1)


@pytest.mark.parametrize("fn, kind", [(sync_exit, "SystemExit(3)"), (async_exit, "SystemExit(bye)"),
                                      (sync_interrupt, "KeyboardInterrupt()"), (async_interrupt, "KeyboardInterrupt()")])
def test_a_reward_function_that_exits_fails_only_its_item(fn, kind):
    reward = LocalReward(fn, name="exiting")

    async def twice():
        first = await reward.score([RewardItem(id="ok1"), RewardItem(id="bad"), RewardItem(id="ok2")])
        return first, await reward.score([RewardItem(id="ok3")])

    first, second = guarded(twice())
    assert [r.status for r in first] == [RewardStatus.OK, RewardStatus.ERROR, RewardStatus.OK]
    cause = first[1].extra["error"]
    assert f"reward function exiting raised {kind}" in cause and "test_reward_hardening.py" in cause
    assert second[0].ok  # the reward still works afterwards


def test_a_batched_reward_function_that_exits_fails_its_batch_only():
    reward = LocalReward(batched_exit, name="batched")
    out = guarded(reward.score([RewardItem(id="a"), RewardItem(id="b")]))
    assert all(r.status is RewardStatus.ERROR and "raised SystemExit(1)" in r.extra["error"] for r in out)


# --- the HTTP service: duplicate results, body size, health -----------------------------------------

async def call(app, method, path, **kw):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return await c.request(method, path, **kw)


class Duplicating:
    """A RewardFunction that answers id 'a' twice with different rewards."""

    async def score(self, items):
        return [RewardResult(id="a", reward=0.0), RewardResult(id="a", reward=1.0)] + [
            RewardResult(id=i.id, reward=0.5) for i in items if i.id != "a"]

    async def aclose(self):
        return None


def test_the_service_fails_an_id_its_reward_answered_twice():
    app = create_app(Duplicating())
    resp = run(call(app, "POST", "/v1/reward", json={"items": [{"id": "a"}, {"id": "b"}]}))
    results = resp.json()["results"]
    assert [(r["id"], r["status"], r["reward"]) for r in results] == [("a", "error", None), ("b", "ok", 0.5)]
    assert "more than one result" in results[0]["extra"]["error"]


def test_a_body_over_max_body_bytes_is_refused_with_413():
    app = create_app(LocalReward(lambda id: 1.0), max_body_bytes=2000)
    small = {"items": [{"id": "a"}]}
    big = {"items": [{"id": "a", "metadata": {"blob": "x" * 5000}}]}
    assert run(call(app, "POST", "/v1/reward", json=small)).status_code == 200
    resp = run(call(app, "POST", "/v1/reward", json=big))
    assert resp.status_code == 413 and "over the limit of 2000 bytes" in resp.json()["message"]

    async def chunks():  # no Content-Length: counted as it arrives
        body = json.dumps(big).encode()
        for k in range(0, len(body), 500):
            yield body[k:k + 500]

    resp = run(call(app, "POST", "/v1/reward", content=chunks(), headers={"content-type": "application/json"}))
    assert resp.status_code == 413
    with pytest.raises(ConfigError, match="max_body_bytes"):
        create_app(LocalReward(lambda id: 1.0), max_body_bytes=0)


def test_healthz_says_503_while_every_slot_is_held_by_a_hung_call():
    release = threading.Event()

    def hangs(id):
        release.wait(60)
        return 1.0

    reward = LocalReward(hangs, timeout_s=0.2, max_concurrency=2, name="hangs")
    app = create_app(reward)

    async def scenario():
        out = await reward.score([RewardItem(id="a"), RewardItem(id="b")])
        assert all(r.status is RewardStatus.TIMEOUT for r in out)
        stuck = await call(app, "GET", "/healthz")
        release.set()
        for _ in range(600):  # the hung threads finish once released
            healthy = await call(app, "GET", "/healthz")
            if healthy.status_code == 200:
                return stuck, healthy
            await asyncio.sleep(0.05)
        return stuck, healthy

    try:
        stuck, healthy = run(scenario())
    finally:
        release.set()
    assert stuck.status_code == 503
    assert "all 2 slots of hangs (max_concurrency) are held by calls running past timeout_s=0.2" in stuck.json()["message"]
    assert healthy.status_code == 200 and healthy.json() == {"status": "ok", "api_version": "v1"}


def test_one_slow_call_does_not_make_the_service_unhealthy():
    release = threading.Event()
    reward = LocalReward(lambda id: release.wait(60), timeout_s=0.1, max_concurrency=2)
    try:
        assert run(reward.score([RewardItem(id="a")]))[0].status is RewardStatus.TIMEOUT
        assert reward.health() is None
    finally:
        release.set()


# --- total deadline per request -------------------------------------------------------------------

def test_a_trickling_answer_is_cut_at_request_deadline_s():
    async def trickle():
        yield b'{"results": ['
        while True:
            await asyncio.sleep(0.05)
            yield b" "

    async def handler(request):
        return httpx.Response(200, content=trickle())

    client = RewardClient("http://127.0.0.1:9", transport=httpx.MockTransport(handler), retry=ONCE,
                          request_timeout_s=5.0, request_deadline_s=0.5)
    result = run(asyncio.wait_for(score_one(client), 60))
    assert result.status is RewardStatus.TIMEOUT and "request_deadline_s=0.5" in result.extra["error"]


def test_request_deadline_s_comes_from_the_config_and_defaults_from_the_timeouts():
    cfg = RewardConfig.model_validate({"source": "remote", "url": "http://127.0.0.1:9", "request_deadline_s": 7})
    assert build_reward(cfg).request_deadline_s == 7.0
    default = build_reward(RewardConfig.model_validate({"source": "remote", "url": "http://127.0.0.1:9",
                                                         "request_timeout_s": 10}))
    assert default.request_deadline_s == 2 * 10 + 5
    with pytest.raises(ConfigError, match="request_deadline_s"):
        RewardClient("http://127.0.0.1:9", request_deadline_s=float("inf"))
