"""`relax-agent train` on Guess the Number through the GEM and TextArena bridge schemes, with a tiny random
policy: two GRPO steps (GEM's after a one-update warm-up on the env's multi-turn demonstrations), and every
recorded reward equals what the foreign package gives when its own env replays the recorded replies."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SMALL = ["rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=12", "rollout.max_total_tokens=1024",
         "trainer.steps=2", "trainer.micro_batch_size=4", "eval.at_start=false", "eval.at_end=false",
         "eval.after_warmup=false", "checkpoint.every_steps=0", "logging.progress=false", "logging.tensorboard=false",
         "run.num_threads=1", "env.kwargs.num_tasks=50", "env.kwargs.num_heldout=10"]


def _train(tiny_model_dir: Path, out: Path, *extra: str) -> tuple[list[dict], dict[str, dict]]:
    """Run 2 steps; returns step 2's token records and its dumped rows by sample id."""
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/guess_the_number.yaml", f"model.path={tiny_model_dir}",
           f"run.output_dir={out}", *SMALL, *extra, "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if "rollout/reward" in line]
    assert steps == [1, 2]
    with gzip.open(out / "rollouts" / "tokens" / "step_000002.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    dumped = {r["sample_id"]: r for r in map(json.loads, (out / "rollouts" / "step_000002.jsonl").read_text().splitlines())}
    assert len(records) == len(dumped) == 4
    return records, dumped


def _moves(record: dict) -> tuple[list[str], list[str]]:
    """(the move each assistant turn handed the env, the user messages after the prompt), from the token record:
    the recorded turn is the decoded reply; the env got its content as the run's parser (hermes_strict) left it."""
    from relax_agent.rollout.parsers import build_parser

    parser = build_parser("hermes_strict")
    messages = [m for m in record["messages"] if m["role"] != "system"]
    assert messages[0]["role"] == "user"
    moves = [parser.parse(m["content"] or "").content for m in messages if m["role"] == "assistant"]
    observations = [m["content"] for m in messages[1:] if m["role"] == "user"]
    return moves, observations


def test_train_on_gem_guess_the_number_rewards_are_gems(tiny_model_dir, tmp_path):
    import gem

    from relax_agent.envs.bridges.gem import GEMEnv

    records, dumped = _train(tiny_model_dir, tmp_path, "env.max_turns=3", "trainer.sft_warmup_steps=1",
                             "trainer.sft_batch_size=2")
    sft = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert [r["sft/step"] for r in sft] == [1] and sft[0]["sft/loss"] > 0  # trained on the binary-search demonstrations
    game = yaml.safe_load((REPO / "examples" / "guess_the_number.yaml").read_text())["env"]["id"].removeprefix("gem:")
    assert game.startswith("game:GuessTheNumber-v0")
    seeds = {t["id"]: t["seed"] for t in GEMEnv(game, num_tasks=50, num_heldout=10).tasks("train")}
    for rec in records:
        row = dumped[rec["sample_id"]]
        assert row["error"] is None and row["reward_status"] == "ok", row
        assert row["stop_reason"] in ("terminated", "truncated", "max_turns", "length"), row  # length: a cut reply, still played
        moves, observations = _moves(rec)
        env = gem.make(game)
        obs, info = env.reset(seed=seeds[row["task_id"]])
        total, said = 0.0, []
        for move in moves:
            obs, reward, terminated, truncated, info = env.step(move)
            total += reward
            said.append(obs)
            if terminated or truncated:
                break
        assert len(said) == len(moves) <= 3
        assert row["reward"] == pytest.approx(total)
        assert all(o.startswith(s) for o, s in zip(observations, said, strict=False))


def test_train_on_textarena_guess_the_number_rewards_are_textarenas(tiny_model_dir, tmp_path):
    import textarena as ta

    records, dumped = _train(tiny_model_dir, tmp_path, "env.id=textarena:GuessTheNumber-v0", "env.max_turns=3",
                             "trainer.sft_warmup_steps=0")
    for rec in records:
        row = dumped[rec["sample_id"]]
        assert row["error"] is None and row["reward_status"] == "ok", row
        seed = int(row["task_id"].rsplit("-s", 1)[1])
        assert row["task_id"] == f"textarena-GuessTheNumber-v0-s{seed}" and seed < 50
        moves, _ = _moves(rec)
        env = ta.make("GuessTheNumber-v0")
        env.reset(num_players=1, seed=seed)
        reward = 0.0
        for move in moves:
            done, _ = env.step(move)
            if done:
                rewards, _ = env.close()
                reward = float(rewards[0])
                break
        assert len(moves) <= 3
        assert row["reward"] == pytest.approx(reward)
