"""`relax-agent train examples/tiny.yaml trainer.backend=megatron trainer.megatron.tensor_parallel=2`:
three steps through the real CLI, and a resume that continues at the right step with identical weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _cli(*args):
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/tiny.yaml", "trainer.backend=megatron",
           "trainer.megatron.tensor_parallel=2", *args, "--quiet"]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=900)


def _trained_steps(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "train/loss" in r]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("megatron-runs")
    # Each request decoded alone, one kernel thread: rollouts cannot depend on machine load.
    common = [f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0", "eval.at_start=false",
              "eval.at_end=false", "engine.max_batch_size=1", "run.num_threads=1", "logging.tensorboard=false"]
    a, b = base / "a", base / "b"
    full = _cli(*common, f"run.output_dir={a}", "trainer.steps=3")
    assert full.returncode == 0, full.stderr[-3000:]
    first = _cli(*common, f"run.output_dir={b}", "trainer.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _cli(*common, f"run.output_dir={b}", "trainer.steps=3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return a, b, resumed


def test_three_steps_train_through_the_cli(runs, tiny_model_dir):
    a, _, _ = runs
    assert _trained_steps(a) == [1, 2, 3]
    before = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    after = load_file(str(a / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    assert after.keys() == before.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_resume_continues_at_the_right_step_with_identical_weights(runs):
    a, b, resumed = runs
    assert "resumed from" in resumed.stderr and "at step 2" in resumed.stderr
    assert _trained_steps(b) == [1, 2, 3]
    want = load_file(str(a / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    got = load_file(str(b / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
