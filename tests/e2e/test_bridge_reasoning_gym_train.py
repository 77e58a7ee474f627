"""`relax-agent train` on a reasoning-gym generator named through its bridge scheme (``reasoning_gym:<dataset>``):
the run trains, and every recorded reward is the dataset's own ``score_answer`` of the answer the env saw."""

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
SMALL = ["rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "rollout.max_total_tokens=1024",
         "trainer.steps=2", "trainer.micro_batch_size=4", "eval.at_start=false", "eval.at_end=false",
         "checkpoint.every_steps=0", "logging.progress=false", "logging.tensorboard=false", "run.num_threads=1",
         "env.kwargs.size=200"]


def test_train_on_a_reasoning_gym_scheme_scores_with_the_dataset(tiny_model_dir, tmp_path):
    import reasoning_gym

    from relax_agent.envs.reasoning_gym import extract_answer

    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/reasoning_gym.yaml", f"model.path={tiny_model_dir}",
           f"run.output_dir={tmp_path}", *SMALL, "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "rollout/reward" in line]
    assert steps == [1, 2]
    dataset = reasoning_gym.create_dataset("leg_counting", size=200, seed=0)
    by_question = {dataset[i]["question"]: dataset[i] for i in range(len(dataset))}
    with gzip.open(tmp_path / "rollouts" / "tokens" / "step_000002.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    dumped = {r["sample_id"]: r for r in map(json.loads, (tmp_path / "rollouts" / "step_000002.jsonl").read_text().splitlines())}
    assert len(records) == 4
    for rec in records:
        question = rec["messages"][0]["content"].rsplit("\n\n", 1)[0]
        entry = by_question[question]  # the prompt is the dataset's own question
        assert rec["messages"][-1]["role"] == "assistant"
        answer = extract_answer(rec["messages"][-1]["content"] or "")
        assert dumped[rec["sample_id"]]["reward"] == pytest.approx(float(dataset.score_answer(answer, entry)))
