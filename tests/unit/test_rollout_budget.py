"""rollout.max_total_tokens holds before every engine call and every env step: no trajectory
outgrows it, and a reply the budget cut short is never sent to the env."""

from __future__ import annotations

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


class WordsEngine:
    """Samples ``max_new_tokens`` "a" tokens ("length"), or ``words`` of them and <|im_end|> ("stop")."""

    def __init__(self, tokenizer, words=None):
        self.a = tokenizer.convert_tokens_to_ids("a")
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.words, self.policy_version, self.requests = words, 0, []

    async def generate(self, prompt_ids, params):
        self.requests.append((len(prompt_ids), params.max_new_tokens))
        if self.words is not None and self.words + 1 <= params.max_new_tokens:
            ids = (self.a,) * self.words + (self.end,)
            return Generation(ids, (-0.1,) * len(ids), "stop", 0)
        ids = (self.a,) * params.max_new_tokens
        return Generation(ids, (-0.1,) * len(ids), "length", 0)


class Chatty(TextEnv):
    """Never ends by itself; each step returns a tool result of ``tool_words`` words."""

    def __init__(self, tool_words):
        self.tool_words, self.steps = tool_words, 0

    def tasks(self, split="train"):
        return [{"id": "t0"}]

    def _reset_task(self, task):
        return [{"role": "user", "content": "go"}], {"tools": []}

    def step(self, action):
        self.steps += 1
        return [{"role": "tool", "content": " word" * self.tool_words}], 1.0, False, False, {}


def play(tokenizer, env, engine, max_total_tokens, max_turns=5, max_new_tokens=32):
    spec = EpisodeSpec("g/0", "g", "t0", {"id": "t0"}, seed=0, max_turns=max_turns, max_total_tokens=max_total_tokens)
    return asyncio.run(run_episode(env, spec, engine, ChatRenderer(tokenizer), HermesParser(),
                                   SamplingParams(max_new_tokens)))


def test_a_large_observation_never_pushes_the_trajectory_past_the_budget(tokenizer):
    env = Chatty(tool_words=2000)
    traj = play(tokenizer, env, WordsEngine(tokenizer, words=3), max_total_tokens=300)
    assert traj.error is None and traj.stop_reason == "max_total_tokens"
    assert len(traj.token_ids) <= 300, f"{len(traj.token_ids)} tokens for a budget of 300"
    assert env.steps == 1 and len(traj.turns) == 1  # the reply was complete, so the env saw it


@pytest.mark.parametrize("tool_words", [0, 5, 60])
def test_every_engine_call_gets_only_what_is_left_and_the_total_holds(tokenizer, tool_words):
    engine = WordsEngine(tokenizer, words=20)
    traj = play(tokenizer, Chatty(tool_words), engine, max_total_tokens=200, max_turns=20)
    assert len(traj.token_ids) <= 200 and traj.stop_reason == "max_total_tokens"
    assert all(prompt_len + budget <= 200 for prompt_len, budget in engine.requests)


def test_a_reply_cut_by_the_budget_is_not_sent_to_the_env(tokenizer):
    env = Chatty(tool_words=1)
    engine = WordsEngine(tokenizer)  # always runs to its token limit
    prompt_len = len(ChatRenderer(tokenizer).render_prompt([{"role": "user", "content": "go"}]).token_ids)
    traj = play(tokenizer, env, engine, max_total_tokens=prompt_len + 10, max_new_tokens=64)
    assert env.steps == 0, "the env was stepped with a reply the budget had cut"
    assert traj.stop_reason == "max_total_tokens" and len(traj.token_ids) == prompt_len + 10
    assert len(traj.turns) == 1 and sum(traj.loss_mask) == 10  # the cut turn is kept for training


def test_a_reply_cut_by_max_new_tokens_still_reaches_the_env(tokenizer):
    env = Chatty(tool_words=1)
    traj = play(tokenizer, env, WordsEngine(tokenizer), max_total_tokens=4096, max_turns=1, max_new_tokens=8)
    assert env.steps == 1 and traj.stop_reason == "length"
