"""Wiring of configured rewards into finished trajectories."""

import asyncio

import pytest

from relax_agent.config import load_config
from relax_agent.control.reporting import rollout_metrics
from relax_agent.records import Trajectory, Turn
from relax_agent.reward_services import ENV_REWARD_KEY, FakeReward
from relax_agent.rollout.rewarding import needs_scoring, reward_item, score


def _traj(sample_id="g/0", reward=0.5, error=None):
    msgs = ({"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
             "parse_errors": ["x"]})
    return Trajectory(sample_id, "g", "t", (1, 2, 3), (0, 1, 1), (0.0, -0.1, -0.2), 1,
                      (Turn(1, (2, 3), (-0.1, -0.2), 0, "stop"),), reward, messages=msgs,
                      metrics={"correct": 1.0}, error=error, reward_status="ok" if error is None else "error")


def test_env_only_config_needs_no_scoring():
    assert not needs_scoring(load_config(None).reward)
    assert needs_scoring(load_config(None, ["reward.source=remote", "reward.url=http://127.0.0.1:9"]).reward)


def test_reward_item_carries_answer_task_and_env_return():
    item = reward_item(_traj(), {"id": "t", "word": "apple"}, "relax/X-v0")
    assert item.messages == [{"role": "user", "content": "q"}]
    assert item.response["tool_calls"][0]["function"]["name"] == "f" and "parse_errors" not in item.response
    assert item.ground_truth == {"id": "t", "word": "apple"}
    assert item.metadata[ENV_REWARD_KEY] == 0.5 and item.metadata["env_id"] == "relax/X-v0"


def test_service_reward_replaces_env_reward():
    out = asyncio.run(score(FakeReward(0.75), _traj(), {"id": "t"}, "e"))
    assert out.reward == 0.75 and out.reward_status == "ok" and out.trainable


def test_failed_reward_is_masked_and_counted_not_zero_scored():
    trajs = [_traj("g/0"), _traj("g/1")]
    fake = FakeReward(0.75, fail={"g/1": "timeout"})
    scored = [asyncio.run(score(fake, t, {"id": "t"}, "e")) for t in trajs]
    assert scored[0].trainable and scored[0].reward == 0.75
    assert not scored[1].trainable and scored[1].reward_status == "timeout" and "scripted failure" in scored[1].error
    m = rollout_metrics(scored, 1.0)
    assert m["rollout/failed"] == 1.0 and m["rollout/reward"] == pytest.approx(0.75)


def test_failed_episode_is_not_sent_to_the_reward():
    fake = FakeReward(1.0)
    out = asyncio.run(score(fake, _traj(error="EnvError: boom"), {"id": "t"}, "e"))
    assert fake.calls == [] and out.error == "EnvError: boom"
