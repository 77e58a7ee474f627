"""Each agent framework of ``examples/agents`` trains two steps with the tiny model and replays
step 1 without divergence, as ``test_agent_train.py`` does for the plain SDK agents.

The frameworks are not dependencies of relax-agent: they live in their own venv, built by
``scripts/setup_agent_frameworks.sh`` (at ``/opt/relax-fw-venv``, or ``$RELAX_FW_VENV``). Without
it these tests skip."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("RELAX_FW_VENV", "/opt/relax-fw-venv"))
HOW = f"run scripts/setup_agent_frameworks.sh (builds {VENV}; set RELAX_FW_VENV for another path)"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                                                   reason=f"no agent-framework venv at {VENV}: {HOW}")]
FRAMEWORKS = {  # example agent -> the module its venv must hold
    "openai_agents_agent.py": "agents",
    "langgraph_agent.py": "langgraph",
    "smolagents_agent.py": "smolagents",
    "litellm_agent.py": "litellm",
}


@pytest.fixture
def run_dir():
    """A directory the jailed agents' uid may enter (pytest's ``tmp_path`` is root's only)."""
    path = Path(tempfile.mkdtemp(prefix="relax-fw-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _framework_python(module: str) -> str:
    """The framework venv's interpreter; skips the test when the framework is not installed there."""
    python = VENV / "bin" / "python"
    found = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, timeout=300)
    if found.returncode != 0:
        pytest.skip(f"{module} is not installed in {VENV}: {HOW}")
    return str(python)


@pytest.mark.parametrize("agent", sorted(FRAMEWORKS))
def test_two_training_steps_and_a_replay_through_the_framework_agent(tiny_model_dir, run_dir, agent):
    """Two steps of 4 episodes, every episode without error and at least one request, then step 1's
    episodes all replay without divergence."""
    python = _framework_python(FRAMEWORKS[agent])
    out = run_dir / "run"
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/agents/openai_sdk_agent.yaml", "--quiet",
           f"model.path={tiny_model_dir}", f"run.output_dir={out}", "trainer.steps=2", "rollout.tasks_per_step=2",
           "rollout.group_size=2", "rollout.max_new_tokens=16", "rollout.max_total_tokens=1024",
           "rollout.agent.env.AGENT_MAX_TURNS='2'", "eval.at_start=false", "eval.num_tasks=2", "trainer.micro_batch_size=4",
           "checkpoint.every_steps=0", "run.num_threads=1", "logging.tensorboard=false", "logging.plot=false",
           f'rollout.agent.command=["{python}", "examples/agents/{agent}"]']
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2]
    samples = [json.loads(line) for line in (out / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    episodes = [s for s in samples if not s.get("context_of") and not s.get("side_branch_of")]
    assert len(episodes) == 4
    assert all(s["error"] is None for s in episodes), [s["error"] for s in episodes]
    assert all(s["metrics"]["agent/requests"] >= 1 for s in episodes)
    done = subprocess.run([sys.executable, "-m", "relax_agent.cli", "replay", "examples/agents/openai_sdk_agent.yaml",
                           *cmd[6:], "--step", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    n = int(last.split(" of ")[1].split()[0])
    assert last == f"step 1: {n} of {n} episodes replay without divergence" and n >= 4, done.stdout
    assert "skipped" not in done.stdout, done.stdout
