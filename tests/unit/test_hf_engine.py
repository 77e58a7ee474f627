"""HFEngine with the tiny random llama: log-probs, batching, stops, budgets, weights, close."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from relax_agent.config import EngineConfig
from relax_agent.errors import ConfigError, DataError, EngineError, WeightSyncError
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams, default_stop_ids
from relax_agent.rollout.engines.hf import HFEngine, sample_tokens, top_p_filter
from tests.fixtures import chat_prompt, reference_logprobs


@pytest.fixture
def engine(hf_policy):
    model, tokenizer = hf_policy
    eng = HFEngine(model, tokenizer, EngineConfig(max_batch_size=16, batch_wait_s=0.05), seed=0)
    yield eng
    eng.close()


async def gather(engine, prompts, params):
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    return await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))


def slow_forward(model, delay_s: float):
    """Make every forward pass of ``model`` take at least ``delay_s`` (returns the hook handle)."""
    return model.register_forward_pre_hook(lambda *_: time.sleep(delay_s))


def test_is_an_inference_engine(engine):
    assert isinstance(engine, InferenceEngine)


def test_logprobs_equal_a_full_forward_pass_with_mixed_prompt_lengths(hf_policy, engine):
    model, tok = hf_policy
    prompts = [chat_prompt(tok, n) for n in (1, 9, 40, 4)]
    params = [SamplingParams(max_new_tokens=12, temperature=t, top_p=p, seed=i)
              for i, (t, p) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.3, 1.0), (0.5, 0.5)])]
    gens = asyncio.run(gather(engine, prompts, params))
    assert engine.stats.batches == 1 and engine.stats.max_batch_rows == 4
    assert len({len(p) for p in prompts}) == 4
    for prompt, sp, gen in zip(prompts, params, gens, strict=True):
        assert len(gen.token_ids) == 12 and gen.finish_reason == "length" and gen.policy_version == 0
        ref = reference_logprobs(model, prompt, gen.token_ids, sp.temperature)
        torch.testing.assert_close(torch.tensor(gen.logprobs), ref, atol=1e-4, rtol=0)


def test_batched_generation_equals_unbatched(hf_policy, engine):
    model, tok = hf_policy
    prompts = [chat_prompt(tok, n) for n in (2, 17, 6)]
    batched = asyncio.run(gather(engine, prompts, [SamplingParams(max_new_tokens=10, seed=s) for s in (5, 6, 7)]))
    single = HFEngine(model, tok, EngineConfig(max_batch_size=1), seed=0)
    try:
        alone = [single.generate_many([p], SamplingParams(max_new_tokens=10, seed=s))[0]
                 for p, s in zip(prompts, (5, 6, 7), strict=True)]
    finally:
        single.close()
    # one row at a time alone (a request sent right after the previous one finished may join its decode run)
    assert single.stats.max_batch_rows == 1 and engine.stats.max_batch_rows == 3
    for a, b in zip(batched, alone, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_stop_token_ends_its_row_and_the_others_continue_correctly(hf_policy, engine):
    model, tok = hf_policy
    prompts = [chat_prompt(tok, n) for n in (3, 12, 25)]
    free = engine.generate_many(prompts, [SamplingParams(max_new_tokens=10, seed=s) for s in (1, 2, 3)])
    first = free[0].token_ids
    k = next(i for i in range(2, 10) if first[i] not in first[:i])
    params = [SamplingParams(max_new_tokens=10, seed=1, stop_token_ids=(first[k],)),
              SamplingParams(max_new_tokens=10, seed=2), SamplingParams(max_new_tokens=10, seed=3)]
    gens = engine.generate_many(prompts, params)
    assert gens[0].token_ids == first[:k + 1] and gens[0].finish_reason == "stop"
    for prompt, gen, ref in zip(prompts[1:], gens[1:], free[1:], strict=True):
        assert gen.token_ids == ref.token_ids and gen.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(gen.logprobs),
                                   reference_logprobs(model, prompt, gen.token_ids, 1.0), atol=1e-4, rtol=0)


def test_default_stop_ids_are_eos_and_im_end(hf_policy):
    _, tok = hf_policy
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert default_stop_ids(tok) == sorted({tok.eos_token_id, im_end}) == [2]


def test_engine_stop_ids_apply_to_every_request(hf_policy):
    model, tok = hf_policy
    prompt = chat_prompt(tok, 5)
    probe = HFEngine(model, tok, EngineConfig(), stop_token_ids=())
    free = probe.generate_many([prompt], SamplingParams(max_new_tokens=8, seed=9))[0]
    probe.close()
    stopper = HFEngine(model, tok, EngineConfig(), stop_token_ids=(free.token_ids[0],))
    gen = stopper.generate_many([prompt], SamplingParams(max_new_tokens=8, seed=9))[0]
    stopper.close()
    assert gen.token_ids == free.token_ids[:1] and gen.finish_reason == "stop"


def test_max_new_tokens_is_respected_per_row(hf_policy, engine):
    _, tok = hf_policy
    budgets = (1, 3, 7, 2)
    gens = engine.generate_many([chat_prompt(tok, 4)] * 4, [SamplingParams(max_new_tokens=n) for n in budgets])
    assert [len(g.token_ids) for g in gens] == list(budgets)
    assert [g.finish_reason for g in gens] == ["length"] * 4
    assert engine.stats.decode_steps == max(budgets) - 1  # the first token of each comes from its prefill
    assert engine.stats.prefills == 4 and engine.stats.forward_passes == 4 + max(budgets) - 1


def test_eight_concurrent_requests_share_one_batch_and_one_forward_per_step(hf_policy, engine):
    _, tok = hf_policy
    prompts = [chat_prompt(tok, n) for n in range(1, 9)]
    gens = asyncio.run(gather(engine, prompts, SamplingParams(max_new_tokens=6)))
    assert len(gens) == 8
    assert engine.stats.batches == 1 and engine.stats.max_batch_rows == 8
    assert engine.stats.prefills == 8 and engine.stats.decode_steps == 5  # 5 decode steps for all 8 rows
    assert engine.stats.new_tokens == 48
    assert len({g.token_ids for g in gens}) == 8  # each request drew its own seed


def test_max_batch_size_bounds_the_rows_of_every_forward_pass(hf_policy):
    model, tok = hf_policy
    eng = HFEngine(model, tok, EngineConfig(max_batch_size=3, batch_wait_s=0.05))
    rows = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        gens = asyncio.run(gather(eng, [chat_prompt(tok, n) for n in range(1, 8)],
                                  [SamplingParams(max_new_tokens=2 + n % 3) for n in range(7)]))
    finally:
        hook.remove()
        eng.close()
    assert [len(g.token_ids) for g in gens] == [2 + n % 3 for n in range(7)]
    assert max(rows) == eng.stats.max_batch_rows == 3 and eng.stats.sequences == 7


def test_load_weights_changes_outputs_and_bumps_the_version(hf_policy, engine):
    model, tok = hf_policy
    prompt = chat_prompt(tok, 6)
    params = SamplingParams(max_new_tokens=8, seed=4)
    before = engine.generate_many([prompt], params)[0]
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items() if "layers.0." in k}
    engine.load_weights(new_state, version=3)
    after = engine.generate_many([prompt], params)[0]
    assert engine.policy_version == 3 and before.policy_version == 0 and after.policy_version == 3
    assert after.logprobs != before.logprobs
    torch.testing.assert_close(model.state_dict()["model.layers.0.mlp.up_proj.weight"],
                               new_state["model.layers.0.mlp.up_proj.weight"])
    torch.testing.assert_close(torch.tensor(after.logprobs),
                               reference_logprobs(model, prompt, after.token_ids, 1.0), atol=1e-4, rtol=0)


def test_load_weights_refuses_unknown_keys_and_shapes_without_copying(hf_policy, engine):
    model, _ = hf_policy
    w = model.state_dict()["model.norm.weight"].clone()
    with pytest.raises(WeightSyncError, match="not in the model"):
        engine.load_weights({"model.norm.weight": w + 1, "nope.weight": w}, version=1)
    with pytest.raises(WeightSyncError, match="shape"):
        engine.load_weights({"model.norm.weight": w + 1, "lm_head.weight": w}, version=1)
    torch.testing.assert_close(model.state_dict()["model.norm.weight"], w)
    assert engine.policy_version == 0


def test_a_generation_never_sees_two_weight_versions(hf_policy, engine):
    model, tok = hf_policy
    prompt = chat_prompt(tok, 5)
    old_state = {k: v.clone() for k, v in model.state_dict().items()}
    new_state = {k: v * 1.5 for k, v in old_state.items() if k.endswith("mlp.down_proj.weight")}
    mid_batch, release = threading.Event(), threading.Event()
    calls = []

    def pause_at_third_forward(*_):
        calls.append(1)
        if len(calls) == 3:
            mid_batch.set()
            release.wait(10)

    hook = model.register_forward_pre_hook(pause_at_third_forward)
    try:
        async def main():
            task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=8, seed=1)))
            await asyncio.to_thread(mid_batch.wait, 10)
            loader = asyncio.create_task(asyncio.to_thread(engine.load_weights, new_state, 1))
            await asyncio.sleep(0.1)  # a loader that did not wait for the batch would have copied by now
            release.set()
            await loader
            return await task

        gen = asyncio.run(main())
    finally:
        release.set()
        hook.remove()
    assert gen.policy_version == 0 and engine.policy_version == 1 and len(gen.token_ids) == 8
    torch.testing.assert_close(model.state_dict()["model.layers.1.mlp.down_proj.weight"],
                               new_state["model.layers.1.mlp.down_proj.weight"])
    model.load_state_dict(old_state)
    torch.testing.assert_close(torch.tensor(gen.logprobs),
                               reference_logprobs(model, prompt, gen.token_ids, 1.0), atol=1e-4, rtol=0)


def test_close_fails_in_flight_and_queued_requests(hf_policy):
    model, tok = hf_policy
    eng = HFEngine(model, tok, EngineConfig(max_batch_size=1, batch_wait_s=0.0))
    hook = slow_forward(model, 0.01)

    async def main():
        tasks = [asyncio.create_task(eng.generate(chat_prompt(tok, n), SamplingParams(max_new_tokens=200)))
                 for n in (1, 2, 3)]
        while eng.stats.forward_passes < 2:
            await asyncio.sleep(0.005)
        await asyncio.to_thread(eng.close)
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = asyncio.run(main())
    finally:
        hook.remove()
    assert all(isinstance(r, EngineError) for r in results), results
    assert "decoding" in str(results[0]) and "before this request ran" in str(results[2])
    with pytest.raises(EngineError, match="closed"):
        asyncio.run(eng.generate([1, 2, 3], SamplingParams()))
    eng.close()  # idempotent


def test_cancelled_request_leaves_the_batch(hf_policy, engine):
    model, tok = hf_policy
    hook = slow_forward(model, 0.01)

    async def main():
        long = asyncio.create_task(engine.generate(chat_prompt(tok, 2), SamplingParams(max_new_tokens=500)))
        short = asyncio.create_task(engine.generate(chat_prompt(tok, 3), SamplingParams(max_new_tokens=15)))
        done = await short
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        return done

    try:
        short = asyncio.run(main())
        time.sleep(0.1)
        settled = engine.stats.new_tokens
        time.sleep(0.2)
    finally:
        hook.remove()
    assert len(short.token_ids) == 15
    assert engine.stats.new_tokens == settled < 15 + 40  # the cancelled row stopped far short of 500 tokens
    assert engine.generate_many([chat_prompt(tok, 1)], SamplingParams(max_new_tokens=2))[0].token_ids


def test_reseed_reproduces_sampling_without_per_request_seeds(hf_policy, engine):
    _, tok = hf_policy
    prompts = [chat_prompt(tok, 3), chat_prompt(tok, 8)]
    engine.reseed(11)
    a = engine.generate_many(prompts, SamplingParams(max_new_tokens=6))
    engine.reseed(11)
    b = engine.generate_many(prompts, SamplingParams(max_new_tokens=6))
    c = engine.generate_many(prompts, SamplingParams(max_new_tokens=6))
    assert [g.token_ids for g in a] == [g.token_ids for g in b] != [g.token_ids for g in c]


def test_engine_under_inference_mode_leaves_the_model_trainable(hf_policy, engine):
    model, tok = hf_policy
    prompt = chat_prompt(tok, 4)
    with torch.inference_mode():
        gen = engine.generate_many([prompt], SamplingParams(max_new_tokens=4))[0]
        engine.load_weights({"model.norm.weight": torch.full_like(model.model.norm.weight, 1.1)}, version=1)
    assert not any(p.is_inference() for p in model.parameters())
    model.train()
    out = model(torch.tensor([prompt + list(gen.token_ids)]), labels=torch.tensor([prompt + list(gen.token_ids)]))
    out.loss.backward()
    assert model.model.norm.weight.grad is not None and model.model.norm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("params, error, match", [
    (SamplingParams(temperature=0.0), ConfigError, "temperature"),
    (SamplingParams(top_p=0.0), ConfigError, "top_p"),
    (SamplingParams(max_new_tokens=0), ConfigError, "max_new_tokens"),
    (SamplingParams(max_new_tokens=5000), DataError, "max_position_embeddings"),
])
def test_bad_sampling_params_are_refused(engine, params, error, match):
    with pytest.raises(error, match=match):
        asyncio.run(engine.generate([1, 2, 3], params))


@pytest.mark.parametrize("prompt, match", [([], "empty"), ([1, 49152], "49152"), ([-1], "-1")])
def test_bad_prompts_are_refused(engine, prompt, match):
    with pytest.raises(DataError, match=match):
        engine.generate_many([prompt], SamplingParams())


def test_top_p_filter_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]] * 3)
    out = top_p_filter(probs, torch.tensor([0.8, 0.81, 1.0]))
    assert out[0].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.3])
    assert out[1].tolist() == pytest.approx([0.0, 0.5, 0.15, 0.3])
    assert out[2].tolist() == pytest.approx(probs[2].tolist())


def test_sample_tokens_follows_the_tempered_distribution():
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).repeat(4000, 1)
    temps = torch.full((4000,), 0.5)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    tokens, logprobs = sample_tokens(logits, temps, torch.ones(4000), gens)
    expected = torch.softmax(logits[0] / 0.5, -1)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)
    torch.testing.assert_close(logprobs, expected.log()[tokens])
    nucleus, _ = sample_tokens(logits, torch.ones(4000), torch.full((4000,), 0.6), gens)
    assert set(nucleus.tolist()) == {2, 3}


def test_generate_many_checks_the_params_count(engine):
    with pytest.raises(ConfigError, match="2 prompts but 1"):
        engine.generate_many([[1], [2]], [SamplingParams()])


def test_requests_from_several_threads_are_served(hf_policy, engine):
    _, tok = hf_policy
    results: list = []

    def worker(n: int) -> None:
        results.extend(engine.generate_many([chat_prompt(tok, n)], SamplingParams(max_new_tokens=3)))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 4 and all(len(g.token_ids) == 3 for g in results)


# ---------------------------------------------------------------------------- FakeEngine

def test_fake_engine_scripts_replies_and_cuts_them():
    from relax_agent.rollout.engines.fake import FakeEngine, fake_logprob

    eng = FakeEngine([[10, 11, 2, 12], [13, 14, 15], [16, 17]], delay_s=0.001)
    assert isinstance(eng, InferenceEngine)

    async def main():
        return await asyncio.gather(eng.generate([1], SamplingParams()),
                                    eng.generate([1, 2], SamplingParams(max_new_tokens=2)),
                                    eng.generate([3], SamplingParams(stop_token_ids=(16,))))

    a, b, c = asyncio.run(main())
    assert (a.token_ids, a.finish_reason) == ((10, 11, 2), "stop")
    assert (b.token_ids, b.finish_reason) == ((13, 14), "length")
    assert (c.token_ids, c.finish_reason) == ((16,), "stop")
    assert a.logprobs == (fake_logprob(10, 0), fake_logprob(11, 1), fake_logprob(2, 2))
    assert all(-2.0 <= lp < 0 for lp in a.logprobs)
    assert [call.prompt_ids for call in eng.calls] == [(1,), (1, 2), (3,)]
    with pytest.raises(EngineError, match="3 scripted replies"):
        asyncio.run(eng.generate([1], SamplingParams()))


def test_fake_engine_callable_weights_and_close():
    from relax_agent.rollout.engines.fake import FakeEngine

    eng = FakeEngine(lambda prompt, params: [len(prompt), 2])
    assert eng.generate_many([[5, 5, 5]], SamplingParams())[0].token_ids == (3, 2)
    eng.load_weights({"w": torch.zeros(1)}, version=4)
    gen = asyncio.run(eng.generate([1], SamplingParams()))
    assert gen.policy_version == eng.policy_version == 4 and eng.calls[-1].policy_version == 4
    eng.close()
    with pytest.raises(EngineError, match="closed"):
        asyncio.run(eng.generate([1], SamplingParams()))
