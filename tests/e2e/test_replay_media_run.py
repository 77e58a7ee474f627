"""`relax-agent replay` on a real media run (VisualCount, tiny random Qwen2.5-VL, 2 steps): the loop's
token record keeps each image's placeholder tokens, position and digest, and the CLI replays both
steps without divergence, the images re-processed from the messages and fed to the log-probs."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CONFIG = "examples/visual_count.yaml"


def cli(*args):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "relax_agent.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from relax_agent.models import make_tiny_media_model

    model = make_tiny_media_model(tmp_path_factory.mktemp("tiny-vl"), kind="tiny-vl")
    out = tmp_path_factory.mktemp("replay_media") / "run"
    over = [f"model.path={model}", f"run.output_dir={out}", "rollout.tasks_per_step=1", "rollout.group_size=2",
            "trainer.micro_batch_size=2", "eval.at_start=false", "eval.at_end=false", "logging.plot=false",
            "logging.tensorboard=false"]
    done = cli("train", CONFIG, *over)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, over


def test_the_loop_records_each_image_where_it_sits(run):
    out, _ = run
    with gzip.open(out / "rollouts" / "tokens" / "step_000001.jsonl.gz", "rt") as f:
        recs = [json.loads(line) for line in f]
    assert len(recs) == 2
    for rec in recs:
        m = rec["media"]
        assert m["kinds"][0] == "image" and len(m["digests"]) == len(m["kinds"]) == len(m["starts"])
        assert all(rec["token_ids"][s] == rec["token_ids"][s + n - 1] for s, n in zip(m["starts"], m["num_tokens"], strict=True))


@pytest.mark.parametrize("step", [1, 2])
def test_a_clean_media_run_replays_without_divergence(run, step):
    out, over = run
    done = cli("replay", CONFIG, *over, "--step", str(step))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"step {step}: 2 of 2 episodes replay without divergence" in done.stdout
    assert "skipped" not in done.stdout  # media, deltas and log-probs all checked
