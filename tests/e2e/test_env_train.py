"""`relax-agent train` runs on the calculator env and on the custom tool env of examples/, with a tiny random policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SMALL = ["rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=12", "rollout.max_total_tokens=1024",
         "trainer.steps=2", "trainer.micro_batch_size=4", "eval.at_start=false", "eval.num_tasks=2", "eval.seeds=[0]",
         "checkpoint.every_steps=0", "logging.progress=false", "logging.tensorboard=false", "run.num_threads=1"]


def _train(config: str, tiny_model_dir: Path, out: Path, *extra: str, last_step: int = 2) -> list[dict]:
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", config, f"model.path={tiny_model_dir}",
           f"run.output_dir={out}", *SMALL, *extra, "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "rollouts" / f"step_{last_step:06d}.jsonl").read_text().splitlines()]


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if "rollout/reward" in line]


def test_train_on_the_calculator(tiny_model_dir, tmp_path):
    from relax_agent.envs.calculator import CalculatorEnv

    rows = _train("examples/calculator.yaml", tiny_model_dir, tmp_path, "env.max_turns=2")
    assert _steps(tmp_path) == [1, 2]
    train_ids = {t["id"] for t in CalculatorEnv(difficulty=1, num_tasks=2000).tasks("train")}
    assert len(rows) == 4 and all(r["task_id"] in train_ids for r in rows)
    assert all(r["error"] is None and r["reward_status"] == "ok" for r in rows)  # no env failure on random text
    ended = [r for r in rows if r["stop_reason"] in ("terminated", "length")]  # length: env ended on a cut-off reply
    assert ended and all({"tool_calls", "tool_errors", "correct"} <= set(r["metrics"]) for r in ended)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "eval/accuracy" in summary["eval_end"]


def test_train_on_the_custom_tool_env(tiny_model_dir, tmp_path):
    rows = _train("examples/custom_env.yaml", tiny_model_dir, tmp_path, "eval.at_end=false", "trainer.steps=1",
                  "env.max_turns=2", last_step=1)
    assert _steps(tmp_path) == [1]
    assert len(rows) == 4 and all(r["task_id"].startswith("units-") and r["error"] is None for r in rows)
