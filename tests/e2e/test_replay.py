"""`relax-agent replay` on a real multi-turn run (BFCL multi-turn, tiny random policy, 2 steps): a clean
run replays without divergence, and each seeded fault is found at its turn and token."""

import copy
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_agent.config import load_config
from relax_agent.models import load_policy, load_tokenizer
from relax_agent.replay import (
    DELTA,
    LOGPROBS,
    LOSS_MASK,
    TURN_TOKENS,
    checkpoint_versions,
    load_token_record,
    replay_records,
)
from relax_agent.rollout.chat import ChatRenderer

pytestmark = pytest.mark.slow
pytest.importorskip("bfcl_eval")

REPO = Path(__file__).resolve().parents[2]
CONFIG = "examples/bfcl_multi_turn.yaml"


def overrides(tiny_model_dir, out):
    return [f"model.path={tiny_model_dir}", f"run.output_dir={out}", "env.kwargs.classes=[TradingBot]",
            "env.kwargs.max_steps_per_turn=1", "env.max_turns=3", "rollout.tasks_per_step=1", "rollout.group_size=2",
            "rollout.max_new_tokens=8", "rollout.max_total_tokens=2560", "engine.max_batch_size=1",
            "run.num_threads=1", "trainer.steps=2", "trainer.micro_batch_size=1", "trainer.lr=1e-2",
            "eval.at_start=false", "eval.at_end=false", "checkpoint.every_steps=1",
            "logging.tensorboard=false", "logging.plot=false"]


def cli(*args):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "relax_agent.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("replay") / "run"
    done = cli("train", CONFIG, *overrides(tiny_model_dir, out), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    return out, load_config(REPO / CONFIG, overrides(tiny_model_dir, out))


@pytest.fixture(scope="module")
def renderer(run):
    _, cfg = run
    r = cfg.rollout
    return ChatRenderer(load_tokenizer(cfg.model), r.tools_in, r.system_prompt, r.tool_example)


def multi_turn(records):
    rec = next((r for r in records if len(r["turns"]) >= 2), None)
    assert rec is not None, "the run played no multi-turn episode"
    return copy.deepcopy(rec)


@pytest.mark.parametrize("step", [1, 2])
def test_a_clean_run_replays_without_divergence(run, tiny_model_dir, step):
    out, _ = run
    done = cli("replay", CONFIG, *overrides(tiny_model_dir, out), "--step", str(step))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"step {step}: 2 of 2 episodes replay without divergence" in done.stdout
    assert "skipped" not in done.stdout  # every check ran, log-probs included


def test_a_re_rendered_observation_is_found_at_its_turn_and_token(run, renderer):
    out, _ = run
    rec = multi_turn(load_token_record(out, 1))
    t1, t2 = rec["turns"][0], rec["turns"][1]
    at = t1["start"] + len(t1["token_ids"]) + 2  # the third token of the first observation delta
    assert at < t2["start"]
    rec["token_ids"][at] = (rec["token_ids"][at] + 1) % 1000
    (rep,) = replay_records([rec], renderer, None, 1.0, 2e-3)
    d = rep.divergence
    assert (d.check, d.turn, d.token, d.recorded) == (DELTA, 1, at, rec["token_ids"][at])


def test_a_shifted_mask_and_a_moved_turn_are_found(run, renderer):
    out, _ = run
    rec = multi_turn(load_token_record(out, 1))
    start = rec["turns"][1]["start"]
    shifted = copy.deepcopy(rec)
    shifted["loss_mask"][start - 1], shifted["loss_mask"][start] = 1, 0  # the mask one token early
    (rep,) = replay_records([shifted], renderer, None, 1.0, 2e-3)
    assert (rep.divergence.check, rep.divergence.turn, rep.divergence.token) == (LOSS_MASK, 1, start - 1)
    moved = copy.deepcopy(rec)
    moved["turns"][1]["start"] = start + 1
    (rep,) = replay_records([moved], renderer, None, 1.0, 2e-3)
    assert (rep.divergence.check, rep.divergence.turn) == (TURN_TOKENS, 2)


def test_a_log_prob_of_other_weights_is_found_and_missing_weights_are_said(run, renderer):
    import torch

    out, cfg = run
    records = load_token_record(out, 2)
    version = records[0]["sample_version"]  # (random rewards rarely vary here: the policy may not have moved)
    right = load_policy(cfg.model)[0] if version == 0 else load_policy(
        cfg.model.model_copy(update={"path": str(checkpoint_versions(out)[version])}))[0]
    other = copy.deepcopy(right)
    with torch.no_grad():
        other.lm_head.weight.add_(0.05 * torch.randn_like(other.lm_head.weight))
    clean = replay_records(records, renderer, {version: right}.get, cfg.rollout.temperature, 2e-3)
    assert all(r.divergence is None for r in clean)
    rec = multi_turn(records)
    k = rec["turns"][1]["start"] + 1  # the second token of turn 2
    rec["rollout_logprobs"][k] -= 0.5
    rec["turns"][1]["logprobs"][1] -= 0.5
    (rep,) = replay_records([rec], renderer, {version: right}.get, cfg.rollout.temperature, 2e-3)
    assert (rep.divergence.check, rep.divergence.turn, rep.divergence.token) == (LOGPROBS, 2, k)
    reports = replay_records(records, renderer, {version: other}.get, cfg.rollout.temperature, 2e-3)
    assert all(r.divergence is not None and r.divergence.check == LOGPROBS for r in reports)
    first = reports[0].divergence
    assert records[0]["loss_mask"][first.token] == 1 and first.token == records[0]["turns"][0]["start"]
    reports = replay_records(records, renderer, {}.get, cfg.rollout.temperature, 2e-3)
    assert all(r.divergence is None and "no weights of version" in r.skipped[LOGPROBS] for r in reports)


def test_the_record_is_what_the_trainer_saw(run):
    out, _ = run
    rows = [json.loads(line) for line in (out / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    with gzip.open(out / "rollouts" / "tokens" / "step_000001.jsonl.gz", "rt") as f:
        recs = [json.loads(line) for line in f]
    assert [r["sample_id"] for r in recs] == [r["sample_id"] for r in rows]
    for rec in recs:
        assert len(rec["token_ids"]) == len(rec["loss_mask"]) == len(rec["rollout_logprobs"])
        assert sum(rec["loss_mask"]) == sum(len(t["token_ids"]) for t in rec["turns"])
