"""Training with a reward served over HTTP on 127.0.0.1: rewards come from the service, a
dead service masks and counts samples (never a reward of 0), a wrong token fails at start-up."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_agent.reward_services.testing import ServiceProcess

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

REWARD_PY = '''
def score(item):
    """Length of the reply / 100: visibly different from the Echo env's own reward."""
    return {"reward": min(len(item.response_text()), 100) / 100.0, "metrics": {"chars": float(len(item.response_text()))}}
'''


def _train(tiny_model_dir, out, *args, env=None):
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/tiny.yaml", f"model.path={tiny_model_dir}",
           "env.id=examples.custom_env:examples/Echo-v0", "eval.at_start=false", "eval.at_end=false",
           f"run.output_dir={out}", "--quiet", *args]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600)


def _samples(out: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "length_reward.py"
    path.write_text(REWARD_PY)
    return f"{path}:score"


def test_rewards_come_from_the_service(tiny_model_dir, tmp_path, reward_file):
    with ServiceProcess(reward_file, "--token-env", "RWD_TOKEN", env={"RWD_TOKEN": "s3cret"}) as svc:
        out = tmp_path / "run"
        res = _train(tiny_model_dir, out, "trainer.steps=1", "reward.source=remote", f"reward.url={svc.url}",
                     "reward.token_env=RWD_TOKEN", env={"RWD_TOKEN": "s3cret"})
    assert res.returncode == 0, res.stderr[-3000:]
    samples = _samples(out, 1)
    assert len(samples) == 8
    for s in samples:
        assert s["reward_status"] == "ok"
        assert s["reward"] == pytest.approx(min(s["metrics"]["reward/chars"], 100) / 100.0)


def test_wrong_token_fails_at_start_up(tiny_model_dir, tmp_path, reward_file):
    with ServiceProcess(reward_file, "--token-env", "RWD_TOKEN", env={"RWD_TOKEN": "s3cret"}) as svc:
        res = _train(tiny_model_dir, tmp_path / "run", "reward.source=remote", f"reward.url={svc.url}",
                     "reward.token_env=RWD_TOKEN", env={"RWD_TOKEN": "wrong"})
    assert res.returncode == 1
    assert "token" in res.stderr.lower() and "loading policy" not in res.stderr


def test_unreachable_service_fails_at_start_up(tiny_model_dir, tmp_path, reward_file):
    svc = ServiceProcess(reward_file).start()
    url = svc.url
    svc.kill()
    res = _train(tiny_model_dir, tmp_path / "run", "reward.source=remote", f"reward.url={url}",
                 "reward.retry_max_elapsed_s=1", "reward.max_attempts=2", "reward.connect_timeout_s=0.5")
    assert res.returncode == 1 and url in res.stderr and "loading policy" not in res.stderr
