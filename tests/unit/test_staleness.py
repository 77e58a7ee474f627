"""The control loop with fakes: staleness gate, recorded versions, stale-group drop, Ctrl-C."""

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

from relax_agent import metrics as M
from relax_agent.config import validate_config
from relax_agent.control import build_controller
from relax_agent.control.schedule import DROPPED_GROUPS, STALENESS_MAX, StalenessGate
from relax_agent.records import Trajectory, Turn
from relax_agent.roles import Roles
from relax_agent.rollout.engines.fake import FakeEngine
from relax_agent.rollout.runner import RolloutLimits, RolloutRunner
from relax_agent.sampler import TaskSampler
from relax_agent.train.backends.fake import FakeTrainer

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


def test_gate_starts_no_group_beyond_what_the_remaining_steps_train():
    gate = StalenessGate(tasks_per_step=2, max_staleness=2, max_groups=3)
    assert gate.may_start()
    gate.started = 3
    assert not gate.may_start()  # the staleness bound (s + 1) * B = 6 would allow more
    gate.drop()  # a dropped group is replaced
    assert gate.may_start()


def test_an_async_run_plays_only_the_groups_its_steps_train(tmp_path):
    ctrl = make_controller(tmp_path, 2, lambda spec: 0.001, steps=3)
    run(ctrl)
    rows = dumped(tmp_path)
    assert not any(r["dropped_stale"] for r in rows)
    # B = 2 groups per step for 3 steps; the gate alone would also have started the next 2 x 2
    assert ctrl.runtime.rollout.runner.groups == {f"s{k}/g{g}" for k in range(3) for g in range(2)}


def test_gate_staleness_rule():
    gate = StalenessGate(tasks_per_step=4, max_staleness=2)
    assert not gate.too_stale(trainer_version=5, sample_version=3)
    assert gate.too_stale(trainer_version=6, sample_version=3)
    assert StalenessGate(4, 0).too_stale(1, 0)


# -- the loop with fakes --------------------------------------------------------------------------


class FakeRunner(RolloutRunner):
    """Episodes that wait (``delay_s(spec)``: seconds, or a condition), then generate once."""

    def __init__(self, engine, delay_s):
        self.engine, self.limits, self.delay_s, self.reward = engine, RolloutLimits(), delay_s, None
        self.cancelled = self.in_flight = 0
        self.groups: set[str] = set()

    async def run(self, specs, params, on_done=None):
        self.groups.update(spec.group_id for spec in specs)

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


def make_controller(tmp_path: Path, s: int, delay_s, steps: int = 6, train_s: float = 0.0, mode: str = "async"):
    cfg = validate_config({
        "mode": mode, "max_staleness": s, "run": {"output_dir": str(tmp_path)},
        "rollout": {"tasks_per_step": 2, "group_size": 3, "max_new_tokens": 4},
        "trainer": {"steps": steps, "backend": "fake"},
        "eval": {"at_start": False, "at_end": False}, "checkpoint": {"every_steps": 0}, "logging": {
            "tensorboard": False, "plot": False}})
    engine = FakeEngine(lambda prompt, params: [5, 6, 2])
    tokenizer = SimpleNamespace(pad_token_id=0, decode=lambda ids: " ".join(map(str, ids)))
    tasks = [{"id": f"t{i}"} for i in range(10)]
    roles = Roles(cfg, "cpu", tokenizer, engine, FakeTrainer(train_s), FakeRunner(engine, delay_s), tasks, [])
    return build_controller(cfg, roles)


def run(ctrl) -> dict:
    try:
        return ctrl.train()
    finally:
        ctrl.close()


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
    run(ctrl)
    rows = [r for r in dumped(tmp_path) if not r["dropped_stale"]]
    assert ctrl.step == 6 and len(rows) == 6 * 2 * 3
    assert all(0 <= r["trained_at_version"] - r["sample_version"] <= s for r in rows)
    assert all(min(r["policy_versions"]) >= r["sample_version"] for r in rows)  # version = at group start
    assert max(m[STALENESS_MAX] for m in metrics(tmp_path)) <= s
    assert ctrl.runtime.trainer.trainer.batches and ctrl.version == len(ctrl.runtime.trainer.trainer.batches)
    assert len(ctrl.runtime.rollout.runner.engine.calls) >= len(rows)
    if s == 0:  # on-policy: step k trains exactly colocate's groups of step k, made by version k - 1
        assert all(r["sample_id"].startswith(f"s{r['step'] - 1}/") for r in rows)
        assert all(r["trained_at_version"] == r["sample_version"] for r in rows)
        replay = TaskSampler(10, 0)  # the saved data position is the uninterrupted run's: resume is exact
        replay.next(6 * 2)
        assert ctrl.groups_drawn == 6 * 2 and ctrl.sampler.state_dict() == replay.state_dict()


