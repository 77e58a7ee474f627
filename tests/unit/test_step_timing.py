"""A step's rollout time is the span of its groups' play, not the whole step: tokens/s measures generation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from relax_agent.config import validate_config
from relax_agent.control import build_controller
from relax_agent.roles import Roles
from relax_agent.rollout.engines.fake import FakeEngine
from relax_agent.train.backends.fake import FakeTrainer
from tests.unit.test_dynamic_sampling import RewardRunner

TRAIN_S = 0.4


@pytest.mark.parametrize("mode", ["colocate", "async"])
def test_rollout_time_excludes_the_update_and_tokens_per_s_uses_it(tmp_path, mode):
    cfg = validate_config({
        "mode": mode, "max_staleness": 0, "run": {"output_dir": str(tmp_path)},
        "rollout": {"tasks_per_step": 2, "group_size": 3, "max_new_tokens": 4},
        "trainer": {"steps": 3, "backend": "fake"},
        "eval": {"at_start": False, "at_end": False}, "checkpoint": {"every_steps": 0},
        "logging": {"tensorboard": False, "plot": False}})
    engine = FakeEngine(lambda prompt, params: [5, 6, 2])
    tokenizer = SimpleNamespace(pad_token_id=0, decode=lambda ids: " ".join(map(str, ids)))
    runner = RewardRunner(engine, lambda task, seed: float(seed % 2))
    roles = Roles(cfg, "cpu", tokenizer, engine, FakeTrainer(train_s=TRAIN_S), runner,
                  [{"id": f"t{i}"} for i in range(4)], [])
    ctrl = build_controller(cfg, roles)
    try:
        ctrl.train()
    finally:
        ctrl.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:  # (the first step's span may include start-up)
        # s = 0: the next step's groups start only after the update, so the update is outside their span
        assert row["timing/rollout_s"] <= row["timing/step_s"] - 0.8 * TRAIN_S, row
        generated = row["rollout/response_tokens"] * row["rollout/episodes"]
        assert row["rollout/tokens_per_s"] == pytest.approx(generated / row["timing/rollout_s"])
