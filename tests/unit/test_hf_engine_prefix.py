"""HFEngine prefix reuse across turns and continuous batching, with the tiny random llama.

Counted through ``EngineStats``: prefilled vs reused prompt tokens, decode steps, requests
admitted while other rows decode. No wall-clock asserts: ordering is forced with events.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from relax_agent import metrics as M
from relax_agent.config import EngineConfig
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.engines.hf import HFEngine
from tests.fixtures import chat_prompt, reference_logprobs


def make_engine(hf_policy, **cfg) -> HFEngine:
    model, tok = hf_policy
    return HFEngine(model, tok, EngineConfig(**{"max_batch_size": 8, "batch_wait_s": 0.05, **cfg}), seed=0,
                    stop_token_ids=())


def observation(tokenizer, text: str) -> list[int]:
    """The ids an env appends after a reply: the end of the turn, a user turn, the generation prompt."""
    return tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)


def run_turns(engine: HFEngine, tok, turns: int, between=None, offset: int = 0) -> list[tuple[list[int], Generation]]:
    """One episode: each turn's prompt extends the last (prompt + sampled + observation).

    ``between(k)`` runs after turn k. Returns (prompt, generation) per turn.
    """
    prompt, out = chat_prompt(tok, 12, offset), []
    for k in range(turns):
        gen = engine.generate_many([prompt], SamplingParams(max_new_tokens=6, seed=k))[0]
        out.append((prompt, gen))
        if between is not None:
            between(k)
        prompt = prompt + list(gen.token_ids) + observation(tok, f"result {k}")
    return out


def test_a_later_turn_prefills_only_its_new_tokens(hf_policy):
    model, tok = hf_policy
    with make_engine(hf_policy) as engine:
        prefilled = []
        turns = run_turns(engine, tok, 3, between=lambda k: prefilled.append(engine.stats.prefill_tokens))
    assert prefilled[0] == len(turns[0][0])
    for k in (1, 2):
        prompt, _ = turns[k]
        prev_prompt, prev = turns[k - 1]
        # all earlier tokens have KV but the previous turn's last sampled token (never fed)
        new = len(prompt) - (len(prev_prompt) + len(prev.token_ids) - 1)
        assert prefilled[k] - prefilled[k - 1] == new < len(prompt) // 2
    hit = engine.stats.prefix_hit_tokens
    assert hit == sum(len(p) for p, _ in turns) - prefilled[-1]
    assert engine.metrics() == {M.PREFIX_CACHE_HIT_RATE: pytest.approx(hit / sum(len(p) for p, _ in turns))}
    assert engine.metrics() == {M.PREFIX_CACHE_HIT_RATE: 0.0}  # nothing prefilled since the previous call
    for prompt, gen in turns:
        torch.testing.assert_close(torch.tensor(gen.logprobs), reference_logprobs(model, prompt, gen.token_ids),
                                   atol=1e-4, rtol=0)
    with make_engine(hf_policy, prefix_cache=False) as plain:
        again = run_turns(plain, tok, 3)
    assert plain.stats.prefix_hit_tokens == 0 and plain.stats.prefill_tokens == sum(len(p) for p, _ in again)
    assert plain.metrics() == {}  # no prefix cache, no hit rate to report
    assert [g.token_ids for _, g in again] == [g.token_ids for _, g in turns]  # same seeds, same tokens


def test_a_weight_update_between_turns_forces_a_full_prefill(hf_policy):
    model, tok = hf_policy
    gen = torch.Generator().manual_seed(0)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
                 if "layers.0." in k}
    with make_engine(hf_policy) as engine:
        counts = []

        def update_after_first_turn(k):
            counts.append((engine.stats.prefill_tokens, engine.stats.prefix_hit_tokens))
            if k == 0:
                engine.load_weights(new_state, version=1)

        turns = run_turns(engine, tok, 3, between=update_after_first_turn)
    (p0, h0), (p1, h1), (p2, h2) = counts
    assert h0 == 0 and p0 == len(turns[0][0])
    assert h1 == 0 and p1 - p0 == len(turns[1][0])  # turn 2: everything prefilled again, under the new weights
    assert h2 > 0 and p2 - p1 < len(turns[2][0]) // 2  # turn 3 reuses turn 2's KV, from the new weights
    assert [g.policy_version for _, g in turns] == [0, 1, 1]
    for prompt, g in turns[1:]:  # the model now holds the new weights: old KV would show here
        torch.testing.assert_close(torch.tensor(g.logprobs), reference_logprobs(model, prompt, g.token_ids),
                                   atol=1e-4, rtol=0)


def test_a_group_prefills_its_shared_prompt_once(hf_policy):
    _, tok = hf_policy
    prompt = chat_prompt(tok, 20)
    with make_engine(hf_policy) as engine:
        gens = engine.generate_many([prompt] * 4, [SamplingParams(max_new_tokens=4, seed=s) for s in range(4)])
    assert len({g.token_ids for g in gens}) == 4
    assert engine.stats.prefills == 4 and engine.stats.prefill_tokens == len(prompt) + 3  # then 1 token each
    assert engine.stats.prefix_hit_tokens == 3 * (len(prompt) - 1)
    assert engine.stats.decode_steps == 3 and engine.stats.max_batch_rows == 4


def test_prefix_cache_is_off_by_default_when_requests_decode_alone(hf_policy):
    _, tok = hf_policy
    assert EngineConfig(max_batch_size=1).uses_prefix_cache() is False
    assert EngineConfig(max_batch_size=1, prefix_cache=True).uses_prefix_cache() is True
    assert EngineConfig(max_batch_size=2).uses_prefix_cache() is True
    prompt = chat_prompt(tok, 10)
    with make_engine(hf_policy, max_batch_size=1) as engine:
        engine.generate_many([prompt, prompt], SamplingParams(max_new_tokens=3))
    assert engine.stats.prefix_hit_tokens == 0 and engine.stats.prefill_tokens == 2 * len(prompt)


def test_the_prefix_cache_is_bounded_least_recently_used_first(hf_policy):
    _, tok = hf_policy
    a, b = chat_prompt(tok, 12, offset=0), chat_prompt(tok, 12, offset=100)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)  # the chat template's common start
    # room for one finished sequence (prompt + 6 sampled - 1 never fed), not for two
    with make_engine(hf_policy, prefix_cache_max_tokens=max(len(a), len(b)) + 5) as engine:
        hits = []
        for prompt in (a, b, a):
            before = engine.stats.prefix_hit_tokens
            engine.generate_many([prompt], SamplingParams(max_new_tokens=6, seed=0))
            hits.append(engine.stats.prefix_hit_tokens - before)
    assert 0 < shared < len(a) - 1
    # A's KV was evicted by B's: the second A finds only the template start (in B's entry), not A's prompt
    assert hits == [0, shared, shared]
    with make_engine(hf_policy) as roomy:
        for prompt in (a, b, a):
            roomy.generate_many([prompt], SamplingParams(max_new_tokens=6, seed=0))
    assert roomy.stats.prefix_hit_tokens == shared + len(a) - 1


def test_a_request_arriving_mid_batch_starts_before_the_batch_finishes(hf_policy):
    _, tok = hf_policy
    long_tokens: list[int] = []
    long_at_short_end: list[int] = []
    started, submitted = threading.Event(), threading.Event()

    def on_long_token(*_):  # worker thread: pause the long row after 3 tokens until the short one is queued
        long_tokens.append(1)
        if len(long_tokens) == 3:
            started.set()
            submitted.wait(30)

    def on_short_token(*_):
        long_at_short_end.append(len(long_tokens))

    with make_engine(hf_policy) as engine:
        async def main():
            long = asyncio.create_task(engine.generate(chat_prompt(tok, 3), SamplingParams(max_new_tokens=60),
                                                       on_token=on_long_token))
            await asyncio.to_thread(started.wait, 30)
            short = asyncio.create_task(engine.generate(chat_prompt(tok, 7), SamplingParams(max_new_tokens=4),
                                                        on_token=on_short_token))
            await asyncio.sleep(0)  # the short request is in the queue now
            submitted.set()
            return await short, await long

        short, long = asyncio.run(main())
    assert len(short.token_ids) == 4 and len(long.token_ids) == 60
    assert long_at_short_end[-1] < 60  # the short request finished while the long one was still decoding
    assert engine.stats.batches == 1 and engine.stats.admitted_mid_batch == 1 and engine.stats.max_batch_rows == 2


def test_a_pending_weight_load_admits_nothing_and_runs_before_new_requests(hf_policy):
    model, tok = hf_policy
    gen = torch.Generator().manual_seed(1)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
                 if "layers.1." in k}
    count, started, release = [], threading.Event(), threading.Event()

    def on_long_token(*_):
        count.append(1)
        if len(count) == 3:
            started.set()
            release.wait(30)

    with make_engine(hf_policy) as engine:
        async def main():
            long = asyncio.create_task(engine.generate(chat_prompt(tok, 3), SamplingParams(max_new_tokens=20),
                                                       on_token=on_long_token))
            await asyncio.to_thread(started.wait, 30)
            loader = asyncio.create_task(asyncio.to_thread(engine.load_weights, new_state, 1))
            while not engine._loads_pending:  # the loader is waiting for the running row
                await asyncio.sleep(0.001)
            short = asyncio.create_task(engine.generate(chat_prompt(tok, 7), SamplingParams(max_new_tokens=4)))
            await asyncio.sleep(0)
            release.set()
            return await long, await short, await loader

        long, short, _ = asyncio.run(main())
    assert long.policy_version == 0 and len(long.token_ids) == 20
    assert short.policy_version == 1 and engine.stats.admitted_mid_batch == 0 and engine.stats.batches == 2
    torch.testing.assert_close(torch.tensor(short.logprobs),
                               reference_logprobs(model, chat_prompt(tok, 7), short.token_ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy", ["finish_old", "abort_resume"])
def test_abort_resume_loads_between_two_decode_steps_and_the_rows_resume_exactly_on_the_new_weights(hf_policy, policy):
    import copy

    model, tok = hf_policy
    old_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
                 if "layers.1." in k or k == "lm_head.weight"}
    prompt = chat_prompt(tok, 9)
    paused, release, tokens_at_load, hits_before, streamed = threading.Event(), threading.Event(), [], [], []

    def on_first_row_token(_tok, _lp, version):
        streamed.append(version)
        if len(streamed) == 3:
            paused.set()
            release.wait(30)

    with make_engine(hf_policy, hf={"update_policy": policy}) as engine:
        async def main():
            rows = [asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=24, seed=s),
                                                        on_token=on_first_row_token if s == 0 else None))
                    for s in (0, 1)]
            await asyncio.to_thread(paused.wait, 30)
            hits_before.append(engine.stats.prefix_hit_tokens)
            loader = asyncio.create_task(asyncio.to_thread(engine.load_weights, new_state, 1))
            while not engine._loads_pending:
                await asyncio.sleep(0.001)
            release.set()
            await loader
            if policy == "finish_old":  # the rows were answered before the load could start
                tokens_at_load.extend(len(r.result().token_ids) for r in rows if r.done())
            return [await r for r in rows]

        gens = asyncio.run(main())
    if policy == "finish_old":  # the load waited for both rows: one version each
        assert tokens_at_load == [24, 24] and all(g.token_versions == () and g.policy_version == 0 for g in gens)
        assert engine.stats.resumed_rows == 0
        return
    assert streamed == [0] * 3 + [1] * 21  # the stream saw the version of each token as it was sampled
    assert engine.stats.resumed_rows == 2
    for g in gens:  # 3 tokens sampled by version 0 (the pause was in the step of the third), then version 1
        assert len(g.token_ids) == 24 and g.policy_version == 0
        assert g.token_versions == (0,) * 3 + (1,) * 21
        torch.testing.assert_close(torch.tensor(g.logprobs[:3]), reference_logprobs(old_model, prompt, g.token_ids)[:3],
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(g.logprobs[3:]), reference_logprobs(model, prompt, g.token_ids)[3:],
                                   atol=1e-4, rtol=0)
    assert gens[0].token_ids != gens[1].token_ids
    # the cache was cleared by the load; the second row's rebuild reused the prompt the first row's
    # rebuild had just cached under the new weights
    assert engine.stats.prefix_hit_tokens - hits_before[0] >= len(prompt)
