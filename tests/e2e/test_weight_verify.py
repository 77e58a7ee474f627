"""Verified weight syncs (``weights.verify``, on by default) into real engines: a clean publish passes
the digest check, a tensor corrupted after the engine's load fails the publish naming that tensor and
version, and the engine does not serve that version."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax_agent.config import EngineConfig, ModelConfig
from relax_agent.errors import EngineError, WeightSyncError
from relax_agent.models import load_policy
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.weights import WeightSyncConfig, build_weight_sync
from relax_agent.weights.sync import VERIFY_S

CORRUPTED = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def trainer_state(tiny_model_dir):
    """The trainer's fp32 state dict: the tiny llama with every parameter moved (tied embeddings stay tied)."""
    model, _ = load_policy(ModelConfig(path=str(tiny_model_dir)))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.state_dict()


def make_engine(tiny_model_dir, dtype: str = "fp32") -> HFEngine:
    model, tok = load_policy(ModelConfig(path=str(tiny_model_dir)), dtype=dtype)
    return HFEngine(model, tok, EngineConfig(), seed=0)


def corrupt_after_copy(engine: HFEngine, name: str, loads: set[int]) -> None:
    """Make ``engine``'s weight copy perturb one row of ``name`` after loading, on its ``loads``-th
    weight loads (1-based)."""
    original = engine._copy_weights
    count = [0]

    def copy_then_corrupt(target, state_dict):
        original(target, state_dict)
        count[0] += 1
        if count[0] in loads:
            target[name][0].add_(1.0)

    engine._copy_weights = copy_then_corrupt


@pytest.mark.parametrize("transport,dtype", [("inproc", "fp32"), ("tcp", "bf16")])
def test_clean_sync_passes_verification_and_reports_its_cost(tiny_model_dir, trainer_state, transport, dtype):
    engine = make_engine(tiny_model_dir, dtype)
    sync = build_weight_sync(WeightSyncConfig(transport=transport, bucket_mb=1), [engine])
    try:
        stats = sync.publish(trainer_state, 1)
        assert engine.policy_version == 1
        assert 0 < stats.verify_s < stats.seconds
        assert stats.as_metrics()[VERIFY_S] == stats.verify_s
        assert engine.stats.weight_verify_s > 0
        want = trainer_state[CORRUPTED].to(engine._model.state_dict()[CORRUPTED].dtype)
        assert torch.equal(engine._model.state_dict()[CORRUPTED], want)
        gen = engine.generate_many([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))[0]
        assert gen.policy_version == 1
    finally:
        sync.close()
        engine.close()


def test_tensor_corrupted_after_load_fails_the_publish_and_is_not_served(tiny_model_dir, trainer_state):
    engine = make_engine(tiny_model_dir)
    sync = build_weight_sync(WeightSyncConfig(transport="inproc", publish_retries=0), [engine])  # the refusal itself
    try:
        corrupt_after_copy(engine, CORRUPTED, {2})
        sync.publish(trainer_state, 1)
        moved = {k: v + 0.01 for k, v in trainer_state.items()}
        with pytest.raises(WeightSyncError) as info:
            sync.publish(moved, 2)
        message = str(info.value)
        assert "version 2" in message and CORRUPTED in message
        assert sum(name in message for name in trainer_state) == 1  # only the corrupted tensor is named
        assert engine.policy_version == 1 and sync.latest_version == 1  # withdrawn; not served
        with pytest.raises(EngineError, match="not verified.*version 2"):
            engine.generate_many([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
        stats = sync.publish(moved, 2)  # a clean load of the same version verifies and serves again
        assert engine.policy_version == 2 and stats.subscribers == 1
        assert engine.generate_many([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))[0].policy_version == 2
    finally:
        sync.close()
        engine.close()


def test_a_load_corrupted_once_is_published_again_within_the_publish_and_served(tiny_model_dir, trainer_state):
    engine = make_engine(tiny_model_dir)
    sync = build_weight_sync(WeightSyncConfig(transport="inproc"), [engine])  # weights.publish_retries: 2
    try:
        corrupt_after_copy(engine, CORRUPTED, {2})
        sync.publish(trainer_state, 1)
        moved = {k: v + 0.01 for k, v in trainer_state.items()}
        stats = sync.publish(moved, 2)  # the second copy is corrupted and refused, the third verifies
        assert stats.retries == 1 and engine.policy_version == 2 and sync.latest_version == 2
        want = moved[CORRUPTED].to(engine._model.state_dict()[CORRUPTED].dtype)
        assert torch.equal(engine._model.state_dict()[CORRUPTED], want)
        assert engine.generate_many([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))[0].policy_version == 2
    finally:
        sync.close()
        engine.close()


def test_verify_off_does_not_check(tiny_model_dir, trainer_state):
    engine = make_engine(tiny_model_dir)
    sync = build_weight_sync(WeightSyncConfig(transport="inproc", verify=False), [engine])
    try:
        corrupt_after_copy(engine, CORRUPTED, {1})
        stats = sync.publish(trainer_state, 1)
        assert engine.policy_version == 1 and stats.verify_s == 0.0 and engine.stats.weight_verify_s == 0.0
    finally:
        sync.close()
        engine.close()


def test_media_engine_verifies_its_loads_and_serves_no_corrupted_version(tmp_path):
    from relax_agent.models import make_tiny_media_model
    from relax_agent.rollout.engines.config import EngineConfig
    from relax_agent.rollout.engines.hf import HFEngine

    model, tok = load_policy(ModelConfig(path=str(make_tiny_media_model(tmp_path, kind="tiny-vl", seed=1))))
    engine = HFEngine(model, tok, EngineConfig())
    state = {k: v + 0.01 for k, v in model.state_dict().items()}
    name = next(k for k, v in state.items() if v.dim() == 2 and "visual" in k)
    sync = build_weight_sync(WeightSyncConfig(transport="inproc"), [engine])
    try:
        stats = sync.publish(state, 1)
        assert engine.policy_version == 1 and stats.verify_s > 0 and engine.stats.weight_verify_s > 0
        original = engine._copy_weights

        def copy_then_corrupt(target, state_dict):
            original(target, state_dict)
            target[name][0].add_(1.0)

        engine._copy_weights = copy_then_corrupt
        with pytest.raises(WeightSyncError, match=rf"version 2(.|\n)*{name}: the engine's values differ"):
            sync.publish({k: v + 0.01 for k, v in state.items()}, 2)
        assert engine.policy_version == 1
        with pytest.raises(EngineError, match="not verified.*version 2"):
            asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, seed=0)))
    finally:
        sync.close()
        engine.close()
