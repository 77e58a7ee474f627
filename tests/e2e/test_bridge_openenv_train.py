"""`relax-agent train` on an OpenEnv environment named through its bridge scheme (``openenv:<module>:<app>``): the run
starts the environment's server as a local process, trains two steps, and every recorded reward equals what the server
gives the recorded replies when they are replayed through openenv's own client; no server process outlives the run."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TARGET = "tests.e2e.data.openenv_guess:app"
SMALL = ["rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=12", "rollout.max_total_tokens=1024",
         "trainer.steps=2", "trainer.micro_batch_size=4", "eval.at_start=false", "eval.at_end=false",
         "checkpoint.every_steps=0", "logging.progress=false", "logging.tensorboard=false", "run.num_threads=1"]
CONFIG = f"""\
run:
  name: openenv-guess
  seed: 0
env:
  id: "openenv:{TARGET}"
  kwargs:
    num_tasks: 40
    keep_alive_s: 60
  max_turns: 3
rollout:
  tool_parser: hermes
trainer:
  lr: 1.0e-5
"""


def _servers_of(parent: int) -> list[int]:
    """Pids of the OpenEnv server processes the bridge started for process ``parent`` (from their command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 6 and b"relax-parent-pipe" in argv[2] and argv[4] == TARGET.encode() and argv[6] == str(parent).encode():
            found.append(int(entry.name))
    return found


def test_train_on_an_openenv_server_scores_with_the_server(tiny_model_dir, tmp_path):
    from openenv.core import GenericEnvClient

    from relax_agent.envs.bridges import openenv_server
    from relax_agent.rollout.parsers import build_parser

    config = tmp_path / "openenv.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "relax_agent.cli", "train", str(config), f"model.path={tiny_model_dir}",
                             f"run.output_dir={out}", *SMALL, "--quiet"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        _, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert _servers_of(proc.pid) == []  # the run's server was stopped at its exit
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "rollout/reward" in line]
    assert steps == [1, 2]
    rows = {r["sample_id"]: r for r in map(json.loads, (out / "rollouts" / "step_000002.jsonl").read_text().splitlines())}
    with gzip.open(out / "rollouts" / "tokens" / "step_000002.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == len(rows) == 4
    parser = build_parser("hermes")
    server = openenv_server.acquire(TARGET, max_sessions=8, keep_alive_s=0.0, start_timeout_s=300)
    try:
        for rec in records:
            row = rows[rec["sample_id"]]
            assert row["error"] is None and row["reward_status"] == "ok", row
            seed = int(row["task_id"].removeprefix("seed-"))
            assert rec["messages"][0] == {"role": "user", "content": "I am thinking of a number between 1 and 20. "
                                                                    "You have 3 guesses. Reply with a number."}
            replies = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
            assert 1 <= len(replies) <= 3
            with GenericEnvClient(base_url=server.url).sync() as client:  # the server's own scoring of the replies
                client.reset(seed=seed)
                results = [client.step({"message": parser.parse(text).message()["content"]}) for text in replies]
            assert row["reward"] == pytest.approx(sum(float(r.reward) for r in results))
            feedback = [m["content"] for m in rec["messages"][1:] if m["role"] == "user"]
            assert feedback == [r.observation["text"] for r in results]  # the observations the policy saw
            if results[-1].done:  # "length": the ending reply was cut at max_new_tokens
                assert row["stop_reason"] in ("terminated", "length"), row
    finally:
        openenv_server.release(server)
