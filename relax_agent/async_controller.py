"""Async mode: rollout producers and the trainer run at the same time and meet in the TransferQueue.

Producers (asyncio tasks on one event loop) play GRPO groups with the
:class:`~relax_agent.rollout.runner.RolloutRunner` against the engine, which batches all
concurrent episodes in its own decode thread, and write each finished group's fields into
the TransferQueue partition ``rollouts``: token ids, loss mask, rollout log-probs, reward, the
:class:`~relax_agent.records.Trajectory` itself (an ``object`` field, for dumps and
metrics), and the group's policy version. The trainer takes whole groups as they complete
(one long-tail episode holds only its own group), computes each group's advantages, and once
it has ``rollout.tasks_per_step`` groups trains one step in its worker thread, publishes the
new weights through the weight sync (the engine applies them between decode batches) and
acks the groups.

Staleness control (``max_staleness = s``, ``B = rollout.tasks_per_step``):

- **Gate.** A group's *sample version* is the engine's policy version when the group starts.
  A new group starts only while ``started - dropped < (steps_done + s + 1) * B``: at most
  ``(s + 1) * B`` groups are live (running or queued), the queue never holds more than
  ``queue_capacity(B, s, G)`` rows, and a group started before step ``k`` completes is at
  most ``s`` versions behind when the trainer reaches it, unless it outlives ``s`` later
  steps of faster groups.
- **Drop.** Such a long-tail group is dropped (acked, counted in ``async/dropped_groups``)
  instead of trained, so no trained sample ever lags more than ``s`` versions:
  ``trainer_version - sample_version <= s`` holds for every row of ``rollouts/*.jsonl``.
- **s = 0** is exactly on-policy and reproduces colocate: the B groups of step ``k`` start
  only after step ``k - 1`` published its weights, with the same tasks, ids and seeds, and
  are trained in group order.

Ctrl-C (the run's :class:`~relax_agent.controller.StopRequest`) cancels the producers and
their episodes (envs closed), lets a trainer update in flight finish, and the controller saves.
Resume: weights, optimizer, step and policy version are restored exactly. The task sampler
is saved at the last step boundary, so with ``s = 0`` a resumed run draws the same tasks as
an uninterrupted one; with ``s > 0`` the up to ``s * B`` groups that were in flight at the
save are not replayed (no task is trained twice, a few are skipped), and generations are not
bit-identical (group timing decides what runs with what).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import numpy as np
import torch

from relax_agent import metrics as M
from relax_agent.controller import rollout_metrics
from relax_agent.errors import QueueTimeoutError
from relax_agent.records import Trajectory

if TYPE_CHECKING:
    from relax_agent.controller import Controller

PARTITION = "rollouts"
TRAINER_FIELDS = ("trajectory",)
"""What the trainer reads back: it collates from the Trajectory, which carries every other field."""
CONSUMER = "trainer"
_GET_POLL_S = 0.5
"""The trainer's blocking ``get`` returns at least this often, so a stop is never held up."""

STALENESS_MEAN = "async/staleness_mean"
STALENESS_MAX = "async/staleness_max"
STALENESS_HIST = "async/staleness"
DROPPED_GROUPS = "async/dropped_groups"
LIVE_GROUPS = "async/live_groups"

T = TypeVar("T")


class StalenessGate:
    """Admission control for new rollout groups (see the module docstring).

    Args:
        tasks_per_step: B, groups the trainer consumes per step.
        max_staleness: s >= 0.

    Counters: ``started`` groups, ``dropped`` (too stale, retired untrained), ``steps_done``.
    All methods run on the event loop's thread.
    """

    def __init__(self, tasks_per_step: int, max_staleness: int) -> None:
        self.tasks_per_step = tasks_per_step
        self.max_staleness = max_staleness
        self.started = 0
        self.dropped = 0
        self.steps_done = 0
        self._changed = asyncio.Event()

    def may_start(self) -> bool:
        """True while a new group fits: ``started - dropped < (steps_done + s + 1) * B``."""
        return self.started - self.dropped < (self.steps_done + self.max_staleness + 1) * self.tasks_per_step

    async def admit(self) -> None:
        """Wait until a new group may start, and count it as started."""
        while not self.may_start():
            self._changed.clear()
            await self._changed.wait()
        self.started += 1

    def step_done(self) -> None:
        self.steps_done += 1
        self._changed.set()

    def drop(self) -> None:
        self.dropped += 1
        self._changed.set()

    def too_stale(self, trainer_version: int, sample_version: int) -> bool:
        """True when training this sample now would exceed ``max_staleness``."""
        return trainer_version - sample_version > self.max_staleness


@dataclass
class _Group:
    """A finished group taken from the queue, with its advantages [G]."""

    seq: int
    version: int
    trajs: list[Trajectory]
    advantages: torch.Tensor
    lease_id: str