def test_async_s0_draws_the_same_tasks_and_versions_as_colocate(tmp_path):
    async_ctrl = make_controller(tmp_path / "a", 0, lognormal_delay, steps=3)
    run(async_ctrl)
    colo = make_controller(tmp_path / "c", 0, lognormal_delay, steps=3, mode="colocate")
    run(colo)
    key = lambda r: (r["sample_id"], r["task_id"], r["sample_version"], r["trained_at_version"], r["reward"])  # noqa: E731
    assert [key(r) for r in dumped(tmp_path / "a")] == [key(r) for r in dumped(tmp_path / "c")]
    assert async_ctrl.sampler.state_dict() == colo.sampler.state_dict()
    a, c = async_ctrl.runtime.trainer.trainer.batches, colo.runtime.trainer.trainer.batches
    assert len(a) == len(c) == 3
    assert all(torch.equal(x.advantages, y.advantages) and torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, c, strict=True))


def test_long_tail_group_is_dropped_not_trained_stale(tmp_path):
    def delay(spec):  # group s0/g0 (version 0) finishes only once the trainer is at version 3
        return (lambda: ctrl.version >= 3) if spec.group_id == "s0/g0" else 0.005

    ctrl = make_controller(tmp_path, 1, delay, steps=8)
    run(ctrl)
    rows = dumped(tmp_path)
    late = [r for r in rows if r["sample_id"].startswith("s0/g0/")]
    # recorded (nothing vanishes from the dumps), marked dropped, never trained
    assert len(late) == 3 and all(r["dropped_stale"] and not r["trained"] for r in late)
    assert all(r["trained_at_version"] - r["sample_version"] > 1 for r in late)
    assert not [r for r in rows if r["dropped_stale"] and not r["sample_id"].startswith("s0/g0/")]
    assert sum(m[DROPPED_GROUPS] for m in metrics(tmp_path)) == 1
    assert all(r["trained_at_version"] - r["sample_version"] <= 1 for r in rows if not r["dropped_stale"])


def test_stop_cancels_rollouts_and_finishes_the_update(tmp_path):
    def delay(spec):  # groups of step 4 on never finish by themselves: they are in flight at the stop
        return (lambda: False) if int(spec.group_id.split("/")[0][1:]) >= 4 else 0.005

    ctrl = make_controller(tmp_path, 1, delay, steps=1000, train_s=0.02)
    runner = ctrl.runtime.rollout.runner

    def interrupt():
        while ctrl.step < 3 or not runner.in_flight:
            time.sleep(0.005)
        ctrl.stop._on_sigint()

    threading.Thread(target=interrupt, daemon=True).start()
    summary = run(ctrl)
    trainer = ctrl.runtime.trainer.trainer
    assert summary["interrupted"] and ctrl.step >= 3 and ctrl.version == len(trainer.batches) == ctrl.step
    assert runner.engine.loaded[-1][0] == ctrl.version
    # the sampler is saved as of the last step boundary, in step with the groups drawn by then
    assert ctrl.step * 2 <= ctrl.groups_drawn <= (ctrl.step + 2) * 2
    replay = TaskSampler(10, 0)
    replay.next(ctrl.groups_drawn)
    assert ctrl.sampler.state_dict() == replay.state_dict()
    assert runner.cancelled > 0  # episodes in flight were cancelled
    assert len(dumped(tmp_path)) == ctrl.step * 2 * 3


def test_a_group_waiting_past_the_lease_timeout_is_trained_once_and_never_crashes(tmp_path):
    """The trainer holds s0/g0's lease while s0/g1's slow tool runs past data.lease_timeout_s:
    the re-delivered lease replaces the held one, later re-deliveries are acked and skipped."""
    def delay(spec):
        return 1.0 if spec.group_id == "s0/g1" else 0.001

    ctrl = make_controller(tmp_path, 0, delay, steps=3, train_s=0.5)
    ctrl.cfg.data.lease_timeout_s = 0.2
    ctrl.bus.close()
    from relax_agent.data import build_transfer_queue

    ctrl.bus = ctrl.runtime.rollout.bus = ctrl.runtime.trainer.bus = build_transfer_queue(ctrl.cfg.data)
    ctrl.runtime.closers[-1] = ctrl.bus.close
    run(ctrl)
    rows = dumped(tmp_path)
    assert ctrl.step == 3 and len(rows) == 3 * 2 * 3
    assert sorted(r["sample_id"] for r in rows) == sorted({r["sample_id"] for r in rows})  # none twice
    assert [b.size for b in ctrl.runtime.trainer.trainer.batches] == [6, 6, 6] or all(
        b.size <= 6 for b in ctrl.runtime.trainer.trainer.batches)


