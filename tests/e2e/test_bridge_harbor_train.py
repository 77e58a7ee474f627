"""`relax-agent train` on a Harbor task folder named through its bridge scheme (``harbor:<folder>``): the run
trains two steps with the tiny random policy, each recorded reward is what the task's tests/test.sh gives for
the episode's own actions replayed in a fresh container (0.0: the random policy solves nothing), and the
reference solution, played through the same env code path, scores 1.0."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_agent.envs.bridges.harbor import HarborEnv
from relax_agent.sandboxes.reaper import LABEL_SANDBOX
from relax_agent.sandboxes.testing import require_backend

pytestmark = [pytest.mark.slow, pytest.mark.docker]
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "harbor" / "sum-numbers"
SMALL = ["rollout.tasks_per_step=1", "rollout.group_size=4", "rollout.max_new_tokens=16", "rollout.max_total_tokens=1024",
         "trainer.steps=2", "trainer.micro_batch_size=4", "checkpoint.every_steps=0", "logging.progress=false",
         "logging.tensorboard=false", "run.num_threads=1", "env.kwargs.max_turns=2", "env.max_turns=2"]
SANDBOX = {"backend": "docker", "memory_mb": 512, "cpus": 1.0, "pids_limit": 64, "workdir_mb": 64, "ttl_s": 300}


def _as_action(message: dict) -> dict:
    """A recorded assistant message as the driver handed it to ``step``."""
    return {"role": "assistant", "content": message.get("content") or "", "tool_calls": message.get("tool_calls") or [],
            **({"parse_errors": message["parse_errors"]} if message.get("parse_errors") else {})}


def test_train_on_a_harbor_task_folder_scores_with_its_tests(tiny_model_dir, tmp_path):
    require_backend("docker")
    import docker

    run_id = f"harbor-e2e-{os.getpid()}"
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/harbor.yaml", f"model.path={tiny_model_dir}",
           f"run.output_dir={tmp_path}", f"env.kwargs.sandbox.run_id={run_id}", *SMALL, "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = docker.from_env()
    try:  # the run's containers went with their episodes
        assert client.containers.list(all=True, filters={"label": f"{LABEL_SANDBOX}={run_id}"}) == []
    finally:
        client.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "rollout/reward" in line]
    assert steps == [1, 2]
    env = HarborEnv(str(EXAMPLE), sandbox=SANDBOX, max_turns=2)
    try:
        replayed = 0
        for step in (1, 2):
            dumped = {r["sample_id"]: r for r in
                      map(json.loads, (tmp_path / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines())}
            with gzip.open(tmp_path / "rollouts" / "tokens" / f"step_{step:06d}.jsonl.gz", "rt") as f:
                records = [json.loads(line) for line in f]
            assert len(records) == 4 and {r["task_id"] for r in dumped.values()} == {"sum-numbers"}
            for rec in records:
                row = dumped[rec["sample_id"]]
                assert row["error"] is None and row["reward_status"] == "ok", row
                assert row["reward"] == 0.0 and row["metrics"]["verifier_ok"] == 1.0  # test.sh ran and wrote 0
                instruction = EXAMPLE.joinpath("instruction.md").read_text().strip()
                assert any(m["role"] == "user" and m["content"].startswith(instruction) for m in rec["messages"])
                # the same actions in a fresh container: tests/test.sh gives the recorded reward
                env.reset(seed=0, options={"task": env.tasks("train")[0]})
                actions = [_as_action(rec["messages"][turn["message"]]) for turn in rec["turns"]]  # the sampled turns
                played = 0
                for action in actions:
                    _, reward, terminated, truncated, info = env.step(action)
                    played += 1
                    if terminated or truncated:
                        break
                assert played == len(actions) and (terminated or truncated)  # it ended where the recorded one did
                assert (reward, info["verifier_ok"]) == (row["reward"], row["metrics"]["verifier_ok"])
                replayed += 1
        assert replayed == 8
        task = env.tasks("train")[0]  # the reference solution through the same env code path
        env.reset(seed=0, options={"task": task})
        for action in env.oracle_actions(task):
            _, reward, terminated, _, info = env.step(action)
        assert (reward, terminated, info["verifier_status"]) == (1.0, True, "ok")
    finally:
        env.close()
