"""One pass of the pipeline: the producers that draw tasks and play groups, the advantage consumer,
and the trainer side that collects a step's groups off the bus, trains, publishes, acks and logs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import math
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from relax_agent import metrics as M
from relax_agent import records as R
from relax_agent.control.advantages import AdvantageConsumer, overlong_field_metrics
from relax_agent.control.groups import Group, batch_normalized, episode_fields, informative, nothing_sampled
from relax_agent.control.reporting import episode_metrics, write_rollout_dump, write_token_record
from relax_agent.control.schedule import (
    DRAWN_GROUPS,
    DROPPED_GROUPS,
    DS_CAP_REACHED,
    FILTERED_GROUPS,
    LIVE_GROUPS,
    STALENESS_HIST,
    StalenessGate,
    staleness_metrics,
)
from relax_agent.errors import LeaseError, QueueTimeoutError, RolloutError
from relax_agent.records import Trajectory
from relax_agent.runtime.base import PARTITION, GroupJob, TrainRef
from relax_agent.sampler import TaskSampler
from relax_agent.train.algorithms import BATCH_NORMALIZED

if TYPE_CHECKING:
    from relax_agent.control.loop import Controller

TRAINER = "trainer"
KEEPER = "checkpoint"
"""The bus consumer whose ack retires trained rows once a checkpoint covers their update (only
when the trainer service may read them again, see :meth:`TrainerService.rows_needed_after`)."""
_POLL_S = 0.5
"""Blocking bus reads return at least this often, so a stop is never held up."""
SEED_STRIDE = 10_007
"""Step ``k``'s groups are seeded from ``run.seed + k * SEED_STRIDE``."""

T = TypeVar("T")


def _mark_played(span: list[float], _fut: Any) -> None:
    """Done-callback of a group's rollout: its ``[start, end]`` span gets its end."""
    span[1] = time.perf_counter()


