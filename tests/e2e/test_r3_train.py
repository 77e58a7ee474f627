"""A tiny random Qwen3-MoE trains through the real CLI with routing replay on: a bf16 rollout from the
HF engine, and an fp32 rollout from the vLLM engine (skipped without the vLLM venv)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_agent.errors import ConfigError
from relax_agent.models import make_tiny_model
from relax_agent.rollout.engines.vllm_engine import find_vllm_python
from relax_agent.train.algorithms import (
    MISMATCH_ABS_DIFF_MAX,
    MISMATCH_ABS_DIFF_MEAN,
    MISMATCH_FRAC_GT_LN2,
    MISMATCH_FRAC_GT_LN5,
    MISMATCH_K3_KL,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_moe_policy_trains_with_routing_replay_and_logs_mismatch(tmp_path):
    model = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=0)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/tiny.yaml", f"model.path={model}",
           "env.id=examples.custom_env:examples/Echo-v0", f"run.output_dir={run}", "trainer.steps=2",
           "eval.at_start=false", "eval.at_end=false", "checkpoint.every_steps=0", "logging.tensorboard=false",
           "engine.dtype=bf16", "moe.routing_replay=rollout", "--quiet"]
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        for key in (MISMATCH_K3_KL, MISMATCH_ABS_DIFF_MEAN, MISMATCH_ABS_DIFF_MAX, MISMATCH_FRAC_GT_LN2,
                    MISMATCH_FRAC_GT_LN5):
            assert r[key] >= 0
        assert 0 < r[MISMATCH_ABS_DIFF_MEAN] < 0.1  # a bf16 rollout, replayed: close but not bit-exact
        assert r["moe/replayed_tokens"] == r["train/policy_tokens"]  # every policy token's forward was replayed
        assert 0 <= r["moe/route_flip_frac"] < 0.5
        assert r["mismatch/alarm"] == 0.0  # the same weights on both sides: a steady bf16 level, no jump


def _no_vllm() -> str | None:
    try:
        find_vllm_python()
    except ConfigError as exc:
        return f"no vLLM venv: {exc}"
    return None


@pytest.mark.skipif(_no_vllm() is not None, reason=_no_vllm() or "")
def test_moe_policy_trains_with_routing_replay_from_the_vllm_engine(tmp_path):
    # head_dim 32 (vLLM's CPU attention has no 16); layer 0 dense, so vLLM's MoE layer ids are 1 and 2
    model = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=0, num_attention_heads=2, num_key_value_heads=1,
                            num_hidden_layers=3, mlp_only_layers=[0])
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/tiny.yaml", f"model.path={model}",
           "env.id=examples.custom_env:examples/Echo-v0", f"run.output_dir={run}", "trainer.steps=2",
           "eval.at_start=false", "eval.at_end=false", "checkpoint.every_steps=0", "logging.tensorboard=false",
           "engine.kind=vllm", "engine.vllm.kv_cache_gib=1", "engine.vllm.max_model_len=2048",
           "moe.routing_replay=rollout", "--quiet"]
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert r["train/policy_tokens"] > 0
        assert r["moe/replayed_tokens"] == r["train/policy_tokens"]  # every policy token's forward was replayed
        # an fp32 rollout of the weights the trainer holds: vLLM's routes are the trainer's own top-k
        assert r["moe/route_flip_frac"] <= 0.01
        assert r[MISMATCH_ABS_DIFF_MEAN] < 1e-4  # fp32 on the same weights: ~5e-7 seen (step 2 runs on the synced version)
