"""The advantage estimators and overlong shaping as the control loop runs them (fake engine, fake
trainer): what reaches the trainer is the reference's advantages of the step's samples."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from relax_agent.config import validate_config
from relax_agent.control import build_controller
from relax_agent.roles import Roles
from relax_agent.rollout.engines.fake import FakeEngine
from relax_agent.train import reference_algorithms as ref
from relax_agent.train.backends.fake import FakeTrainer
from tests.unit.test_dynamic_sampling import RewardRunner

B, G = 2, 4


class LengthRunner(RewardRunner):
    """Episodes whose reply length and stop reason depend on the sample's seed: every third sample
    is cut at ``max_new_tokens`` ("length"), the others stop after 2 to 4 tokens."""

    async def run(self, specs, params, on_done=None):
        out = []
        for traj, spec in zip(await super().run(specs, params, on_done), specs, strict=True):
            cut = spec.seed % 3 == 0
            n = params.max_new_tokens if cut else 2 + spec.seed % 3
            turn = dataclasses.replace(traj.turns[0], token_ids=(5,) * n, logprobs=(-1.0,) * n,
                                       finish_reason="length" if cut else "stop")
            out.append(dataclasses.replace(
                traj, token_ids=traj.token_ids[:3] + (5,) * n, loss_mask=(0,) * 3 + (1,) * n,
                rollout_logprobs=(0.0,) * 3 + (-1.0,) * n, turns=(turn,), stop_reason="length" if cut else "terminated"))
        return out


def reward(task_id: str, seed: int) -> float:
    return float((seed * 7 + int(task_id[1:])) % 3) / 2


def run_loop(tmp_path: Path, trainer_cfg: dict, overlong: dict | None = None, steps: int = 2):
    cfg = validate_config({
        "run": {"output_dir": str(tmp_path)},
        "rollout": {"tasks_per_step": B, "group_size": G, "max_new_tokens": 8, **({"overlong": overlong} if overlong else {})},
        "trainer": {"steps": steps, "backend": "fake", **trainer_cfg},
        "eval": {"at_start": False, "at_end": False}, "checkpoint": {"every_steps": 0},
        "logging": {"tensorboard": False, "plot": False}})
    engine = FakeEngine(lambda prompt, params: [5, 6, 2])
    tokenizer = SimpleNamespace(pad_token_id=0, decode=lambda ids: " ".join(map(str, ids)))
    trainer = FakeTrainer()
    roles = Roles(cfg, "cpu", tokenizer, engine, trainer, LengthRunner(engine, reward), [{"id": f"t{i}"} for i in range(6)], [])
    ctrl = build_controller(cfg, roles)
    try:
        ctrl.train()
    finally:
        ctrl.close()
    dumps = [[json.loads(line) for line in (tmp_path / "rollouts" / f"step_{k:06d}.jsonl").read_text().splitlines()]
             for k in range(1, steps + 1)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return trainer, dumps, [r for r in rows if "rollout/reward" in r]


def _expected(step_rows: list[dict], estimator: str, overlong: dict | None, max_new_tokens: int = 8):
    """The reference advantages of one step's dumped samples, in the dump's order."""
    rewards = [r["reward"] for r in step_rows]
    groups = [r["sample_id"].rsplit("/", 1)[0] for r in step_rows]
    counts = [len(r["response"][0].split()) for r in step_rows]  # the fake tokenizer decodes one word per token
    valid = [True] * len(step_rows)
    if overlong and overlong["mode"] == "soft":
        rewards = [rw + ref.overlong_penalty(n, max_new_tokens, overlong["buffer_tokens"]) for rw, n in zip(rewards, counts, strict=True)]
    if overlong and overlong["mode"] == "mask":
        valid = [n != max_new_tokens for n in counts]
    return ref.advantages(estimator, rewards, groups, valid, counts)


def _trained(trainer: FakeTrainer, step: int) -> list[float]:
    return trainer.batches[step].advantages.tolist()


@pytest.mark.parametrize("estimator,overlong", [
    ("reinforce_pp", None), ("reinforce_pp_baseline", {"mode": "soft", "buffer_tokens": 4}),
    ("rloo", {"mode": "mask"}), ("dr_grpo", {"mode": "soft", "buffer_tokens": 4}),
])
def test_the_trainer_gets_the_reference_advantages(tmp_path, estimator, overlong):
    trainer, dumps, rows = run_loop(tmp_path, {"advantage": estimator}, overlong)
    for step, samples in enumerate(dumps):
        expected = [a for a in _expected(samples, estimator, overlong) if a != 0.0]
        assert _trained(trainer, step) == pytest.approx(expected, abs=1e-6)
    if overlong and overlong["mode"] == "mask":
        assert all(r["overlong/masked"] > 0 for r in rows)
    if overlong and overlong["mode"] == "soft":
        assert all(-1.0 <= r["overlong/penalty_mean"] < 0 for r in rows)
    if estimator.startswith("reinforce_pp"):
        assert all(r["advantage/batch_std"] > 0 for r in rows)
