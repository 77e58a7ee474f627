"""Bad env code never crashes a rollout or drops a sample; async envs are awaited; sync envs overlap."""

from __future__ import annotations

import asyncio
import threading

import gymnasium
import numpy as np
import pytest
from transformers import AutoTokenizer

from relax_agent.envs import TextEnv, ToolEnv, register
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.env_driver import run_episode
from relax_agent.rollout.parsers import HermesParser
from relax_agent.rollout.runner import RolloutLimits, RolloutRunner

CALL = '<tool_call>{"name": "wait", "arguments": {"key": "%s"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class TextEngine:
    """Replies ``reply(prompt_text)`` (a callable) or the next text of a list, then <|im_end|>."""

    def __init__(self, tokenizer, reply):
        self.tok, self.reply, self.policy_version = tokenizer, reply, 0
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt_ids, params):
        text = self.reply(self.tok.decode(prompt_ids)) if callable(self.reply) else self.reply.pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.end]
        return Generation(tuple(ids), tuple(-0.5 for _ in ids), "stop", 0)


class Answer(TextEnv):
    """Ends at the first step with reward 1."""

    def tasks(self, split="train"):
        return [{"id": "t0"}]

    def _reset_task(self, task):
        return [{"role": "user", "content": "answer"}], {"tools": []}

    def step(self, action):
        return [], 1.0, True, False, {"correct": 1.0}


def play(tokenizer, env, texts=("done",), **spec_kw):
    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0"}, seed=0, **{"max_turns": 4, **spec_kw})
    engine = TextEngine(tokenizer, list(texts))
    return asyncio.run(run_episode(env, spec, engine, ChatRenderer(tokenizer), HermesParser(), SamplingParams(32)))


def _with_step(result):
    class Env(Answer):
        def step(self, action):
            return result() if callable(result) else result
    return Env()


@pytest.mark.parametrize("result, cause", [
    ((([], float("inf"), True, False, {})), "non-finite reward inf"),
    ((([], np.float32("nan"), True, False, {})), "non-finite reward nan"),
    ((([], "1.0", True, False, {})), "reward must be a number, got str"),
    ((([], None, True, False, {})), "reward must be a number, got NoneType"),
    ((([], 1.0, True, False)), "must return (observation, reward, terminated, truncated, info), got tuple of length 4"),
    ([[], 1.0, True, False, {}], "got list of length 5"),
    ((("text", 1.0, True, False, {})), "observation must be a list of chat messages, got str"),
    ((([{"role": "robot", "content": "x"}], 1.0, True, False, {})), "observation[0] is not an OpenAI-format chat message"),
    ((([{"role": "user", "content": [{"type": "text"}]}], 1.0, True, False, {})), "observation[0] is not an OpenAI-format"),
    ((([], 1.0, True, False, ["info"])), "info must be a dict, got list"),
])
def test_bad_step_returns_become_failed_records(tokenizer, result, cause):
    traj = play(tokenizer, _with_step(result))
    assert traj.reward_status == "error" and traj.stop_reason == "env_error" and not traj.trainable
    assert cause in traj.error and "orchestrator.py" not in traj.error
    assert len(traj.turns) == 1  # the sampled turn is kept for inspection


def test_exception_in_step_and_reset_names_the_cause(tokenizer):
    def boom():
        raise ValueError("tool table is empty")

    traj = play(tokenizer, _with_step(boom))
    assert traj.error.startswith("ValueError: tool table is empty at ") and "test_env_orchestrator.py" in traj.error

    class BadReset(Answer):
        def reset(self, *, seed=None, options=None):
            return [{"role": "user", "content": "hi"}]

    traj = play(tokenizer, BadReset())
    assert "env.reset must return (observation, info), got list of length 1" in traj.error and traj.turns == ()


def test_hanging_step_and_close_time_out_without_holding_the_run(tokenizer):
    release, finished = threading.Event(), threading.Event()

    class Hang(Answer):
        def step(self, action):
            release.wait(20)
            finished.set()
            return [], 1.0, True, False, {}

        def close(self):
            release.wait(20)

    traj = play(tokenizer, Hang(), step_timeout_s=0.3)
    assert traj.reward_status == "timeout" and traj.error == "env call exceeded step_timeout_s=0.3"
    assert not finished.is_set()  # asyncio.run returned while step and close still hang
    release.set()


