"""Dynamic sampling in the control loop (DAPO): uniform groups are filtered, replaced, counted, capped."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from relax_agent.config import validate_config
from relax_agent.control import build_controller
from relax_agent.control.schedule import DRAWN_GROUPS, DS_CAP_REACHED, FILTERED_GROUPS, STALENESS_MAX
from relax_agent.errors import ConfigError
from relax_agent.records import Trajectory, Turn
from relax_agent.roles import Roles
from relax_agent.rollout.engines.fake import FakeEngine
from relax_agent.rollout.runner import RolloutLimits, RolloutRunner
from relax_agent.sampler import TaskSampler
from relax_agent.train.backends.fake import FakeTrainer

PROMPT = [1, 3, 4]
B, G, NUM_TASKS = 2, 3, 10


class RewardRunner(RolloutRunner):
    """Episodes whose reward is ``reward(task_id, sample_seed)``, after a short seeded delay."""

    def __init__(self, engine, reward):
        self.engine, self.limits, self.reward_of, self.reward = engine, RolloutLimits(), reward, None

    async def run(self, specs, params, on_done=None):
        async def one(spec):
            await asyncio.sleep(float(np.random.default_rng(spec.seed).uniform(0.0005, 0.004)))
            gen = await self.engine.generate(PROMPT, params)
            n = len(gen.token_ids)
            return Trajectory(
                sample_id=spec.sample_id, group_id=spec.group_id, task_id=spec.task_id,
                token_ids=tuple(PROMPT) + gen.token_ids, loss_mask=(0,) * 3 + (1,) * n,
                rollout_logprobs=(0.0,) * 3 + gen.logprobs, prompt_len=3,
                turns=(Turn(3, gen.token_ids, gen.logprobs, gen.policy_version, gen.finish_reason),),
                reward=self.reward_of(spec.task_id, spec.seed))

        return list(await asyncio.gather(*(one(s) for s in specs)))


def uniform_on_even_tasks(task_id: str, seed: int) -> float:
    """Tasks t0, t2, ... give every sample 1.0 (no signal); odd tasks give 0 or 1 by sample."""
    if int(task_id[1:]) % 2 == 0:
        return 1.0
    return float(seed % 2)


def make_controller(tmp_path: Path, reward, steps: int = 4, mode: str = "colocate", s: int = 0,
                    enabled: bool = True, max_draws: int | None = None):
    cfg = validate_config({
        "mode": mode, "max_staleness": s, "run": {"output_dir": str(tmp_path)},
        "rollout": {"tasks_per_step": B, "group_size": G, "max_new_tokens": 4,
                    "dynamic_sampling": {"enabled": enabled, "max_draws_per_step": max_draws}},
        "trainer": {"steps": steps, "backend": "fake"},
        "eval": {"at_start": False, "at_end": False}, "checkpoint": {"every_steps": 0},
        "logging": {"tensorboard": False, "plot": False}})
    engine = FakeEngine(lambda prompt, params: [5, 6, 2])
    tokenizer = SimpleNamespace(pad_token_id=0, decode=lambda ids: " ".join(map(str, ids)))
    tasks = [{"id": f"t{i}"} for i in range(NUM_TASKS)]
    roles = Roles(cfg, "cpu", tokenizer, engine, FakeTrainer(), RewardRunner(engine, reward), tasks, [])
    return build_controller(cfg, roles)


def run(ctrl) -> dict:
    try:
        return ctrl.train()
    finally:
        ctrl.close()


def dumped(path: Path) -> list[dict]:
    rows = []
    for f in sorted((path / "rollouts").glob("step_*.jsonl")):
        rows += [{**json.loads(line), "step": int(f.stem[5:])} for line in f.read_text().splitlines()]
    return rows


def step_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def groups_of(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["sample_id"].rsplit("/", 1)[0], []).append(r)
    return out


def test_every_trained_group_has_signal_and_uniform_ones_are_filtered_and_replaced(tmp_path):
    ctrl = make_controller(tmp_path, uniform_on_even_tasks, steps=4, max_draws=30)
    run(ctrl)
    rows = dumped(tmp_path)
    groups = groups_of(rows)
    trained = {g: rs for g, rs in groups.items() if not rs[0]["filtered"]}
    filtered = {g: rs for g, rs in groups.items() if rs[0]["filtered"]}
    assert ctrl.step == 4 and len(trained) == 4 * B  # every step holds B groups, all informative
    assert all(len({r["reward"] for r in rs}) > 1 for rs in trained.values())
    assert all(int(rs[0]["task_id"][1:]) % 2 == 1 for rs in trained.values())
    # filtered groups: the uniform ones, recorded (nothing vanishes), never trained
    assert filtered and all(len({r["reward"] for r in rs}) == 1 for rs in filtered.values())
    assert all(not r["trained"] and int(r["task_id"][1:]) % 2 == 0 for rs in filtered.values() for r in rs)
    assert len(rows) == len({r["sample_id"] for r in rows})  # no sample twice
    # the trainer saw exactly the informative groups' rows, B * G per step
    assert [b.size for b in ctrl.runtime.trainer.trainer.batches] == [B * G] * 4
    # metrics count what was drawn and filtered, step by step
    metrics = step_rows(tmp_path)
    per_step = {k: sum(1 for rs in filtered.values() if rs[0]["step"] == k) for k in range(1, 5)}
    assert [m[FILTERED_GROUPS] for m in metrics] == [float(per_step[k]) for k in range(1, 5)]
    assert [m[DRAWN_GROUPS] for m in metrics] == [float(B + per_step[k]) for k in range(1, 5)]
    assert all(m[DS_CAP_REACHED] == 0.0 for m in metrics)
    # the rollout metrics describe every episode played, filtered ones included
    assert [m["rollout/episodes"] for m in metrics] == [float((B + per_step[k]) * G) for k in range(1, 5)]
    # draws follow the task order without a gap: the data position is the groups taken
    replay = TaskSampler(NUM_TASKS, 0)
    assert [r[0]["task_id"] for _, r in sorted(groups.items(), key=lambda kv: _seq(kv[0]))] == [
        f"t{i}" for i in replay.next(len(groups))]
    assert ctrl.groups_drawn == len(groups) and ctrl.sampler.state_dict() == replay.state_dict()


def _seq(group_id: str) -> int:
    step, g = group_id.split("/")
    return int(step[1:]) * B + int(g[1:])


def test_disabled_trains_uniform_groups_as_before(tmp_path):
    ctrl = make_controller(tmp_path, uniform_on_even_tasks, steps=3, enabled=False)
    run(ctrl)
    rows = dumped(tmp_path)
    assert len(rows) == 3 * B * G and not any(r["filtered"] for r in rows)
    assert FILTERED_GROUPS not in step_rows(tmp_path)[0]


def test_the_draw_cap_trains_what_it_has_and_says_so(tmp_path):
    ctrl = make_controller(tmp_path, lambda task_id, seed: 0.0, steps=2, max_draws=5)
    run(ctrl)
    metrics = step_rows(tmp_path)
    # every group is uniform: each step takes exactly the cap, filters cap - B, keeps B without signal
    assert [m[DRAWN_GROUPS] for m in metrics] == [5.0, 5.0]
    assert [m[FILTERED_GROUPS] for m in metrics] == [3.0, 3.0]
    assert [m[DS_CAP_REACHED] for m in metrics] == [1.0, 1.0]
    assert all(m["train/samples"] == 0.0 for m in metrics)
    assert ctrl.runtime.trainer.trainer.batches == [] and ctrl.version == 0
    rows = dumped(tmp_path)
    assert len(rows) == 2 * 5 * G and sum(r["filtered"] for r in rows) == 2 * 3 * G


def test_async_filters_and_still_holds_max_staleness(tmp_path):
    ctrl = make_controller(tmp_path, uniform_on_even_tasks, steps=5, mode="async", s=1, max_draws=30)
    run(ctrl)
    rows = dumped(tmp_path)
    trained = [r for r in rows if not r["filtered"] and not r["dropped_stale"]]
    assert ctrl.step == 5 and len(trained) == 5 * B * G
    assert all(0 <= r["trained_at_version"] - r["sample_version"] <= 1 for r in trained)
    assert max(m[STALENESS_MAX] for m in step_rows(tmp_path)) <= 1
    assert all(int(r["task_id"][1:]) % 2 == 1 for r in trained)
    assert len(rows) == len({r["sample_id"] for r in rows})


def test_resume_draws_what_the_uninterrupted_run_draws(tmp_path):
    whole = make_controller(tmp_path / "whole", uniform_on_even_tasks, steps=4, max_draws=30)
    run(whole)
    first = make_controller(tmp_path / "split", uniform_on_even_tasks, steps=2, max_draws=30)
    run(first)
    ckpt = first.ckpts.latest()
    second = make_controller(tmp_path / "split", uniform_on_even_tasks, steps=4, max_draws=30)
    second.restore(ckpt)
    run(second)
    key = lambda r: (r["step"], r["sample_id"], r["task_id"], r["reward"], r["trained"], r["filtered"])  # noqa: E731
    assert [key(r) for r in dumped(tmp_path / "split")] == [key(r) for r in dumped(tmp_path / "whole")]
    assert second.sampler.state_dict() == whole.sampler.state_dict()


def test_a_cap_below_tasks_per_step_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"max_draws_per_step=1.*tasks_per_step=2"):
        validate_config({"rollout": {"tasks_per_step": 2, "dynamic_sampling": {"max_draws_per_step": 1}}})
