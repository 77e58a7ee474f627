"""A weight load that fails during a training run (the trainer's tiny policy, the HF engine, the real CLI in
this process): once, and the version is published again and the run goes on; every time, and the run ends
with one error line that names the refusal and the command that resumes, after the last checkpoint."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from relax_agent.cli import app
from relax_agent.rollout.engines.hf.engine import HFEngine

REPO = Path(__file__).resolve().parents[2]


def args(tiny_model_dir: Path, out: Path) -> list[str]:
    # Echo's reward is a character similarity: every group varies, every step updates and publishes a version
    return [f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0", f"run.output_dir={out}",
            "trainer.steps=3", "eval.at_start=false",
            "eval.at_end=false", "checkpoint.every_steps=1", "logging.tensorboard=false", "logging.plot=false",
            "run.num_threads=1"]


def failing_loads(monkeypatch, versions: set[int], times: int) -> list[int]:
    """HFEngine.load_weights raises for each version in ``versions``, ``times`` times each; returns the
    versions it was asked to load, in order."""
    seen: list[int] = []
    left = dict.fromkeys(versions, times)
    load = HFEngine.load_weights

    @functools.wraps(load)  # the same signature: the subscriber passes expected_digests (weights.verify)
    def flaky(self, state_dict, version, *a, **kw):
        seen.append(int(version))
        if left.get(int(version), 0) > 0:
            left[int(version)] -= 1
            raise RuntimeError(f"injected load failure of version {version}")
        return load(self, state_dict, version, *a, **kw)

    monkeypatch.setattr(HFEngine, "load_weights", flaky)
    return seen


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_a_load_that_fails_once_is_published_again_and_the_run_goes_on(in_repo, monkeypatch, tiny_model_dir,
                                                                        tmp_path):
    seen = failing_loads(monkeypatch, {2}, times=1)
    result = CliRunner().invoke(app, ["train", "examples/tiny.yaml", *args(tiny_model_dir, tmp_path), "--quiet"])
    assert result.exit_code == 0, result.output
    assert seen == [1, 2, 2, 3]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    retries = {r["step"]: r["weights/publish_retries"] for r in rows if "weights/publish_retries" in r}
    assert retries == {1: 0.0, 2: 1.0, 3: 0.0}


def test_a_load_that_always_fails_ends_the_run_with_one_line_and_the_resume_command(in_repo, monkeypatch,
                                                                                   tiny_model_dir, tmp_path):
    seen = failing_loads(monkeypatch, {2}, times=100)
    cli = args(tiny_model_dir, tmp_path)
    result = CliRunner().invoke(app, ["train", "examples/tiny.yaml", *cli, "--quiet"])
    assert result.exit_code == 1, result.output
    assert seen == [1, 2, 2, 2]  # weights.publish_retries: 2
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert "version 2 was refused by 1 of 1 subscribers" in result.output
    assert "injected load failure of version 2" in result.output
    assert result.output.rstrip().endswith("resume from the last checkpoint with: relax-agent train examples/tiny.yaml "
                                           + " ".join(cli) + " --resume")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1].endswith("1")  # step 1 is saved
