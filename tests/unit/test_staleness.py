"""The async loop with fakes: staleness gate, recorded versions, stale-group drop, Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from relax_agent.async_controller import DROPPED_GROUPS, STALENESS_MAX, AsyncLoop, StalenessGate
from relax_agent.config import validate_config
from relax_agent.controller import Controller
from relax_agent.roles import Roles
from relax_agent.rollout.engines.fake import FakeEngine
from relax_agent.rollout.runner import RolloutLimits, RolloutRunner
from relax_agent.records import Trajectory, Turn
from relax_agent.sampler import TaskSampler

PROMPT = [1, 3, 4]


# -- the gate -----------------------------------------------------------------------------------


def test_gate_admits_s_plus_one_steps_of_groups():
    async def main():
        gate = StalenessGate(tasks_per_step=2, max_staleness=1)
        for _ in range(4):
            await asyncio.wait_for(gate.admit(), 1)
        waiter = asyncio.ensure_future(gate.admit())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # (s + 1) * B = 4 groups live
        gate.step_done()
        await asyncio.wait_for(waiter, 1)
        assert gate.started == 5
        gate.drop()  # a dropped group frees its place
        await asyncio.wait_for(gate.admit(), 1)
        assert gate.started == 6

    asyncio.run(main())


def test_gate_staleness_rule():
    gate = StalenessGate(tasks_per_step=4, max_staleness=2)
    assert not gate.too_stale(trainer_version=5, sample_version=3)
    assert gate.too_stale(trainer_version=6, sample_version=3)
    assert StalenessGate(4, 0).too_stale(1, 0)


# -- the loop with fakes --------------------------------------------------------------------------


class FakeRunner(RolloutRunner):
    """Episodes that wait (``delay_s(spec)``: seconds, or a condition), then generate once."""

    def __init__(self, engine, delay_s):
        self.engine, self.limits, self.delay_s = engine, RolloutLimits(), delay_s
        self.cancelled = self.in_flight = 0

    async def run(self, specs, params, on_done=None):
        async def one(spec):
            self.in_flight += 1
            try:
                delay = self.delay_s(spec)
                if callable(delay):  # a condition to wait for
                    while not delay():
                        await asyncio.sleep(0.002)
                else:
                    await asyncio.sleep(delay)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.in_flight -= 1
            gen = await self.engine.generate(PROMPT, params)
            n = len(gen.token_ids)
            reward = float(np.random.default_rng(spec.seed).integers(0, 3))
            return Trajectory(
                sample_id=spec.sample_id, group_id=spec.group_id, task_id=spec.task_id,
                token_ids=tuple(PROMPT) + gen.token_ids, loss_mask=(0,) * 3 + (1,) * n,
                rollout_logprobs=(0.0,) * 3 + gen.logprobs, prompt_len=3,
                turns=(Turn(3, gen.token_ids, gen.logprobs, gen.policy_version, gen.finish_reason),), reward=reward)

        return list(await asyncio.gather(*(one(s) for s in specs)))


class FakeTrainer:
    def __init__(self, train_s=0.0):
        self.batches, self.train_s = [], train_s

    def train_step(self, batch):
        time.sleep(self.train_s)
        self.batches.append(batch.size)
        return {"train/loss": 0.0}

    def policy_state_dict(self):
        return {"w": torch.full((4,), float(len(self.batches)))}


def make_controller(tmp_path: Path, s: int, delay_s, steps: int = 6, train_s: float = 0.0, mode: str = "async"):
    cfg = validate_config({
        "mode": mode, "max_staleness": s, "run": {"output_dir": str(tmp_path)},
        "rollout": {"tasks_per_step": 2, "group_size": 3, "max_new_tokens": 4},
        "trainer": {"steps": steps}, "logging": {"tensorboard": False},
        "eval": {"at_start": False, "at_end": False}, "checkpoint": {"every_steps": 0}})
    engine = FakeEngine(lambda prompt, params: [5, 6, 2])
    tokenizer = SimpleNamespace(pad_token_id=0, decode=lambda ids: " ".join(map(str, ids)))
    tasks = [{"id": f"t{i}"} for i in range(10)]
    roles = Roles(cfg, "cpu", None, tokenizer, engine, FakeTrainer(train_s), FakeRunner(engine, delay_s), tasks, [])
    return Controller(cfg, roles)


def dumped(tmp_path: Path) -> list[dict]:
    rows = []
    for f in sorted((tmp_path / "rollouts").glob("step_*.jsonl")):
        rows += [{**json.loads(line), "step": int(f.stem[5:])} for line in f.read_text().splitlines()]
    return rows


def metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def lognormal_delay(spec) -> float:
    return float(np.random.default_rng(spec.seed).lognormal(-5.0, 1.0))


@pytest.mark.parametrize("s", [0, 1, 2])
def test_no_trained_sample_exceeds_max_staleness(tmp_path, s):
    ctrl = make_controller(tmp_path, s, lognormal_delay, steps=6)
    AsyncLoop(ctrl).run()
    rows = [r for r in dumped(tmp_path) if not r["dropped_stale"]]
    assert ctrl.step == 6 and len(rows) == 6 * 2 * 3
    assert all(0 <= r["trained_at_version"] - r["sample_version"] <= s for r in rows)
    assert all(min(r["policy_versions"]) >= r["sample_version"] for r in rows)  # version = at group start
    assert max(m[STALENESS_MAX] for m in metrics(tmp_path)) <= s
    assert ctrl.roles.trainer.batches and ctrl.version == len(ctrl.roles.trainer.batches)
    assert len(ctrl.roles.engine.calls) >= len(rows)
    if s == 0:  # on-policy: step k trains exactly colocate's groups of step k, made by version k - 1
        assert all(r["sample_id"].startswith(f"s{r['step'] - 1}/") for r in rows)
        assert all(r["trained_at_version"] == r["sample_version"] for r in rows)
        replay = TaskSampler(10, 0)  # the saved data position is the uninterrupted run's: resume is exact
        replay.next(6 * 2)
        assert ctrl.groups_drawn == 6 * 2 and ctrl.sampler.state_dict() == replay.state_dict()


def test_async_s0_draws_the_same_tasks_and_versions_as_colocate(tmp_path):
    async_ctrl = make_controller(tmp_path / "a", 0, lognormal_delay, steps=3)
    AsyncLoop(async_ctrl).run()
    colo = make_controller(tmp_path / "c", 0, lognormal_delay, steps=3, mode="colocate")
    colo.roles.runner.engine = colo.roles.engine
    for _ in range(3):
        colo.train_step()
    key = lambda r: (r["sample_id"], r["task_id"], r["sample_version"], r["trained_at_version"])  # noqa: E731
    assert [key(r) for r in dumped(tmp_path / "a")] == [key(r) for r in dumped(tmp_path / "c")]
    assert async_ctrl.sampler.state_dict() == colo.sampler.state_dict()


def test_long_tail_group_is_dropped_not_trained_stale(tmp_path):
    def delay(spec):  # group s0/g0 (version 0) finishes only once the trainer is at version 3
        return (lambda: ctrl.version >= 3) if spec.group_id == "s0/g0" else 0.005

    ctrl = make_controller(tmp_path, 1, delay, steps=8)
    AsyncLoop(ctrl).run()
    rows = dumped(tmp_path)
    late = [r for r in rows if r["sample_id"].startswith("s0/g0/")]
    # recorded (nothing vanishes from the dumps), marked dropped, never trained
    assert len(late) == 3 and all(r["dropped_stale"] and not r["trained"] for r in late)
    assert all(r["trained_at_version"] - r["sample_version"] > 1 for r in late)
    assert not [r for r in rows if r["dropped_stale"] and not r["sample_id"].startswith("s0/g0/")]
    assert sum(m[DROPPED_GROUPS] for m in metrics(tmp_path)) == 1
    assert all(r["trained_at_version"] - r["sample_version"] <= 1 for r in rows if not r["dropped_stale"])


def test_stop_cancels_rollouts_and_finishes_the_update(tmp_path):
    ctrl = make_controller(tmp_path, 1, lambda spec: 0.05, steps=1000, train_s=0.02)
    loop = AsyncLoop(ctrl)

    def interrupt():
        while ctrl.step < 3 or not ctrl.roles.runner.in_flight:
            time.sleep(0.005)
        ctrl.stop._on_sigint()

    threading.Thread(target=interrupt, daemon=True).start()
    with ctrl.stop, pytest.raises(KeyboardInterrupt):
        loop.run()
    trainer = ctrl.roles.trainer
    assert ctrl.step >= 3 and ctrl.version == len(trainer.batches) == ctrl.step
    assert ctrl.roles.engine.loaded[-1][0] == ctrl.version
    # the sampler is saved as of the last step boundary, in step with the groups drawn by then
    assert ctrl.step * 2 <= ctrl.groups_drawn <= (ctrl.step + 2) * 2 and loop.next_seq >= ctrl.groups_drawn
    replay = TaskSampler(10, 0)
    replay.next(ctrl.groups_drawn)
    assert ctrl.sampler.state_dict() == replay.state_dict()
    assert ctrl.roles.runner.cancelled > 0  # episodes in flight were cancelled
    assert len(dumped(tmp_path)) == ctrl.step * 2 * 3