def group_fields(trajs: list[Trajectory]) -> dict[str, Any]:
    """The TransferQueue fields of one group's rows: token ids [T] int64, loss mask [T] int8,
    rollout log-probs [T] float32 (ragged), reward float32 scalar, the trajectory object."""
    return {
        "token_ids": [np.asarray(t.token_ids, dtype=np.int64) for t in trajs],
        "loss_mask": [np.asarray(t.loss_mask, dtype=np.int8) for t in trajs],
        "rollout_logprobs": [np.asarray(t.rollout_logprobs, dtype=np.float32) for t in trajs],
        "reward": np.asarray([t.reward for t in trajs], dtype=np.float32),
        "trajectory": list(trajs),
    }


def staleness_metrics(staleness: list[int], max_staleness: int) -> dict[str, float]:
    """Mean, max and a histogram (``async/staleness/<k>``: samples k versions behind, k = 0..s)."""
    counts = Counter(staleness)
    out = {STALENESS_MEAN: float(np.mean(staleness)) if staleness else 0.0,
           STALENESS_MAX: float(max(staleness, default=0))}
    out.update({f"{STALENESS_HIST}/{k}": float(counts.get(k, 0)) for k in range(max_staleness + 1)})
    return out


class AsyncLoop:
    """Runs ``controller``'s training in async mode until ``trainer.steps`` (see the module docstring).

    Args:
        ctrl: the controller; its step, policy version, sampler, logger and stop request are
            shared (the loop advances them; the controller saves and evaluates).
    """

    def __init__(self, ctrl: "Controller") -> None:
        from relax_agent.data import build_transfer_queue, queue_capacity
        from relax_agent.sampler import TaskSampler

        self.ctrl = ctrl
        cfg = ctrl.cfg
        self.B, self.G, self.s = cfg.rollout.tasks_per_step, cfg.rollout.group_size, cfg.max_staleness
        self.gate = StalenessGate(self.B, self.s)
        self.draws = TaskSampler(len(ctrl.roles.train_tasks), cfg.run.seed)
        self.draws.load_state_dict(ctrl.sampler.state_dict())
        self.next_seq = ctrl.groups_drawn
        self.capacity_rows = queue_capacity(self.B, self.s, self.G)
        self.tq = build_transfer_queue(cfg.data)
        self.tq.create_partition(PARTITION, self.capacity_rows, group_size=self.G, retire_after=[CONSUMER])
        self.trainer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self.dropped_this_step = 0
        self.dropped: list[_Group] = []
        """Groups dropped as too stale since the last step; dumped (untrained) with the next step."""
        self.seq_of: dict[str, int] = {}
        """group id -> group sequence number, for groups finished and not yet taken."""

    # -- entry --------------------------------------------------------------------------------
    def run(self) -> None:
        """Train until ``trainer.steps``; Ctrl-C raises KeyboardInterrupt after the in-flight update."""
        from relax_agent.weights import build_weight_sync

        sync = build_weight_sync(self.ctrl.cfg.weights, engines=[self.ctrl.roles.engine])
        self.ctrl.publish = sync.publish
        try:
            self.ctrl.stop.run(self._main)
        finally:
            self.ctrl.publish = self.ctrl.roles.engine.load_weights
            self.trainer_pool.shutdown(wait=True)
            sync.close()
            self.tq.close()

    async def _main(self) -> None:
        producers = asyncio.ensure_future(self._produce())
        try:
            await self._train()
        finally:
            producers.cancel()
            await asyncio.gather(producers, return_exceptions=True)

    # -- producers ------------------------------------------------------------------------------
    async def _produce(self) -> None:
        running: set[asyncio.Task] = set()
        try:
            while True:
                await self.gate.admit()
                seq, task = self.next_seq, self.ctrl.roles.train_tasks[self.draws.next(1)[0]]
                self.next_seq += 1
                version = self.ctrl.roles.engine.policy_version
                job = asyncio.ensure_future(self._play_group(seq, task, version))
                running.add(job)
                job.add_done_callback(running.discard)
        finally:
            for job in list(running):
                job.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _play_group(self, seq: int, task: dict[str, Any], version: int) -> None:
        """Play group ``seq`` (ids and seeds as colocate step ``seq // B``, group ``seq % B``)."""
        step, g = divmod(seq, self.B)
        seed = self.ctrl.cfg.run.seed + step * 10_007 + g * self.G
        runner = self.ctrl.roles.runner
        specs = [dataclasses.replace(s, group_id=f"s{step}/g{g}", sample_id=f"s{step}/g{g}/{i}")
                 for i, s in enumerate(runner.specs([task], self.G, prefix=f"s{step}", seed=seed))]
        trajs = await runner.run(specs, self.ctrl.params())
        self.seq_of[specs[0].group_id] = seq
        await asyncio.to_thread(self.tq.put, PARTITION, [t.sample_id for t in trajs], group_fields(trajs),
                                group_ids=[t.group_id for t in trajs], versions=[version] * len(trajs))

    # -- trainer --------------------------------------------------------------------------------
    async def _train(self) -> None:
        cfg = self.ctrl.cfg
        t_last = time.perf_counter()
        while self.ctrl.step < cfg.trainer.steps:
            groups, wait_s = await self._collect()
            t_last = await self._in_trainer(lambda: self._step(groups, wait_s, t_last))
            if self.ctrl._due(cfg.checkpoint.every_steps):
                await self._in_trainer(self.ctrl.save)
            if self.ctrl._due(cfg.eval.every_steps) and self.ctrl.step < cfg.trainer.steps:
                await self._in_trainer(lambda: self.ctrl.run_eval(run=lambda fn: asyncio.run(fn())))
            if self.ctrl.step < cfg.trainer.steps:
                self.gate.step_done()

    async def _collect(self) -> tuple[list[_Group], float]:
        """Take B groups as they complete; drop those that would exceed max_staleness."""
        groups: list[_Group] = []
        wait_s = 0.0
        self.dropped_this_step = 0
        while len(groups) < self.B:
            t0 = time.perf_counter()
            try:
                batch = await asyncio.to_thread(self.tq.get, PARTITION, list(TRAINER_FIELDS), CONSUMER, self.G,
                                                timeout_s=_GET_POLL_S, sampler="group")
            except QueueTimeoutError:
                continue
            finally:
                wait_s += time.perf_counter() - t0
            groups.append(self._take(batch))
            if self.gate.too_stale(self.ctrl.version, groups[-1].version):
                self.dropped.append(groups.pop())
                self.tq.ack(self.dropped[-1].lease_id)
                self.gate.drop()
                self.dropped_this_step += 1
        return groups, wait_s

    def _take(self, batch: Any) -> _Group:
        from relax_agent.train.batch import trajectory_advantages

        trajs = list(batch.fields["trajectory"])
        versions = {int(v) for v in batch.versions}
        assert len(versions) == 1, f"a group carries one sample version, got {versions}"
        adv = trajectory_advantages(trajs, std_normalize=self.ctrl.cfg.trainer.adv_std_normalize)
        return _Group(self.seq_of.pop(trajs[0].group_id), versions.pop(), trajs, adv, batch.lease_id)

    def _step(self, groups: list[_Group], wait_s: float, t_last: float) -> float:
        """Train on the step's groups (in group order), publish, ack, log (trainer thread).

        ``t_last``: when the previous step ended; returns when this one did."""
        groups.sort(key=lambda grp: grp.seq)
        trajs = [t for grp in groups for t in grp.trajs]
        sample_versions = [grp.version for grp in groups for _ in grp.trajs]
        trained_at = self.ctrl.version
        train_metrics, kept = self.ctrl._update(trajs, torch.cat([grp.advantages for grp in groups]))
        for grp in groups:
            self.tq.ack(grp.lease_id)
        self.ctrl.step += 1
        self.ctrl.groups_drawn = self.next_seq
        self.ctrl.sampler.load_state_dict(self.draws.state_dict())
        dropped, self.dropped = self.dropped, []
        self.ctrl._dump_rollouts(trajs + [t for grp in dropped for t in grp.trajs],
                                 sample_versions + [grp.version for grp in dropped for _ in grp.trajs], trained_at, kept,
                                 dropped={t.sample_id for grp in dropped for t in grp.trajs})
        t_end = time.perf_counter()
        step_s = t_end - t_last
        row = {**rollout_metrics(trajs, step_s), **train_metrics,
               **staleness_metrics([trained_at - v for v in sample_versions], self.s),
               M.DATA_WAIT: wait_s, M.SAMPLES_PER_S: len(trajs) / max(step_s, 1e-9), M.STEP_TIME: step_s,
               DROPPED_GROUPS: float(self.dropped_this_step), LIVE_GROUPS: float(self.gate.started - self.gate.dropped
                                                                                 - self.gate.steps_done * self.B),
               "policy_version": self.ctrl.version}
        self.ctrl.logger.log(self.ctrl.step, row)
        self.ctrl.logger.log_histogram(self.ctrl.step, STALENESS_HIST, [trained_at - v for v in sample_versions])
        self.ctrl._report("step", row)
        return t_end

    async def _in_trainer(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the trainer thread; when cancelled, let it finish before re-raising."""
        fut = self.trainer_pool.submit(fn)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            concurrent.futures.wait([fut])
            raise
