"""Rollout / training dtypes: the per-device check, and fp16/bf16 MoE rollouts replayed by an fp16 or fp32 trainer."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from relax_agent import preflight as roles
from relax_agent.config import EngineConfig, ModelConfig, TrainerConfig, load_config
from relax_agent.errors import ConfigError
from relax_agent.models import load_policy, make_tiny_model
from relax_agent.moe import ROUTE_FLIP_FRAC
from relax_agent.records import Trajectory, Turn
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.train.algorithms import MISMATCH_ABS_DIFF_MEAN, MISMATCH_K3_KL
from relax_agent.train.backends.torch_backend import LOSS_SCALE, TorchTrainer
from relax_agent.train.batch import collate


@pytest.mark.parametrize("engine_dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("trainer_dtype", ["fp32", "bf16", "fp16"])
def test_every_dtype_combination_runs_on_cpu(engine_dtype, trainer_dtype):
    roles.check_dtypes("cpu", engine_dtype, trainer_dtype)


def test_preflight_accepts_an_fp16_rollout_on_cpu():
    cfg = load_config(None, ["run.device=cpu", "engine.dtype=fp16", "trainer.dtype=fp16"])
    assert roles.preflight(cfg) == "cpu"


def test_a_dtype_the_device_cannot_run_names_the_key(monkeypatch):
    monkeypatch.setattr(roles, "_dtype_problem", lambda device, dtype, training: "no half kernels" if dtype == "fp16" else None)
    with pytest.raises(ConfigError, match=r"engine.dtype=fp16 does not run on cpu: no half kernels; use fp32 or bf16"):
        roles.check_dtypes("cpu", "fp16", "fp32")
    with pytest.raises(ConfigError, match=r"trainer.dtype=fp16"):
        roles.check_dtypes("cpu", "bf16", "fp16")


def test_bf16_on_a_gpu_without_bf16_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert "no bf16" in roles._dtype_problem.__wrapped__("cuda:0", "bf16", False)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3-moe"), arch="qwen3_moe", seed=0)


def rollout_batch(model_dir, dtype: str):
    model, tok = load_policy(ModelConfig(path=str(model_dir)), dtype=dtype)
    prompts = [[1, 504, 2116, 30, 1536, 17], [1, 42, 43], [1, 900, 901, 902, 903]]
    with HFEngine(model, tok, EngineConfig(max_batch_size=4), record_routes=True) as engine:
        gens = engine.generate_many(prompts, [SamplingParams(max_new_tokens=24, seed=s) for s in range(3)])
    trajs = []
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        assert all(math.isfinite(lp) for lp in g.logprobs) and g.routed_experts.dtype == np.uint8
        turn = Turn(len(p), g.token_ids, g.logprobs, 0, g.finish_reason, g.routed_experts)
        trajs.append(Trajectory(f"s{i}", "g", "t", (*p, *g.token_ids), (0,) * len(p) + (1,) * len(g.token_ids),
                                (0.0,) * len(p) + g.logprobs, len(p), (turn,), 1.0))
    return collate(trajs, [1.0, -1.0, 0.5], pad_token_id=0)


def test_half_precision_rollouts_replayed_by_an_fp32_trainer(moe_dir):
    model, _ = load_policy(ModelConfig(path=str(moe_dir)))
    gaps = {}
    for dtype in ("bf16", "fp16"):
        batch = rollout_batch(moe_dir, dtype)
        m = TorchTrainer(copy.deepcopy(model), TrainerConfig(micro_batch_size=4), routing_replay=True).compute_gradients(batch)
        assert 0 < m[MISMATCH_ABS_DIFF_MEAN] < 0.05 and m[MISMATCH_K3_KL] >= 0 and 0 <= m[ROUTE_FLIP_FRAC] < 0.5
        gaps[dtype] = m[MISMATCH_ABS_DIFF_MEAN]
    assert gaps["fp16"] < gaps["bf16"]  # fp16 keeps 3 more mantissa bits


def test_fp16_trainer_with_loss_scaling_and_replay_trains(moe_dir):
    model, _ = load_policy(ModelConfig(path=str(moe_dir)))
    batch = rollout_batch(moe_dir, "fp16")
    trainer = TorchTrainer(model, TrainerConfig(micro_batch_size=2, dtype="fp16", lr=1e-3), routing_replay=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step(batch)
    assert metrics[LOSS_SCALE] > 1 and trainer.step == 1
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n.endswith("mlp.gate.weight"))
