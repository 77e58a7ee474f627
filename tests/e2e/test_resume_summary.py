"""A resumed run's summary keeps the evaluations of the run before its checkpoint (at start, after the
warm-up): they are read back from the run folder, so the CLI prints untrained, warm-up and final side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relax_agent.cli", "train", "examples/tiny.yaml", *args, "--quiet"],
                          cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True,
                          timeout=600)


def test_a_resumed_run_reports_the_start_and_warmup_evaluations_of_the_run_it_continues(tiny_model_dir, tmp_path):
    common = [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}", "eval.at_start=true",
              "eval.num_tasks=2", "trainer.sft_warmup_steps=1", "eval.after_warmup=true", "checkpoint.every_steps=1",
              "logging.tensorboard=false", "logging.plot=false", "run.num_threads=1"]
    first = cli(*common, "trainer.steps=1", "eval.at_end=false")
    assert first.returncode == 0, first.stderr[-3000:]
    before = json.loads((tmp_path / "summary.json").read_text())
    assert {"eval_start", "eval_warmup"} <= set(before) and "eval_end" not in before
    resumed = cli(*common, "trainer.steps=2", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = json.loads((tmp_path / "summary.json").read_text())
    assert after["eval_start"] == before["eval_start"] and after["eval_warmup"] == before["eval_warmup"]
    assert after["eval_end"]["eval/num_tasks"] == 2
    printed = [line.split(":")[0] for line in resumed.stderr.splitlines() if line.startswith("eval ")]
    assert printed == ["eval start", "eval warmup", "eval end"], resumed.stderr[-3000:]
