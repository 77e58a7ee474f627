"""A tiny random policy trains through the real CLI with GSPO, RLOO advantages, IcePop masking and
DAPO's soft overlong punishment: every step's metrics are there and finite, and the policy moves."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _train(tiny_model_dir, run: Path, *overrides: str) -> list[dict]:
    """The step rows of a two-step run on the Echo env."""
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/tiny.yaml", f"model.path={tiny_model_dir}",
           "env.id=examples.custom_env:examples/Echo-v0", f"run.output_dir={run}", "trainer.steps=2",
           "eval.at_start=false", "eval.at_end=false", "run.num_threads=1", *overrides, "--quiet"]
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "rollout/reward" in r]


def test_gspo_rloo_icepop_soft_overlong_trains(tiny_model_dir, tmp_path):
    steps = _train(tiny_model_dir, tmp_path / "run", "trainer.loss=gspo", "trainer.loss_agg=seq_mean",
                   "trainer.advantage=rloo", "trainer.mismatch.mode=icepop", "rollout.overlong.mode=soft",
                   "rollout.overlong.buffer_tokens=8")
    assert [r["step"] for r in steps] == [1, 2]
    trained = [r for r in steps if r["train/samples"] > 0]
    assert trained, "no step had a group with an RLOO signal"
    for r in trained:
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/clip_frac", "train/ratio_mean",
                    "mismatch/weight_mean", "mismatch/masked_token_frac", "mismatch/masked_seq_frac",
                    "mismatch/seq_log_ratio_mean"):
            assert math.isfinite(r[key]), (key, r.get(key))
        assert 0.0 <= r["mismatch/masked_token_frac"] <= 1.0
    for r in steps:
        assert 0.0 <= r["overlong/truncated_frac"] <= 1.0
        assert -1.0 <= r["overlong/penalty_mean"] <= 0.0
    assert steps[-1]["policy_version"] >= len(trained)  # one new policy version per update
    assert steps[-1]["policy_version"] > 0


def test_cispo_reinforce_pp_baseline_seq_tis_trains(tiny_model_dir, tmp_path):
    steps = _train(tiny_model_dir, tmp_path / "run", "trainer.loss=cispo", "trainer.advantage=reinforce_pp_baseline",
                   "trainer.mismatch.mode=seq_tis")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # batch-normalised: every trainable sample with a policy token is trained
        assert r["train/samples"] == 8 and r["advantage/batch_std"] > 0
        for key in ("train/loss", "train/grad_norm", "mismatch/weight_mean", "mismatch/clipped_token_frac"):
            assert math.isfinite(r[key]), (key, r.get(key))
    assert steps[-1]["policy_version"] == 2
