"""The rollout driver seam: a driver of its own plugs into RolloutRunner without an env, and
TrajectoryRecorder is the one builder of records, finished or failed."""

from __future__ import annotations

import asyncio

from transformers import AutoTokenizer

from relax_agent import metrics as M
from relax_agent.control.reporting import rollout_metrics
from relax_agent.records import StopReason
from relax_agent.reward_services import FakeReward
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec, EpisodeTimeout, RolloutDriver
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.env_driver import EnvDriver
from relax_agent.rollout.parsers import HermesParser
from relax_agent.rollout.recorder import TrajectoryRecorder, failed_episode
from relax_agent.rollout.runner import RolloutLimits, RolloutRunner

SPEC = EpisodeSpec("g/0", "g", "t0", {"id": "t0"}, seed=0)


class Engine:
    policy_version = 4

    async def generate(self, prompt_ids, params):
        return Generation((7, 8), (-0.5, -0.25), "stop", self.policy_version)


class AgentDriver:
    """What an agent-driven driver does: the agent's requests go to the engine, the recorder keeps them."""

    def __init__(self, engine):
        self.engine, self.played = engine, []

    async def play(self, spec, params):
        self.played.append(spec.sample_id)
        rec = TrajectoryRecorder(spec)
        rec.add_prompt([1, 2, 3], [{"role": "user", "content": "hi"}])
        rec.add_turn(await self.engine.generate([1, 2, 3], params))
        rec.add_messages([{"role": "assistant", "content": "answer"}])
        if spec.task["id"] == "broken":
            return rec.fail("agent: connection reset")
        return rec.finish(0.5, {"turns": 1.0}, StopReason.TERMINATED)


def test_a_driver_of_its_own_plugs_into_the_runner_without_an_env():
    driver = AgentDriver(Engine())
    assert isinstance(driver, RolloutDriver)
    runner = RolloutRunner(None, None, None, None, RolloutLimits(), reward=FakeReward(lambda item: 1.0), driver=driver)
    assert runner.engine is driver.engine
    specs = runner.specs([{"id": "ok"}, {"id": "broken"}], 2, prefix="s", seed=0)
    seen = []
    trajs = asyncio.run(runner.run(specs, SamplingParams(8), on_done=seen.append))
    assert sorted(driver.played) == [s.sample_id for s in specs] and len(seen) == 4
    assert [t.sample_id for t in trajs] == [s.sample_id for s in specs]
    ok, broken = trajs[0], trajs[2]
    assert ok.reward == 1.0 and ok.trainable and ok.token_ids == (1, 2, 3, 7, 8) and ok.loss_mask == (0, 0, 0, 1, 1)
    assert ok.policy_versions == (4,) and ok.prompt_len == 3
    assert broken.error == "agent: connection reset" and not broken.trainable  # failed records skip the reward


def test_the_env_driver_is_the_default_driver(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    runner = RolloutRunner(dict, Engine(), ChatRenderer(tok), HermesParser(), RolloutLimits())
    assert isinstance(runner.driver, EnvDriver) and isinstance(runner.driver, RolloutDriver)
    (traj,) = asyncio.run(runner.run(runner.specs([{"id": "t"}], 1, prefix="s", seed=0), SamplingParams(8)))
    assert traj.error.startswith("AttributeError: 'dict' object has no attribute 'reset'")


def test_the_recorder_builds_finished_and_failed_records():
    rec = TrajectoryRecorder(SPEC)
    rec.add_prompt([1, 2], [{"role": "user", "content": "q"}])
    rec.add_turn(Generation((5,), (-1.0,), "length", 2))
    rec.add_context([9, 9])
    done = rec.finish(1.0, {"correct": 1.0}, StopReason.MAX_TURNS)
    assert done.token_ids == (1, 2, 5, 9, 9) and done.loss_mask == (0, 0, 1, 0, 0)
    assert done.rollout_logprobs == (0.0, 0.0, -1.0, 0.0, 0.0) and done.turns[0].start == 2
    assert done.stop_reason == "max_turns" and done.trainable and done.metrics == {"correct": 1.0}
    timed_out = rec.fail_with(EpisodeTimeout("episode exceeded episode_timeout_s=1.0 during env.step 1"))
    assert timed_out.reward_status == "timeout" and timed_out.stop_reason == "env_error" and timed_out.reward == 0.0
    assert timed_out.error == "episode exceeded episode_timeout_s=1.0 during env.step 1"
    assert timed_out.token_ids == done.token_ids and timed_out.messages == done.messages


def test_a_turn_keeps_per_token_versions_only_when_a_weight_update_landed_inside_it():
    rec = TrajectoryRecorder(SPEC)
    rec.add_prompt([1, 2], [{"role": "user", "content": "q"}])
    rec.add_turn(Generation((5, 6), (-1.0, -2.0), "stop", 3, token_versions=(3, 3)))  # one version: dropped
    rec.add_turn(Generation((7, 8, 9), (-1.0, -1.0, -1.0), "stop", 3, token_versions=(3, 4, 4)))
    done = rec.finish(1.0, {}, StopReason.TERMINATED)
    assert [t.token_versions for t in done.turns] == [(), (3, 4, 4)]
    assert [t.crossed_update for t in done.turns] == [False, True] and done.policy_versions == (3, 3)
    assert rollout_metrics([done], 1.0)[M.CROSSED_UPDATE_TURNS] == 0.5


def test_a_failed_start_names_the_call():
    traj = failed_episode(SPEC, OSError("dataset file missing"), during="make_env")
    assert traj.error == "make_env: OSError: dataset file missing" and traj.reward_status == "error"
    assert traj.token_ids == () and traj.turns == ()
