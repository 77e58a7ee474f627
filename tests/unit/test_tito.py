"""Token-in/token-out: the trajectory is the conversation, and sampled tokens are never re-rendered."""

import asyncio

import pytest
from transformers import AutoTokenizer

from relax_agent.envs import TextEnv
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.env_driver import run_episode
from relax_agent.rollout.parsers import HermesParser


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class ScriptedEngine:
    """Returns the given texts' token ids in order, with log-probs -0.5 each."""

    def __init__(self, tokenizer, texts, stop=True):
        self.tok, self.texts, self.stop, self.calls = tokenizer, list(texts), stop, []
        self.policy_version = 3

    async def generate(self, prompt_ids, params):
        self.calls.append(list(prompt_ids))
        ids = self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"]
        if self.stop:
            ids = ids + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        ids = ids[: params.max_new_tokens]
        return Generation(tuple(ids), tuple(-0.5 for _ in ids), "stop" if self.stop else "length", self.policy_version)


class EchoToolEnv(TextEnv):
    """Two-turn env: the tool result echoes the call's argument; the second turn ends it."""

    def tasks(self, split="train"):
        return [{"id": "t0", "question": "Call echo with x=7, then say done."}]

    def _reset_task(self, task):
        tools = [{"type": "function", "function": {"name": "echo", "description": "Echo x.",
                  "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
        return [{"role": "user", "content": task["question"]}], {"tools": tools}

    def step(self, action):
        if action["tool_calls"]:
            x = action["tool_calls"][0]["function"]["arguments"]["x"]
            return [{"role": "tool", "content": f"echo: {x}"}], 0.0, False, False, {}
        return [], 1.0, True, False, {"correct": 1.0}


def _play(tokenizer, texts, stop=True, max_turns=3):
    renderer = ChatRenderer(tokenizer)
    engine = ScriptedEngine(tokenizer, texts, stop)
    spec = EpisodeSpec("g/0", "g", "t0", EchoToolEnv().tasks()[0], seed=0, max_turns=max_turns, max_total_tokens=4096)
    traj = asyncio.run(run_episode(EchoToolEnv(), spec, engine, renderer, HermesParser(), SamplingParams(64)))
    return traj, engine, renderer


def test_trajectory_decodes_to_the_conversation(tokenizer):
    call = '<tool_call>\n{"name": "echo", "arguments": {"x": 7}}\n</tool_call>'
    traj, engine, renderer = _play(tokenizer, [call, "done"])
    assert traj.error is None and traj.reward == 1.0 and traj.stop_reason == "terminated"
    convo = [dict(m) for m in renderer.render_prompt(
        [{"role": "user", "content": "Call echo with x=7, then say done."}], EchoToolEnv()._reset_task({"question": "Call echo with x=7, then say done."})[1]["tools"]).messages]
    convo += [{"role": "assistant", "content": call}, {"role": "tool", "content": "echo: 7"}, {"role": "assistant", "content": "done"}]
    expected = tokenizer.apply_chat_template(convo, tokenize=False)
    assert tokenizer.decode(traj.token_ids) == expected.rstrip("\n")


def test_sampled_tokens_are_kept_exactly_and_masked(tokenizer):
    call = '<tool_call>{"name": "echo", "arguments": {"x": 7}}</tool_call>'
    traj, engine, _ = _play(tokenizer, [call, "done"])
    assert len(traj.turns) == 2
    for turn in traj.turns:
        n = len(turn.token_ids)
        assert traj.token_ids[turn.start : turn.start + n] == turn.token_ids
        assert traj.loss_mask[turn.start : turn.start + n] == (1,) * n
        assert traj.rollout_logprobs[turn.start : turn.start + n] == turn.logprobs
        assert turn.policy_version == 3
    assert sum(traj.loss_mask) == sum(len(t.token_ids) for t in traj.turns)
    assert all(lp == 0.0 for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m == 0)
    # the second request's prompt is the first request's prompt plus the sampled turn, unchanged
    first, second = engine.calls
    assert second[: len(first)] == first
    assert tuple(second[len(first) : len(first) + len(traj.turns[0].token_ids)]) == traj.turns[0].token_ids


def test_rerendering_never_changes_a_sampled_token(tokenizer):
    # text whose re-tokenization differs from the sampled ids: sample "hel" + "lo" as two tokens
    odd = tokenizer.convert_tokens_to_ids(["hel", "lo"])
    assert all(i is not None for i in odd)

    class OddEngine(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            self.calls.append(list(prompt_ids))
            ids = tuple(odd) + (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
            return Generation(ids, (-1.0,) * len(ids), "stop", 0)

    class TwoTurnEnv(EchoToolEnv):
        def step(self, action):
            self.n = getattr(self, "n", 0) + 1
            return [{"role": "user", "content": "again"}], 0.0, self.n >= 2, False, {}

    renderer = ChatRenderer(tokenizer)
    engine = OddEngine(tokenizer, [])
    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0", "question": "q"}, seed=0, max_turns=2)
    traj = asyncio.run(run_episode(TwoTurnEnv(), spec, engine, renderer, HermesParser(), SamplingParams(8)))
    assert traj.turns[0].token_ids[:2] == tuple(odd)
    assert traj.token_ids[traj.turns[0].start : traj.turns[0].start + 2] == tuple(odd)
    assert tuple(engine.calls[1][traj.turns[0].start : traj.turns[0].start + 2]) == tuple(odd)


def test_length_cut_turn_is_closed_with_unmasked_end_of_turn(tokenizer):
    traj, _, renderer = _play(tokenizer, ['<tool_call>{"name": "echo", "arguments": {"x": 7}}</tool_call>', "done"], stop=False)
    end = renderer.end_of_turn_ids
    t0 = traj.turns[0]
    after = t0.start + len(t0.token_ids)
    assert traj.token_ids[after : after + len(end)] == end
    assert traj.loss_mask[after : after + len(end)] == (0,) * len(end)


def test_env_errors_become_failed_records(tokenizer):
    class Broken(EchoToolEnv):
        def step(self, action):
            raise KeyError("boom")

    class BadReward(EchoToolEnv):
        def step(self, action):
            return [], float("nan"), True, False, {}

    class BadShape(EchoToolEnv):
        def step(self, action):
            return [], 1.0

    for env_cls, cause in ((Broken, "KeyError: 'boom'"), (BadReward, "non-finite reward"), (BadShape, "must return (observation")):
        spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0", "question": "q"}, seed=0)
        traj = asyncio.run(run_episode(env_cls(), spec, ScriptedEngine(tokenizer, ["x"]), ChatRenderer(tokenizer),
                                       HermesParser(), SamplingParams(8)))
        assert not traj.trainable and traj.reward_status == "error" and cause in traj.error
        assert len(traj.turns) == 1  # the sampled tokens are kept for inspection


def test_hanging_env_times_out_without_blocking(tokenizer):
    import time

    class Slow(EchoToolEnv):
        def step(self, action):
            time.sleep(2.0)
            return [], 1.0, True, False, {}

    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0", "question": "q"}, seed=0, step_timeout_s=0.2)
    traj = asyncio.run(run_episode(Slow(), spec, ScriptedEngine(tokenizer, ["x"]), ChatRenderer(tokenizer),
                                   HermesParser(), SamplingParams(8)))
    assert traj.reward_status == "timeout" and "step_timeout_s=0.2" in traj.error


def test_slow_sync_envs_do_not_serialize(tokenizer):
    import threading

    from relax_agent.rollout.runner import RolloutLimits, RolloutRunner

    # Every episode's step waits until all 32 are inside step() at once: if sync envs ran one
    # after another (or through a small pool) the barrier would break and every episode fail.
    barrier = threading.Barrier(32, timeout=20)

    class SlowStep(EchoToolEnv):
        def step(self, action):
            barrier.wait()
            return [], 1.0, True, False, {}

    texts = ["x"] * 32
    runner = RolloutRunner(SlowStep, ScriptedEngine(tokenizer, texts), ChatRenderer(tokenizer), HermesParser(),
                           RolloutLimits(max_turns=1))
    specs = runner.specs([{"id": f"t{i}", "question": "q"} for i in range(4)], 8, prefix="s", seed=0)
    trajs = asyncio.run(runner.run(specs, SamplingParams(8)))
    assert len(trajs) == 32 and all(t.reward == 1.0 for t in trajs), [t.error for t in trajs if t.error][:1]