def test_a_run_on_the_fake_engine_and_fake_trainer_loads_no_model(tmp_path, tiny_model_dir, monkeypatch):
    import relax_agent.models
    from relax_agent.config import load_config
    from relax_agent.roles import build_roles

    def no_model(*args, **kwargs):
        raise AssertionError("the fake engine and trainer need no model")

    monkeypatch.setattr(relax_agent.models, "load_policy", no_model)
    cfg = load_config("examples/tiny.yaml", [
        f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0", "engine.kind=fake",
        "trainer.backend=fake", "trainer.steps=2", "eval.at_start=false", "eval.at_end=false",
        "logging.tensorboard=false", "logging.plot=false", f"run.output_dir={tmp_path}"])
    ctrl = build_controller(cfg, build_roles(cfg))
    summary = run(ctrl)
    assert ctrl.step == 2 and summary["last"]["policy_version"] == ctrl.version
    assert ctrl.version == len(ctrl.runtime.trainer.trainer.batches)
    assert (Path(summary["checkpoint"]) / "model" / "fake_model.json").exists()
    assert len(dumped(tmp_path)) == 2 * 2 * 4


@pytest.mark.parametrize("mode", ["colocate", "async"])
def test_non_finite_weights_stop_the_run_and_are_neither_published_nor_saved(tmp_path, mode):
    from relax_agent.errors import WeightSyncError

    class Diverging(FakeTrainer):
        def policy_state_dict(self):
            return {"w": torch.full((4,), float("nan") if self.step >= 2 else float(self.step))}

    ctrl = make_controller(tmp_path, 0, lambda spec: 0.001, steps=5, mode=mode)
    ctrl.cfg.checkpoint.every_steps = 1
    ctrl.runtime.trainer.trainer = Diverging()
    with pytest.raises(WeightSyncError, match="(?i)nan|finite"):
        run(ctrl)
    engine = ctrl.runtime.rollout.runner.engine
    assert ctrl.step == 1 and engine.policy_version == 1  # the engines keep the last good version
    assert all(torch.isfinite(sd["w"]).all() for _, sd in engine.loaded)
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step_000001"]  # no checkpoint of the diverged weights


def test_each_step_row_carries_the_rollout_engines_own_metrics(tmp_path):
    ctrl = make_controller(tmp_path, 0, lambda spec: 0.0, steps=3, mode="colocate")
    engine = ctrl.runtime.rollout.runner.engine
    calls = []
    engine.metrics = lambda: calls.append(1) or {M.PREFIX_CACHE_HIT_RATE: 0.25 * len(calls)}  # since the last call
    run(ctrl)
    assert [m[M.PREFIX_CACHE_HIT_RATE] for m in metrics(tmp_path)] == [0.25, 0.5, 0.75]
    assert all(m[M.CROSSED_UPDATE_TURNS] == 0.0 for m in metrics(tmp_path))


def test_rows_a_trainer_may_replay_wait_on_the_bus_until_a_checkpoint_covers_them(tmp_path):
    """A trainer service that replays updates after a restart (as under ``runtime: ray``) says which
    versions a checkpoint covers; the loop keeps the rows of later updates on the bus, releases the
    covered ones after each save (every 2 steps), and names the rows to the trainer service, which
    reads the token arrays from the bus itself."""
    from relax_agent import records as R

    ctrl = make_controller(tmp_path, 1, lognormal_delay, steps=5)
    ctrl.cfg.checkpoint.every_steps = 2
    service, bus = ctrl.runtime.trainer, ctrl.bus
    refs, released, saved = [], [], {"version": 0}
    leases = {}

    class Recorder:
        def get(self, partition, fields, consumer, batch_size, **kw):
            batch = bus.get(partition, fields, consumer, batch_size, **kw)
            leases[batch.lease_id] = (consumer, list(batch.sample_ids), list(fields))
            return batch

        def ack(self, lease_id):
            consumer, ids, fields = leases[lease_id]
            if consumer == "checkpoint":
                released.append((saved["version"], ids))
            if consumer == "trainer":
                assert R.TOKEN_IDS not in fields  # the loop reads scalars and the trajectory only
            return bus.ack(lease_id)

        def __getattr__(self, name):
            return getattr(bus, name)

    real_train, real_save = service.train, service.save_model

    def train(ref):
        refs.append(ref)
        return real_train(ref)

    def save_model(path):
        saved["version"] = ctrl.version
        real_save(path)

    ctrl.bus = Recorder()
    service.train, service.save_model = train, save_model
    service.rows_needed_after = lambda: saved["version"]
    run(ctrl)
    assert [r.version for r in refs] == [1, 2, 3, 4, 5] and all(r.fields == R.TRAIN_FIELDS for r in refs)
    trained_into = {sid: r.version for r in refs for sid in r.sample_ids}
    when = {sid: covered for covered, ids in released for sid in ids}
    for sid, version in trained_into.items():
        if version <= 4:  # the checkpoints after steps 2 and 4 cover it: released after them, not before
            assert when[sid] >= version and when[sid] in (2, 4), (sid, version, when.get(sid))
        else:
            assert sid not in when  # version 5: no checkpoint covers it before the run ends
    trained_groups = {sid.rsplit("/", 1)[0] for sid in trained_into}
    idle = {r["sample_id"] for r in dumped(tmp_path) if r["sample_id"].rsplit("/", 1)[0] not in trained_groups}
    assert idle and idle <= set(when)  # groups that trained nothing (dropped, uniform) are released at once
