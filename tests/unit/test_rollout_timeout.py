"""rollout.episode_timeout_s bounds a whole episode (slow engine calls included), and a call past
its time is abandoned: an async env that ignores its cancellation is recorded as timed out,
never as a normal rewarded episode."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from relax_agent.config import load_config
from relax_agent.envs import TextEnv
from relax_agent.errors import ConfigError
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec, EpisodeTimeout, call_within
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.env_driver import run_episode
from relax_agent.rollout.parsers import HermesParser
from relax_agent.rollout.runner import RolloutLimits, RolloutRunner


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Engine:
    """Replies "ok<|im_end|>" after ``delay_s`` seconds."""

    def __init__(self, tokenizer, delay_s=0.0):
        self.ids = tuple(tokenizer("ok", add_special_tokens=False)["input_ids"]) + (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
        self.delay_s, self.policy_version = delay_s, 0

    async def generate(self, prompt_ids, params):
        await asyncio.sleep(self.delay_s)
        return Generation(self.ids, (-0.1,) * len(self.ids), "stop", 0)


class AsyncEnv(TextEnv):
    """Async steps that take ``step_s`` each and go on for ever (reward 1 per step)."""

    def __init__(self, step_s=0.0, ignore_cancel=False):
        self.step_s, self.ignore_cancel, self.finished_steps = step_s, ignore_cancel, 0

    def tasks(self, split="train"):
        return [{"id": "t0"}]

    def _reset_task(self, task):
        return [{"role": "user", "content": "go"}], {"tools": []}

    async def areset(self, *, seed=None, options=None):
        return self.reset(seed=seed, options=options)

    async def astep(self, action):
        try:
            await asyncio.sleep(self.step_s)
        except asyncio.CancelledError:
            if not self.ignore_cancel:
                raise
            await asyncio.sleep(self.step_s)  # swallows the cancellation and finishes its work
        self.finished_steps += 1
        return [{"role": "user", "content": "more"}], 1.0, self.ignore_cancel, False, {}


def play(tokenizer, env, engine, **spec_kw):
    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0"}, seed=0, **{"max_turns": 50, **spec_kw})

    async def main():
        t0 = time.monotonic()
        traj = await run_episode(env, spec, engine, ChatRenderer(tokenizer), HermesParser(), SamplingParams(8))
        return traj, time.monotonic() - t0

    return asyncio.run(main())


def test_a_slow_engine_call_ends_at_the_episode_timeout(tokenizer):
    traj, took_s = play(tokenizer, AsyncEnv(), Engine(tokenizer, delay_s=30.0), episode_timeout_s=0.3)
    assert took_s < 5.0
    assert traj.reward_status == "timeout" and not traj.trainable and traj.stop_reason == "env_error"
    assert traj.error == "episode exceeded episode_timeout_s=0.3 during engine.generate (turn 1)"
    assert traj.prompt_len == len(traj.token_ids) > 0  # the prompt is kept for inspection


def test_many_quick_steps_end_at_the_episode_timeout(tokenizer):
    env = AsyncEnv(step_s=0.05)
    traj, took_s = play(tokenizer, env, Engine(tokenizer), episode_timeout_s=0.5, step_timeout_s=10.0)
    assert traj.reward_status == "timeout" and traj.reward == 0.0
    assert traj.error.startswith("episode exceeded episode_timeout_s=0.5 during ")
    assert 1 <= env.finished_steps < 50 and took_s < 5.0


def test_an_async_env_that_ignores_cancellation_is_a_timeout_not_a_reward(tokenizer):
    env = AsyncEnv(step_s=1.5, ignore_cancel=True)
    traj, took_s = play(tokenizer, env, Engine(tokenizer), step_timeout_s=0.2)
    assert traj.reward_status == "timeout" and traj.reward == 0.0 and not traj.trainable
    assert traj.error == "env call exceeded step_timeout_s=0.2"
    assert took_s < 1.4  # the episode did not wait for the env to finish its swallowed step


def test_the_episode_timeout_also_abandons_an_env_that_ignores_cancellation(tokenizer):
    env = AsyncEnv(step_s=1.5, ignore_cancel=True)
    traj, took_s = play(tokenizer, env, Engine(tokenizer), step_timeout_s=10.0, episode_timeout_s=0.3)
    assert traj.reward_status == "timeout" and traj.error == "episode exceeded episode_timeout_s=0.3 during env.step 1"
    assert took_s < 1.4


def test_the_runner_gives_every_episode_the_limit(tokenizer):
    runner = RolloutRunner(AsyncEnv, Engine(tokenizer, delay_s=30.0), ChatRenderer(tokenizer), HermesParser(),
                           RolloutLimits(max_turns=2, episode_timeout_s=0.2))
    specs = runner.specs([{"id": "a"}, {"id": "b"}], 2, prefix="s", seed=0)
    assert {s.episode_timeout_s for s in specs} == {0.2}
    trajs = asyncio.run(runner.run(specs, SamplingParams(8)))
    assert [t.reward_status for t in trajs] == ["timeout"] * 4


def test_call_within_cancels_and_does_not_wait():
    cancelled = []

    async def stubborn():
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.append(True)
            await asyncio.sleep(0.5)
        return "late"

    async def main():
        t0 = time.monotonic()
        with pytest.raises(EpisodeTimeout, match="too slow"):
            await call_within(stubborn(), 0.05, "too slow")
        took_s = time.monotonic() - t0
        await asyncio.sleep(0)
        return took_s

    assert asyncio.run(main()) < 0.4 and cancelled == [True]


def test_episode_timeout_s_is_a_config_key():
    assert load_config(None, ["rollout.episode_timeout_s=5"]).rollout.episode_timeout_s == 5.0
    assert load_config(None).rollout.episode_timeout_s == 1800.0
    with pytest.raises(ConfigError, match="episode_timeout_s"):
        load_config(None, ["rollout.episode_timeout_s=0"])
