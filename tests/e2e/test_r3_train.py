"""A tiny random Qwen3-MoE trains through the real CLI with a bf16 rollout and routing replay on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_agent.models import make_tiny_model
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
