"""A tiny random policy trains through the real CLI, checkpoints, and resumes exactly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/tiny.yaml", *args, "--quiet"]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _task_ids(run: Path, step: int) -> list[str]:
    lines = (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    return [json.loads(line)["task_id"] for line in lines]


def _responses(run: Path, step: int) -> list[list[str]]:
    lines = (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    return [json.loads(line)["response"] for line in lines]


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    # Resume reproduces responses exactly when sampling cannot depend on batch composition (and so on
    # machine load): each request decoded alone, one kernel thread. With larger batches the tasks,
    # ids and seeds are still identical, but padding changes logits in the last bits.
    common = [f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0",
              "eval.at_start=false", "eval.num_tasks=2", "engine.max_batch_size=1", "run.num_threads=1"]
    a, b = base / "a", base / "b"
    full = _cli(*common, f"run.output_dir={a}", "trainer.steps=3", cwd=REPO)
    assert full.returncode == 0, full.stderr[-3000:]
    first = _cli(*common, f"run.output_dir={b}", "trainer.steps=2", "eval.at_end=false", cwd=REPO)
    assert first.returncode == 0, first.stderr[-3000:]
    with (b / "metrics.jsonl").open("a") as f:  # a step 3 logged before a crash, never checkpointed
        f.write(json.dumps({"step": 3, "rollout/reward": -1.0, "crashed": True}) + "\n")
    resumed = _cli(*common, f"run.output_dir={b}", "trainer.steps=3", "--resume", cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return a, b, resumed


def test_two_steps_change_the_weights(runs, tiny_model_dir):
    a, _, _ = runs
    before = _weights(Path(tiny_model_dir))
    after = _weights(a / "checkpoints" / "step_000003" / "model")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "no parameter changed after training"
    steps = [r["step"] for r in _rows(a) if "rollout/reward" in r]
    assert steps == [1, 2, 3]
    assert (a / "plots" / "curves.png").stat().st_size > 10_000
    assert list((a / "tensorboard").glob("events.out.tfevents.*"))
    summary = json.loads((a / "summary.json").read_text())
    assert "eval/accuracy" in summary["eval_end"]
    samples = [json.loads(line) for line in (a / "eval" / "step_000003.samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * len(summary["eval_end"]["eval/seeds"])  # eval.num_tasks=2, every seed
    correct = [s["verdict"]["correct"] for s in samples]
    assert sum(correct) / len(correct) == pytest.approx(summary["eval_end"]["eval/accuracy"])


def test_resume_continues_at_the_right_step_with_identical_data(runs):
    a, b, resumed = runs
    assert "resumed from" in resumed.stderr and "at step 2" in resumed.stderr
    assert json.loads((b / "checkpoints" / "step_000003" / "state.json").read_text())["step"] == 3
    assert [r["step"] for r in _rows(b) if "rollout/reward" in r] == [1, 2, 3]  # step 3 once: the redone one
    assert not any(r.get("crashed") for r in _rows(b))
    superseded = [json.loads(line) for line in (b / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded == [{"step": 3, "rollout/reward": -1.0, "crashed": True}]
    for step in (1, 2, 3):
        assert _task_ids(a, step) == _task_ids(b, step)
    assert _responses(a, 3) == _responses(b, 3)
    wa = _weights(a / "checkpoints" / "step_000003" / "model")
    wb = _weights(b / "checkpoints" / "step_000003" / "model")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


def test_existing_run_without_resume_is_refused(runs, tiny_model_dir):
    a, _, _ = runs
    out = _cli(f"model.path={tiny_model_dir}", f"run.output_dir={a}", cwd=REPO)
    assert out.returncode == 2 and "--resume" in out.stderr


def test_config_errors_fail_before_loading_a_model(tmp_path):
    out = _cli("trainer.lrr=1", f"run.output_dir={tmp_path}", cwd=REPO)
    assert out.returncode == 2 and "trainer.lrr: unknown key; did you mean 'trainer.lr'" in out.stderr
    out = _cli("env.id=relax/BFCL-simpel-v0", f"run.output_dir={tmp_path}", cwd=REPO)
    assert out.returncode == 2 and "did you mean 'relax/BFCL-simple-v0'" in out.stderr
    assert "loading policy" not in out.stderr
