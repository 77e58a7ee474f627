"""``engine.kind: vllm`` on a CUDA GPU with the CUDA vLLM build: log-probs against the trainer's
forward pass and a weight version through the tcp weight sync. Skipped without a GPU or without
a CUDA vLLM venv (``$RELAX_VLLM_PYTHON``); run by ``scripts/gpu_check_vllm.sh``.

The GPU path applies versions the way the CPU path does (a safetensors file reloaded between
steps); vLLM's NCCL weight-transfer API is not wired into this engine.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from relax_agent.config import ModelConfig
from relax_agent.models import load_policy, make_tiny_model
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.config import EngineConfig, VLLMConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not os.environ.get("RELAX_VLLM_PYTHON"),
                       reason="needs RELAX_VLLM_PYTHON: the python of a venv with the CUDA vllm build"),
]


def reference_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + list(completion)], device="cuda")
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)[len(prompt) - 1:-1]
    return logp.gather(1, torch.tensor(completion, device="cuda")[:, None]).squeeze(1).cpu()


def test_vllm_on_gpu_matches_the_forward_pass_and_takes_a_version(tmp_path):
    from relax_agent.weights import WeightSyncConfig, build_weight_sync

    path = make_tiny_model(tmp_path / "tiny", arch="llama", seed=0, head_dim=32)
    model, tok = load_policy(ModelConfig(path=str(path)))
    model = model.to("cuda").eval()
    cfg = EngineConfig(kind="vllm", vllm=VLLMConfig(max_model_len=2048, python=os.environ["RELAX_VLLM_PYTHON"]))
    engine = cfg.build(model=model, tokenizer=tok, device="cuda", seed=0)
    try:
        prompt = [1] + list(range(100, 140))
        gen = engine.generate_many([prompt], SamplingParams(max_new_tokens=16, temperature=0.8, seed=1))[0]
        torch.testing.assert_close(torch.tensor(gen.logprobs), reference_logprobs(model, prompt, gen.token_ids, 0.8),
                                   atol=1e-3, rtol=0)
        new = {k: v * 1.1 for k, v in model.state_dict().items()}
        sync = build_weight_sync(WeightSyncConfig(transport="tcp"), engines=[engine])
        try:
            stats = sync.publish(new, version=1)
        finally:
            sync.close()
        assert engine.policy_version == 1 and stats.subscribers == 1
        model.load_state_dict(new)
        after = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0.8, seed=2)))
        assert after.token_versions == (1,) * 16
        torch.testing.assert_close(torch.tensor(after.logprobs),
                                   reference_logprobs(model, prompt, after.token_ids, 0.8), atol=1e-3, rtol=0)
    finally:
        engine.close()
