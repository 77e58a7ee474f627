"""`relax-agent train` in async mode on a tiny real model: recorded versions, staleness bound, resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _cli(tiny_model_dir, out, *args):
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/tiny.yaml", f"model.path={tiny_model_dir}",
           "env.id=examples.custom_env:examples/Echo-v0", "eval.at_start=false", "eval.at_end=false",
           "logging.tensorboard=false", f"run.output_dir={out}", "--quiet", *args]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _samples(run: Path) -> list[dict]:
    rows = []
    for f in sorted((run / "rollouts").glob("step_*.jsonl")):
        rows += [{**json.loads(line), "step": int(f.stem[5:])} for line in f.read_text().splitlines()]
    return rows


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_in_process(tiny_model_dir, out, *overrides):
    """The CLI's path without a new interpreter: config, roles, controller."""
    from relax_agent.config import load_config
    from relax_agent.control import build_controller
    from relax_agent.roles import build_roles

    cfg = load_config(REPO / "examples/tiny.yaml", [
        f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0", "eval.at_start=false",
        "eval.at_end=false", "logging.tensorboard=false", "checkpoint.every_steps=0", f"run.output_dir={out}",
        *overrides])
    roles = build_roles(cfg)
    engine_params = {p.data_ptr() for p in roles.engine._model.parameters()}
    assert not engine_params & {p.data_ptr() for p in roles.trainer.model.parameters()}  # separate copies
    ctrl = build_controller(cfg, roles)
    try:
        ctrl.train()
    finally:
        ctrl.close()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("async-runs")
    _train_in_process(tiny_model_dir, base / "colocate", "trainer.steps=2")
    _train_in_process(tiny_model_dir, base / "s0", "trainer.steps=2", "mode=async")
    _cli(tiny_model_dir, base / "s1", "trainer.steps=2", "mode=async", "max_staleness=1", "trainer.off_policy=tis")
    resumed = _cli(tiny_model_dir, base / "s1", "trainer.steps=3", "mode=async", "max_staleness=1",
                   "trainer.off_policy=tis", "--resume")
    return base, resumed


def test_async_s0_trains_the_same_samples_at_the_same_versions_as_colocate(runs):
    base, _ = runs
    key = lambda r: (r["step"], r["sample_id"], r["task_id"], r["sample_version"], r["trained_at_version"])  # noqa: E731
    colocate, s0 = _samples(base / "colocate"), _samples(base / "s0")
    assert len(s0) == 2 * 2 * 4 and [key(r) for r in s0] == [key(r) for r in colocate]
    assert all(r["trained_at_version"] == r["sample_version"] for r in s0)
    assert [r["policy_version"] for r in _metrics(base / "s0")] == [r["policy_version"] for r in _metrics(base / "colocate")]


def test_async_s1_stays_within_max_staleness_and_resumes(runs):
    base, resumed = runs
    rows = _samples(base / "s1")
    assert sorted({r["step"] for r in rows}) == [1, 2, 3]
    assert all(0 <= r["trained_at_version"] - r["sample_version"] <= 1 for r in rows if not r["dropped_stale"])
    assert all(min(r["policy_versions"]) >= r["sample_version"] for r in rows)
    assert "resumed from" in resumed.stderr and "at step 2" in resumed.stderr
    last = _metrics(base / "s1")[-1]
    assert last["step"] == 3 and last["policy_version"] == 3
    for key in ("async/staleness_mean", "async/staleness_max", "async/staleness/0", "async/staleness/1",
                "off_policy/iw_mean", "off_policy/iw_max", "off_policy/iw_clipped_frac",
                "timing/data_wait_s", "timing/samples_per_s"):
        assert key in last, key
    state = json.loads((base / "s1" / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["step"] == 3 and state["policy_version"] == 3 and state["groups_drawn"] >= 3 * 2


def test_async_with_the_ray_data_bus_starts_its_own_ray_from_the_cli(tiny_model_dir, tmp_path):
    out = tmp_path / "ray-bus"
    _cli(tiny_model_dir, out, "trainer.steps=1", "mode=async", "data.backend=ray", "data.ray_num_cpus=1",
         "checkpoint.every_steps=0")
    assert [r["step"] for r in _metrics(out)] == [1] and _metrics(out)[0]["policy_version"] == 1
    assert len(_samples(out)) == 2 * 4
