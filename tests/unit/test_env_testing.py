"""The env contract suite catches each kind of broken env (and passes a correct one)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from relax_agent.envs import ToolEnv
from relax_agent.envs.testing import EnvContract, run_contract


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text.
    """
    return text.upper()


class Good(ToolEnv):
    def __init__(self):
        super().__init__(tools=[shout])

    def tasks(self, split="train"):
        return [{"id": f"{split}-{i}", "word": f"w{i}"} for i in range(4)]

    def prompt(self, task):
        return [{"role": "user", "content": f"Shout {task['word']}"}]

    def score(self, message):
        return float(message["content"] == self.task["word"].upper()), {}


class Unseeded(Good):
    def reset(self, *, seed=None, options=None):  # ignores the seed: draws from the global RNG
        self.task = random.choice(self.tasks())
        self._done = False
        return self.prompt(self.task), {"tools": list(self.tool_schemas)}


class NoOrderCheck(Good):
    def step(self, action):
        return [], 0.0, True, False, {}


class NoTools(Good):
    def _reset_task(self, task):
        obs, info = super()._reset_task(task)
        return obs, {}


class NanReward(Good):
    def score(self, message):
        return float("nan"), {}


class IntFlags(Good):
    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, int(terminated), truncated, info


class NeverEnds(Good):
    def score(self, message):
        self._done = False
        return 0.0, {}

    def step(self, action):
        obs, reward, _, truncated, info = super().step(action)
        return obs, reward, False, truncated, info


class SharedTasks(Good):
    def tasks(self, split="train"):
        return [{"id": "same"}]

    def prompt(self, task):
        return [{"role": "user", "content": "hi"}]


LEAKED = []


class LeaksFiles(Good):
    def _reset_task(self, task):
        LEAKED.append(open(__file__))  # noqa: SIM115 - the leak under test
        return super()._reset_task(task)


class LeaksThreads(Good):
    def _reset_task(self, task):
        threading.Thread(target=threading.Event().wait, args=(30,), daemon=True).start()
        return super()._reset_task(task)


class CloseTwiceFails(Good):
    closed = False

    def close(self):
        if self.closed:
            raise RuntimeError("already closed")
        self.closed = True


class AsyncDiffers(Good):
    async def astep(self, action):
        obs, reward, terminated, truncated, info = self.step(action)
        return obs, reward + 1.0, terminated, truncated, info


class BadObservation(Good):
    def prompt(self, task):
        return [{"role": "user", "content": [{"type": "text"}]}]


@pytest.mark.parametrize("env_cls, failing", [
    (Unseeded, "determinism"),
    (NoOrderCheck, "step_before_reset"),
    (NoTools, "reset"),
    (NanReward, "step"),
    (IntFlags, "step"),
    (NeverEnds, "episode_ends"),
    (SharedTasks, "tasks"),
    (LeaksFiles, "close"),
    (LeaksThreads, "close"),
    (CloseTwiceFails, "close"),
    (AsyncDiffers, "async_api"),
    (BadObservation, "gymnasium_checker"),
])
def test_contract_catches(env_cls, failing):
    random.seed(0)
    try:
        failures = run_contract(env_cls, [failing])
    finally:
        for f in LEAKED:
            f.close()
        LEAKED.clear()
    assert set(failures) == {failing}, failures


class OpensOneCacheLate(Good):
    """Keeps one file open from its third episode on (a cache filled late): one descriptor, once, not a leak."""
    resets = 0

    def _reset_task(self, task):
        type(self).resets += 1
        if type(self).resets == 3:
            LEAKED.append(open(__file__))  # noqa: SIM115 - held for the rest of the process, like a cache
        return super()._reset_task(task)


def test_close_check_tells_a_late_cache_from_a_leak():
    try:
        assert run_contract(OpensOneCacheLate, ["close"]) == {}
    finally:
        for f in LEAKED:
            f.close()
        LEAKED.clear()


def test_good_env_passes_every_check():
    assert run_contract(Good) == {}
    assert asyncio.run(Good().areset(seed=0))[1]["tools"][0]["function"]["name"] == "shout"


class TestGoodWithTheMixin(EnvContract):
    def make_env(self):
        return Good()

