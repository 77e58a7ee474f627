"""Ctrl-C during training saves the last complete step and exits 130; --resume continues."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _cmd(tiny_model_dir, out, *extra):
    return [sys.executable, "-m", "relax_agent.cli", "train", "examples/tiny.yaml", f"model.path={tiny_model_dir}",
            "env.id=examples.custom_env:examples/Echo-v0", "eval.at_start=false", "eval.at_end=false",
            "checkpoint.every_steps=0", f"run.output_dir={out}", "--quiet", *extra]


def _logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if "rollout/reward" in line]


@pytest.mark.parametrize("wait_steps", [1, 3])
def test_sigint_saves_last_complete_step_and_resumes(tiny_model_dir, tmp_path, wait_steps):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(tiny_model_dir, out, "trainer.steps=1000"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    deadline = time.monotonic() + 300
    while len(_logged_steps(out)) < wait_steps:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "training made no progress"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "interrupted: saved" in stderr
    steps = _logged_steps(out)
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == [f"step_{steps[-1]:06d}"]
    state = json.loads((ckpts[-1] / "state.json").read_text())
    assert state["step"] == steps[-1] and steps == list(range(1, steps[-1] + 1))

    resumed = subprocess.run(_cmd(tiny_model_dir, out, f"trainer.steps={steps[-1] + 1}", "--resume"), cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _logged_steps(out) == list(range(1, steps[-1] + 2))
