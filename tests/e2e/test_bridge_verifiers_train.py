"""`relax-agent train` on a verifiers environment named through its bridge scheme
(``verifiers:<module>:<function>``): the run trains two steps with a tiny random policy, and every recorded reward is
verifiers' own scoring (``Task.score`` of a trace built from the recorded episode) of the reply the env saw."""

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
ENV_ID = "verifiers:tests.e2e.data.vf_envs:load_math"
SMALL = ["rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "rollout.max_total_tokens=1024",
         "trainer.steps=2", "trainer.micro_batch_size=4", "eval.at_start=false", "eval.at_end=false",
         "checkpoint.every_steps=0", "logging.progress=false", "logging.tensorboard=false", "run.num_threads=1",
         "rollout.tool_parser=hermes_strict"]
CONFIG = f"""run:
  name: verifiers-math
  seed: 0
env:
  id: "{ENV_ID}"
  max_turns: 2
"""


def test_train_on_a_verifiers_env_scores_with_its_rubric(tiny_model_dir, tmp_path):
    import relax_agent.envs as envs
    from relax_agent.rollout.parsers import build_parser
    from tests.e2e.data.vf_envs import verifiers_score

    config = tmp_path / "verifiers.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", str(config), f"model.path={tiny_model_dir}",
           f"run.output_dir={out}", *SMALL, "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "rollout/reward" in line]
    assert steps == [1, 2]
    rows = {r["sample_id"]: r for r in map(json.loads, (out / "rollouts" / "step_000002.jsonl").read_text().splitlines())}
    with gzip.open(out / "rollouts" / "tokens" / "step_000002.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == len(rows) == 4
    env = envs.make(ENV_ID)
    parser = build_parser("hermes_strict")
    try:
        train = {t["id"] for t in env.unwrapped.tasks("train")}
        for rec in records:
            row = rows[rec["sample_id"]]
            assert row["task_id"] in train and row["error"] is None and row["reward_status"] == "ok"
            assert row["stop_reason"] in ("terminated", "length")  # one reply ends a single-turn task
            task = env.unwrapped._tasks[row["task_id"]]
            opening, reply = rec["messages"][:-1], rec["messages"][-1]
            assert opening == [{"role": "system", "content": task.data.system_prompt},
                               {"role": "user", "content": task.data.prompt}]  # the task's own prompt
            action = parser.parse(reply["content"] or "").message()  # what the env was handed
            assert row["reward"] == pytest.approx(verifiers_score(task, [*opening, action]).reward)
            assert {"vf_reward_correct", "vf_reward_format", "vf_metric_reply_chars"} <= set(row["metrics"])
    finally:
        env.close()