class Run:
    """One pass of the pipeline: the coroutines and the trainer thread of :meth:`Controller.train`."""

    _kind_of_token: dict[int, str] | None  # read on first use by _placeholder_ids

    def __init__(self, ctrl: Controller) -> None:
        cfg = ctrl.cfg
        self.ctrl = ctrl
        self.gate = StalenessGate(ctrl.B, ctrl.s, max_groups=(cfg.trainer.steps - ctrl.step) * ctrl.B)
        self.draws = TaskSampler(len(ctrl.pools.rl), cfg.run.seed)
        self.draws.load_state_dict(ctrl.sampler.state_dict())
        self.next_seq = ctrl.groups_drawn
        self.seq_of: dict[str, int] = {}
        """group id -> sequence number, for groups started and not yet trained or dropped."""
        self.trained: set[str] = set()
        """Group ids trained or dropped (a re-delivered lease of one is acked and skipped)."""
        self.foreign_rows = 0
        """Rows of groups this run never started (put by another process on the bus): acked unread."""
        self.dropped: list[Group] = []
        """Groups dropped as too stale since the last step; dumped (untrained) with the next step."""
        self.dropped_this_step = 0
        self.filtered: list[Group] = []
        """Groups retired untrained by dynamic sampling since the last step; dumped with the next step."""
        self.filtered_this_step = 0
        self.cap_reached = False
        """Dynamic sampling hit ``max_draws_per_step`` this step and kept a uniform group."""
        ds = cfg.rollout.dynamic_sampling
        self.draw_cap = ds.draw_cap(ctrl.B) if ds.enabled else None
        """Groups the trainer may take for one step under dynamic sampling; None: no filtering."""
        self.estimator = cfg.trainer.advantage_estimator
        self.advantages = AdvantageConsumer(ctrl.bus, PARTITION, ctrl.G, self.estimator, cfg.rollout.overlong,
                                            cfg.rollout.max_new_tokens)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self.last_row: dict[str, Any] = {}
        self.played_s: dict[str, list[float]] = {}
        """group id -> [start, end] (perf_counter s) of its play, end once it is on the bus."""
        self.failure: BaseException | None = None
        """The first error of a producer (a group the bus refused); ends the run."""
        self.fields = [R.ADVANTAGE, R.TRAINABLE, *R.EPISODE_FIELDS, R.TRAJECTORY]
        """What the loop reads of each row (the trainer service reads :attr:`train_fields` itself): the
        step metrics come from the episode fields, the trajectory goes to the rollout dump."""
        self.train_fields = tuple(R.TRAIN_FIELDS)
        if ctrl.runtime.rollout.routes is not None:
            self.train_fields += tuple(R.ROUTE_FIELDS)
        agent = ctrl.cfg.rollout.driver == "agent"
        self.train_branches = agent and ctrl.cfg.rollout.agent.train_branches
        if agent or ctrl.cfg.rollout.context.policy != "truncate":  # segments are read from the trajectory
            self.train_fields += (R.TRAJECTORY,)
        self.keep = ctrl.trainer.rows_needed_after() is not None
        """Trained rows wait on the bus (consumer :data:`KEEPER`) until a checkpoint covers them."""
        self.kept: list[tuple[int, list[str]]] = []
        """(policy version of the update, sample ids) of the groups kept for a trainer restart."""

    def close(self) -> None:
        """Shut the trainer thread's pool down, waiting for a job in flight."""
        self.pool.shutdown(wait=True)

    async def main(self) -> None:
        """Run the trainer side until ``trainer.steps`` beside the producers and the advantage
        consumer. Those run until cancelled, so one that ends has raised: its exception ends the
        run at once (the trainer side is cancelled; an update in flight finishes first), never a
        trainer waiting on the bus for rows that will not come."""
        train = asyncio.ensure_future(self._train())
        helpers = {asyncio.ensure_future(self._produce()): "producer",
                   asyncio.ensure_future(self._advantages()): "advantage consumer"}
        try:
            done, _ = await asyncio.wait({train, *helpers}, return_when=asyncio.FIRST_COMPLETED)
            if train not in done:
                failed = next(iter(done))
                train.cancel()
                await asyncio.gather(train, return_exceptions=True)
                if failed.cancelled():  # cancelled from outside the run: not a result to report
                    raise asyncio.CancelledError
                failed.result()  # re-raises the helper's exception, unchanged
                raise AssertionError(f"the {helpers[failed]} returned, which it never does")
            train.result()
        finally:
            for task in (train, *helpers):
                task.cancel()
            await asyncio.gather(train, *helpers, return_exceptions=True)

    # -- producers --------------------------------------------------------------------------
    async def _produce(self) -> None:
        running: set[asyncio.Task] = set()
        try:
            while True:
                await self.gate.admit()
                job = self._next_job()
                span = self.played_s[job.group_id] = [time.perf_counter(), math.nan]
                fut = asyncio.ensure_future(self.ctrl.runtime.rollout.play_group(job, self.ctrl.params()))
                fut.add_done_callback(functools.partial(_mark_played, span))
                running.add(fut)
                fut.add_done_callback(running.discard)
                fut.add_done_callback(self._raise_failed)
        finally:
            for fut in list(running):
                fut.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    def _next_job(self) -> GroupJob:
        """Group ``seq``: ids and seeds are those of step ``seq // B``, slot ``seq % B``."""
        seq = self.next_seq
        self.next_seq += 1
        step, g = divmod(seq, self.ctrl.B)
        task = self.ctrl.pools.rl[self.draws.next(1)[0]]
        group_id = f"s{step}/g{g}"
        self.seq_of[group_id] = seq
        seed = self.ctrl.cfg.run.seed + step * SEED_STRIDE + g * self.ctrl.G
        return GroupJob(seq, group_id, task, seed, self.ctrl.G)

    def _raise_failed(self, fut: asyncio.Future) -> None:
        """A group the bus refused ends the run (episodes never raise: they fail as records);
        the trainer side raises it at its next read."""
        if not fut.cancelled() and fut.exception() is not None:
            self.failure = fut.exception()

    async def _advantages(self) -> None:
        while True:
            await asyncio.to_thread(self.advantages.process_one, _POLL_S)

    # -- trainer side -------------------------------------------------------------------------
    async def _train(self) -> None:
        ctrl, cfg = self.ctrl, self.ctrl.cfg
        t_last = time.perf_counter()
        while ctrl.step < cfg.trainer.steps:
            groups, wait_s = await self._collect()
            t_last = await self._in_trainer(functools.partial(self._step, groups, wait_s, t_last))
            if ctrl._due(cfg.checkpoint.every_steps):
                await self._in_trainer(ctrl.save)
                await self._in_trainer(self._release_kept)
            if ctrl._due(cfg.eval.every_steps) and ctrl.step < cfg.trainer.steps:
                await self._in_trainer(lambda: ctrl.run_eval(run=lambda fn: asyncio.run(fn())))
            if ctrl.step < cfg.trainer.steps:
                self.gate.step_done()

    async def _collect(self) -> tuple[list[Group], float]:
        """Take B complete groups as they come; drop those that would exceed max_staleness and,
        under dynamic sampling, filter those without signal while the draw cap allows."""
        groups: list[Group] = []
        wait_s = 0.0
        self.dropped_this_step = 0
        self.filtered_this_step = 0
        self.cap_reached = False
        while len(groups) < self.ctrl.B:
            if self.failure is not None:
                raise self.failure
            t0 = time.perf_counter()
            try:
                batch = await asyncio.to_thread(self.ctrl.bus.get, PARTITION, self.fields, TRAINER, self.ctrl.G,
                                                timeout_s=_POLL_S, sampler="group")
            except QueueTimeoutError:
                continue
            finally:
                wait_s += time.perf_counter() - t0
            group = self._take(batch, groups)
            if group is None:
                continue
            if self.gate.too_stale(self.ctrl.version, group.version):
                self._drop(group)
            elif self.draw_cap is not None and not informative(group, self.estimator):
                if self._may_filter(len(groups), self.draw_cap):
                    self._filter(group)
                else:
                    self.cap_reached = True
                    groups.append(group)
            else:
                groups.append(group)
        return groups, wait_s

    def _may_filter(self, kept: int, draw_cap: int) -> bool:
        """True when filtering one more group still lets the step fill its ``B - kept`` places
        within ``draw_cap`` (every group taken so far, this one and the places left)."""
        taken = kept + self.dropped_this_step + self.filtered_this_step
        return taken + 1 + (self.ctrl.B - kept) <= draw_cap

    def _filter(self, group: Group) -> None:
        """Dynamic sampling: retire a group without signal untrained and free its place for a new draw."""
        self.filtered.append(group)
        self._retire(group)
        self.gate.drop()
        self.filtered_this_step += 1

    def _take(self, batch: Any, held: list[Group]) -> Group | None:
        """The group of ``batch``; None when it is a re-delivery of a group already trained or
        dropped (acked now) or held for this step (the newer lease replaces the held one)."""
        gid = batch.group_ids[0]
        if gid in self.trained:
            self._ack(batch.lease_id)
            return None
        versions = {int(v) for v in batch.versions}
        if gid not in self.seq_of or len(versions) != 1:  # not a group of this run: never trained, never a crash
            self._ack(batch.lease_id)
            self.foreign_rows += len(batch.sample_ids)
            print(f"warning: {len(batch.sample_ids)} rows of group {gid!r} (versions {sorted(versions)}) on the bus were "
                  "not started by this run; dropped untrained", file=sys.stderr, flush=True)
            return None
        group = Group(self.seq_of[gid], versions.pop(), dict(batch.fields), list(batch.fields[R.TRAJECTORY]),
                      batch.lease_id, list(batch.sample_ids))
        for i, other in enumerate(held):
            if other.seq == group.seq:
                held[i] = group
                return None
        return group

    def _drop(self, group: Group) -> None:
        self.dropped.append(group)
        self._retire(group)
        self.gate.drop()
        self.dropped_this_step += 1

    def _retire(self, group: Group, trained_into: int | None = None) -> None:
        """Ack ``group`` for the trainer side. ``trained_into``: the policy version its rows were
        trained into, when some were; such rows stay on the bus until a checkpoint covers that version
        if the trainer service may read them again, the others are released now."""
        gid = group.trajs[0].group_id
        self.trained.add(gid)
        self.seq_of.pop(gid, None)
        start, end = self.played_s.pop(gid, (math.nan, math.nan))
        group.played_s = (start, end)
        self._ack(group.lease_id)
        if self.keep:
            if trained_into is None:
                self._release(group.sample_ids)
            else:
                self.kept.append((trained_into, group.sample_ids))

    def _release(self, sample_ids: list[str]) -> None:
        """Ack rows as the :data:`KEEPER` (they retire once the other consumers acked them too)."""
        from relax_agent.data import IdsSampler

        batch = self.ctrl.bus.get(PARTITION, [R.TRAINABLE], KEEPER, len(sample_ids), timeout_s=60.0,
                                  sampler=IdsSampler(tuple(sample_ids)))
        self._ack(batch.lease_id)

    def _release_kept(self) -> None:
        """After a checkpoint: release the kept rows it covers (trainer thread)."""
        covered = self.ctrl.trainer.rows_needed_after()
        if covered is None:
            return
        keep = []
        for version, ids in self.kept:
            if version <= covered:
                self._release(ids)
            else:
                keep.append((version, ids))
        self.kept = keep

    def _ack(self, lease_id: str) -> None:
        try:
            self.ctrl.bus.ack(lease_id)
        except LeaseError:
            pass  # the lease expired and the rows were handed out again: that lease is acked on arrival

    def _step(self, groups: list[Group], wait_s: float, t_last: float) -> float:
        """Train on the step's groups (in group order), publish, ack, log (trainer thread).

        ``t_last``: when the previous step ended; returns when this one did."""
        ctrl = self.ctrl
        groups.sort(key=lambda grp: grp.seq)
        trajs = [t for grp in groups for t in grp.trajs]
        played = trajs + [t for grp in self.filtered for t in grp.trajs]
        if not any(t.num_policy_tokens for t in played):
            raise RolloutError(nothing_sampled(played, ctrl.step + 1, ctrl.cfg.rollout.max_total_tokens))
        versions = [grp.version for grp in groups for _ in grp.trajs]
        trained_at = ctrl.version
        train_metrics, kept = self._update(groups)
        for grp in groups:
            self._retire(grp, ctrl.version if any(sid in kept for sid in grp.sample_ids) else None)
        ctrl.step += 1
        ctrl.weights_dirty = False
        ctrl.groups_drawn = self.next_seq
        ctrl.sampler.load_state_dict(self.draws.state_dict())
        dropped, self.dropped = self.dropped, []
        filtered, self.filtered = self.filtered, []
        rows = list(zip(trajs, versions, strict=True)) + [(t, grp.version) for grp in dropped + filtered for t in grp.trajs]
        write_rollout_dump(ctrl.out / "rollouts" / f"step_{ctrl.step:06d}.jsonl", rows, trained_at, kept,
                           {t.sample_id for grp in dropped for t in grp.trajs}, ctrl.runtime.decode,
                           filtered={t.sample_id for grp in filtered for t in grp.trajs},
                           train_branches=self.train_branches)
        if ctrl.cfg.logging.token_record:
            write_token_record(ctrl.out / "rollouts" / "tokens" / f"step_{ctrl.step:06d}.jsonl.gz", rows,
                               self._placeholder_ids(trajs))
        t_end = time.perf_counter()
        row = self._row(groups, groups + filtered, versions, trained_at, train_metrics, wait_s, t_end - t_last,
                        self._rollout_s(groups + filtered, t_end - t_last))
        for hook in (*ctrl.runtime.step_hooks, ctrl.mismatch.observe):
            row.update(hook(row))
        ctrl.logger.log(ctrl.step, row)
        ctrl.logger.log_histogram(ctrl.step, STALENESS_HIST, [trained_at - v for v in versions])
        ctrl._report("step", row)
        self.last_row = row
        return t_end

    def _update(self, groups: list[Group]) -> tuple[dict[str, float], set[str]]:
        """Train on the rows of ``groups`` that are trainable with a non-zero advantage and publish
        the new version; returns the metrics and the ids of the rows that entered the gradient."""
        ctrl = self.ctrl
        out: dict[str, float] = {}
        final = None
        if self.estimator in BATCH_NORMALIZED:
            final, out = batch_normalized(groups)
        adv_of = (lambda g, i: float(g.fields[R.ADVANTAGE][i])) if final is None else (lambda g, i: final[(g.seq, i)])
        keep = [(grp, i) for grp in groups for i in range(len(grp.trajs))
                if bool(grp.fields[R.TRAINABLE][i]) and adv_of(grp, i) != 0.0]
        kept = {grp.sample_ids[i] for grp, i in keep}
        n_valid = sum(int(np.count_nonzero(grp.fields[R.TRAINABLE])) for grp in groups)
        out.update({"train/samples": float(len(keep)), "train/zero_advantage": float(n_valid - len(keep))})
        if not keep:
            return out, kept  # every group was uniform: no gradient, no new version
        ref = TrainRef(PARTITION, tuple(grp.sample_ids[i] for grp, i in keep), self.train_fields, ctrl.version + 1,
                       None if final is None else tuple(final[(grp.seq, i)] for grp, i in keep), self.train_branches)
        ctrl.weights_dirty = True
        out.update(ctrl.trainer.train(ref))
        ctrl.version += 1
        return out, kept

    def _placeholder_ids(self, trajs: list[Trajectory]) -> dict[int, str] | None:
        """Placeholder token id -> media kind of a multimodal policy (read once from its config, for the
        token record's media positions); None for text episodes or a config that cannot be read."""
        if not any(t.media is not None for t in trajs):
            return None
        if not hasattr(self, "_kind_of_token"):
            try:
                from transformers import AutoConfig

                from relax_agent.multimodal.processor import MediaFamily

                path = self.ctrl.cfg.model.path
                self._kind_of_token = MediaFamily.from_config(AutoConfig.from_pretrained(path)).kind_of_token()
            except Exception:  # noqa: BLE001 - the record then keeps no positions; replay re-derives them
                self._kind_of_token = None
        return self._kind_of_token

    def _row(self, groups: list[Group], sampled: list[Group], versions: list[int], trained_at: int,
             train_metrics: dict[str, float], wait_s: float, step_s: float, rollout_s: float) -> dict[str, Any]:
        """The step's metric row, from the rows' episode fields. ``groups``: the step's groups (trained
        or not), ``versions`` their rows'; ``sampled``: those and the groups dynamic sampling filtered
        (the rollout metrics describe every episode the step's rollouts played, not only the
        informative ones)."""
        ctrl = self.ctrl
        live = self.gate.started - self.gate.dropped - self.gate.steps_done * ctrl.B
        n = sum(len(grp.sample_ids) for grp in groups)
        row = {**episode_metrics(episode_fields(sampled), rollout_s), **ctrl.runtime.rollout.metrics(),
               **train_metrics,
               **overlong_field_metrics(episode_fields(groups), ctrl.cfg.rollout.overlong,
                                        ctrl.cfg.rollout.max_new_tokens),
               **staleness_metrics([trained_at - v for v in versions], ctrl.s),
               M.DATA_WAIT: wait_s, M.SAMPLES_PER_S: n / max(step_s, 1e-9), M.STEP_TIME: step_s,
               DROPPED_GROUPS: float(self.dropped_this_step), LIVE_GROUPS: float(live),
               "policy_version": ctrl.version}
        if self.draw_cap is not None:
            n_groups = n // max(ctrl.G, 1)
            row.update({FILTERED_GROUPS: float(self.filtered_this_step),
                        DRAWN_GROUPS: float(n_groups + self.filtered_this_step + self.dropped_this_step),
                        DS_CAP_REACHED: float(self.cap_reached)})
        return row

    @staticmethod
    def _rollout_s(groups: list[Group], step_s: float) -> float:
        """Wall time the step's rollouts took: from the first of its groups (filtered ones included)
        starting to the last one reaching the bus. Under colocate the update and the weight sync are
        outside it; under async it may overlap the previous step. ``step_s`` when no span is known."""
        spans = [grp.played_s for grp in groups if all(map(math.isfinite, grp.played_s))]
        if not spans:
            return step_s
        return max(end for _, end in spans) - min(start for start, _ in spans)

    async def _in_trainer(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the trainer thread; when cancelled, let it finish before re-raising."""
        fut = self.pool.submit(fn)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            concurrent.futures.wait([fut])
            raise
