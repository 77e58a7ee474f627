"""Weighted combination and the env reward passthrough."""

import asyncio

import pytest

from relax_agent.errors import ConfigError
from relax_agent.reward_services import CombinedReward, Component, EnvReward, FakeReward, RewardItem, RewardStatus


def run(coro):
    return asyncio.run(coro)


def test_weighted_sum_and_namespaced_metrics():
    a = FakeReward({"x": 1.0, "y": 0.0})
    b = FakeReward(0.5)
    combo = CombinedReward([Component("acc", 0.8, a), Component("style", 0.2, b)])
    out = run(combo.score([RewardItem(id="x"), RewardItem(id="y")]))
    assert [r.reward for r in out] == pytest.approx([0.9, 0.1])
    assert out[0].metrics == {"acc/reward": 1.0, "style/reward": 0.5}
    assert out[0].extra["components"]["acc"] == {"status": "ok", "reward": 1.0, "weight": 0.8}
    assert a.calls == [["x", "y"]] and b.calls == [["x", "y"]]


def test_ok_only_if_every_component_is_ok():
    a = FakeReward(1.0, fail={"x": "timeout", "z": "timeout"})
    b = FakeReward(1.0, fail={"x": "error"})
    combo = CombinedReward([Component("a", 1.0, a), Component("b", 1.0, b)])
    out = run(combo.score([RewardItem(id="x"), RewardItem(id="y"), RewardItem(id="z")]))
    assert [(r.status, r.reward) for r in out] == [(RewardStatus.ERROR, None), (RewardStatus.OK, 2.0), (RewardStatus.TIMEOUT, None)]
    assert out[0].extra["error"] == "a: scripted failure; b: scripted failure"
    run(combo.aclose())
    assert a.closed and b.closed


def test_bad_combinations():
    with pytest.raises(ConfigError, match="at least one"):
        CombinedReward([])
    with pytest.raises(ConfigError, match=r"repeated: \['a'\]"):
        CombinedReward([Component("a", 1.0, FakeReward()), Component("a", 1.0, FakeReward())])
    with pytest.raises(ConfigError, match="non-finite weight"):
        CombinedReward([Component("a", float("nan"), FakeReward())])


def test_env_reward_reads_the_episode_return():
    out = run(EnvReward().score([RewardItem(id="a", metadata={"env_reward": 0.75}), RewardItem(id="b"),
                                 RewardItem(id="c", metadata={"env_reward": float("nan")})]))
    assert out[0].reward == 0.75
    assert out[1].status is RewardStatus.ERROR and "metadata['env_reward']" in out[1].extra["error"]
    assert out[2].status is RewardStatus.ERROR
