"""`relax-agent train` on relax/LongRecall-v0 with contexts far smaller than its episodes (tiny random policy,
2 steps): with ``rollout.context.policy`` ``drop_oldest`` and ``compact`` episodes go on past a full context,
every context is trained and recorded (with the shared-prefix forward for drop_oldest), `relax-agent replay` finds no divergence (log-probs included, each
context against a fresh forward of the weights that sampled it), and the viewer lists an episode's contexts."""

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
CONFIG = "examples/long_recall.yaml"
MAX_TOTAL = 300


def overrides(tiny_model_dir: Path, out: Path, policy: str) -> list[str]:
    return [f"model.path={tiny_model_dir}", f"run.output_dir={out}", "env.kwargs.num_tasks=50",
            "env.kwargs.words_per_page=40", "rollout.tasks_per_step=1", "rollout.group_size=2",
            "rollout.max_new_tokens=8", f"rollout.max_total_tokens={MAX_TOTAL}", f"rollout.context.policy={policy}",
            "rollout.context.summary_max_tokens=8", "rollout.context.max_segments=8", "engine.max_batch_size=1",
            "run.num_threads=1", "trainer.steps=2", "trainer.micro_batch_size=4", "trainer.lr=1e-2",
            f"trainer.shared_prefix={str(policy == 'drop_oldest').lower()}",  # contexts share the opening
            "eval.at_start=false", "eval.at_end=false", "eval.after_warmup=false", "checkpoint.every_steps=1",
            "logging.tensorboard=false", "logging.plot=false", "logging.progress=false"]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "relax_agent.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module", params=["drop_oldest", "compact"])
def run(request, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "run"
    done = cli("train", CONFIG, *overrides(tiny_model_dir, out, request.param), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, out


def _records(out: Path, step: int) -> list[dict]:
    with gzip.open(out / "rollouts" / "tokens" / f"step_{step:06d}.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def test_episodes_go_on_past_a_full_context_and_every_context_trains(run, tiny_model_dir):
    policy, out = run
    contexts = [r for step in (1, 2) for r in _records(out, step) if r["stop_reason"] == "context"]
    dumped = [json.loads(line) for step in (1, 2)
              for line in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    episodes = [r for r in dumped if not r.get("context_of")]
    assert len(episodes) == 4
    if policy == "drop_oldest":  # 7 pages and turns outgrow 300 tokens
        assert contexts, "no episode went past its first context"
    else:  # a random policy's summary is usually cut at 8 tokens: the episode then ends, recorded
        assert contexts or any(r["stop_reason"] == "summary_failed" for r in episodes)
    for rec in _records(out, 1) + _records(out, 2):
        assert len(rec["token_ids"]) <= MAX_TOTAL
    assert all(r["stop_reason"] != "max_total_tokens" or policy == "compact" for r in episodes)
    ctx_rows = [r for r in dumped if r.get("context_of")]
    assert len(ctx_rows) == len(contexts) and all(r["trained"] == next(
        e["trained"] for e in episodes if e["sample_id"] == r["context_of"]) for r in ctx_rows)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"train/' in line]
    trained_contexts = sum(m.get("train/context_segments", 0.0) for m in metrics)
    assert trained_contexts == sum(r["trained"] for r in ctx_rows)


@pytest.mark.parametrize("step", [1, 2])
def test_every_context_replays_without_divergence(run, tiny_model_dir, step):
    policy, out = run
    n = len(_records(out, step))
    done = cli("replay", CONFIG, *overrides(tiny_model_dir, out, policy), "--step", str(step))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"step {step}: {n} of {n} episodes replay without divergence" in done.stdout


def test_the_viewer_lists_an_episodes_contexts(run):
    from relax_agent.viewer.data.reader import RunReader

    policy, out = run
    for step in (1, 2):
        rows = [json.loads(line) for line in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        ctx = [r for r in rows if r.get("context_of")]
        if not ctx:
            continue
        reader = RunReader(out)
        listed = [e["sample_id"] for g in reader.step(step)["groups"] for e in g["episodes"]]
        assert all("/ctx" not in sid for sid in listed) and len(listed) == 2  # contexts are shown with their episode
        ep = reader.episode(step, ctx[0]["context_of"])
        assert [c["sample_id"] for c in ep["contexts"]] == [
            *(r["sample_id"] for r in sorted(ctx, key=lambda r: r["segment"]) if r["context_of"] == ctx[0]["context_of"]),
            ctx[0]["context_of"]]
        assert [c["stop_reason"] for c in ep["contexts"]][:-1] == ["context"] * (len(ep["contexts"]) - 1)
        return
    assert policy == "compact", "drop_oldest recorded no context"