def test_env_constructor_failures_are_failed_records(tokenizer):
    calls = []

    def make_env():
        calls.append(1)
        if len(calls) % 2:
            raise OSError("dataset file missing")
        return Answer()

    runner = RolloutRunner(make_env, TextEngine(tokenizer, lambda _: "ok"), ChatRenderer(tokenizer), HermesParser(),
                           RolloutLimits(max_turns=1))
    trajs = asyncio.run(runner.run(runner.specs([{"id": "a"}, {"id": "b"}], 2, prefix="s", seed=0), SamplingParams(8)))
    assert len(trajs) == 4  # one record per spec, none dropped
    failed = [t for t in trajs if t.error]
    assert len(failed) == 2 and all(t.error.startswith("make_env: OSError: dataset file missing") for t in failed)
    assert sorted(t.reward for t in trajs if not t.error) == [1.0, 1.0]


def wait(key: str) -> str:
    """Block until the other episode's tool has run.

    Args:
        key: "first" waits for "second"; "second" releases "first".
    """
    if key == "second":
        GATE.set()
        return "released"
    return "went through" if GATE.wait(20) else "still blocked"


GATE = threading.Event()


class Waiter(ToolEnv):
    """First turn calls ``wait``; the tool result decides the reward."""

    def __init__(self):
        super().__init__(tools=[wait], tool_timeout_s=30)

    def tasks(self, split="train"):
        return [{"id": "first"}, {"id": "second"}]

    def prompt(self, task):
        return [{"role": "user", "content": f"key={task['id']}"}]

    def score(self, message):
        return 0.0, {}


class SyncWaiter(Waiter):
    """The same env without the async API: the orchestrator runs it in threads."""

    areset = None
    astep = None


@pytest.mark.parametrize("env_cls", [Waiter, SyncWaiter])
def test_a_blocked_tool_does_not_block_other_episodes(tokenizer, env_cls):
    # episode "first" blocks inside its tool until episode "second" has run its own tool:
    # if one blocked tool stalled the event loop, "first" would report "still blocked".
    GATE.clear()

    def reply(prompt):
        if "<tool_response>" in prompt or "tool\n" in prompt.split("key=")[-1]:
            return "done"
        return CALL % ("first" if "key=first" in prompt else "second")

    runner = RolloutRunner(env_cls, TextEngine(tokenizer, reply), ChatRenderer(tokenizer), HermesParser(),
                           RolloutLimits(max_turns=2))
    specs = runner.specs(env_cls().tasks(), 1, prefix="s", seed=0)
    trajs = asyncio.run(runner.run(specs, SamplingParams(64)))
    tool_results = {t.task_id: [m["content"] for m in t.messages if m["role"] == "tool"] for t in trajs}
    assert tool_results == {"first": ["went through"], "second": ["released"]}


def test_async_env_is_awaited_and_time_limit_applies(tokenizer):
    class AsyncOnly(Answer):
        """astep keeps the episode going; only the registered TimeLimit ends it."""

        def step(self, action):
            raise AssertionError("the orchestrator must use astep")

        async def areset(self, *, seed=None, options=None):
            self.task = {"id": "t0"}
            return [{"role": "user", "content": "go"}], {"tools": []}

        async def astep(self, action):
            await asyncio.sleep(0)
            return [{"role": "user", "content": "again"}], 0.25, False, False, {"seen": 1}

    register(id="test/AsyncOnly-v0", entry_point=AsyncOnly, max_episode_steps=3)
    try:
        traj = play(tokenizer, gymnasium.make("test/AsyncOnly-v0"), texts=["a", "b", "c", "d"], max_turns=10)
    finally:
        del gymnasium.registry["test/AsyncOnly-v0"]
    assert traj.error is None and traj.stop_reason == "truncated"
    assert len(traj.turns) == 3 and traj.reward == 0.75


def test_async_path_is_skipped_under_unknown_wrappers(tokenizer):
    class Both(Answer):
        async def areset(self, *, seed=None, options=None):
            raise AssertionError("a custom wrapper is in between: use its sync API")

        async def astep(self, action):
            raise AssertionError("a custom wrapper is in between: use its sync API")

    class Bonus(gymnasium.Wrapper):
        def step(self, action):
            obs, reward, *rest = self.env.step(action)
            return (obs, reward + 1.0, *rest)

    traj = play(tokenizer, Bonus(Both()))
    assert traj.error is None and traj.reward == 2.0


def test_hung_thread_is_abandoned_by_asyncio_run():
    from relax_agent.envs.tool_env import call_in_thread

    release, finished = threading.Event(), threading.Event()

    def hang():
        release.wait(10)
        finished.set()

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call_in_thread(hang), 0.05)

    asyncio.run(main())
    # asyncio.to_thread would have made asyncio.run wait for the call to finish
    assert not finished.is_set()
    release.set()
