"""`relax-agent train` runs two steps on BFCL multi-turn with a tiny random policy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("bfcl_eval")

REPO = Path(__file__).resolve().parents[2]


def test_two_training_steps_on_multi_turn_base(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    overrides = [
        f"model.path={tiny_model_dir}", f"run.output_dir={out}",
        # the smallest prompts: TradingBot-only tasks, compact docs (~1.7k prompt tokens)
        "env.kwargs.classes=[TradingBot]", "env.kwargs.max_steps_per_turn=1", "env.max_turns=4",
        "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "rollout.max_total_tokens=2560", "engine.max_batch_size=4",
        "trainer.steps=2", "trainer.micro_batch_size=1", "trainer.lr=1e-3",
        "eval.at_start=false", "eval.num_tasks=1", "checkpoint.every_steps=0",
        "logging.tensorboard=false", "logging.plot=false",
    ]
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/bfcl_multi_turn.yaml", *overrides, "--quiet"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2]
    for step in (1, 2):
        samples = [json.loads(line) for line in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(samples) == 2
        for s in samples:
            assert s["error"] is None and s["task_id"].startswith("multi_turn_base_")
            assert 0.0 <= s["reward"] <= 1.0 and "turn_accuracy" in s["metrics"]
    summary = json.loads((out / "summary.json").read_text())
    assert "eval/accuracy" in summary["eval_end"]
    assert summary["plot"] is None and not (out / "plots").exists()  # logging.plot=false
