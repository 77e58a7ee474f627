"""The one control loop: env -> rollout -> data bus (fields) -> advantages -> trainer -> weight sync.

Every run, whatever its mode, flows the same way. Rollout producers ask the rollout service
to play GRPO groups; the service writes each finished group's fields into the TransferQueue
partition ``rollouts`` (token ids, loss mask, rollout log-probs, reward, trainable, routed
experts for replay, each episode's scalars, the trajectory for the dump). The advantage consumer reads each
complete group's rewards and writes its ``advantage`` field. The trainer side takes whole
groups as they complete (one long-tail episode holds only its own group), drops those that
would exceed ``max_staleness``, with dynamic sampling (``rollout.dynamic_sampling``) retires
those whose rewards do not vary and lets the producers draw others in their place, and once it
has ``rollout.tasks_per_step`` groups names their trainable rows to the trainer service (a
:class:`~relax_agent.runtime.base.TrainRef`; the loop itself reads only the advantage, the trainable
flag, the episode scalars its metrics come from, and the trajectory for the rollout dump), which reads them from the bus, trains one step and publishes the new
weights through the weight sync (the engine applies them between decode batches); then the groups
are acked. When the trainer service may replay updates after a restart (``runtime: ray``), the rows
of the updates since the newest checkpoint stay on the bus until a checkpoint covers them.

The schedule (:mod:`relax_agent.control.schedule`) is the only difference between modes:
``colocate`` is staleness 0 with weights copied in-process; ``async`` allows ``max_staleness``
versions of lag, with off-policy correction (``trainer.off_policy``). With staleness 0 both
produce the same tasks, sample ids, seeds, policy versions and weights.

Ctrl-C (:class:`~relax_agent.control.stop.StopRequest`) cancels the producers and their
episodes (envs closed), lets a trainer update in flight finish, and the loop saves the last
complete step. Resume restores weights, optimizer, step, policy version and the task sampler
exactly; with ``max_staleness = s > 0`` the up to ``s * B`` groups in flight at the save are
not replayed (no task is trained twice, a few are skipped).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from relax_agent import metrics as M
from relax_agent import records as R
from relax_agent.checkpoint import CheckpointManager, load_state
from relax_agent.config import RelaxConfig, dump_config
from relax_agent.control.advantages import CONSUMER as ADVANTAGE_CONSUMER
from relax_agent.control.advantages import AdvantageConsumer, overlong_field_metrics
from relax_agent.control.reporting import episode_metrics, write_rollout_dump, write_token_record
from relax_agent.control.resume import check_resume_tasks
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
from relax_agent.control.stop import StopRequest
from relax_agent.errors import LeaseError, QueueTimeoutError, RolloutError
from relax_agent.evaluation import evaluate
from relax_agent.records import Trajectory
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.runtime.base import PARTITION, GroupJob, Runtime, TrainerService, TrainRef
from relax_agent.sampler import TaskSampler
from relax_agent.train.algorithms import BATCH_NORMALIZED

TRAINER = "trainer"
KEEPER = "checkpoint"
"""The bus consumer whose ack retires trained rows once a checkpoint covers their update (only
when the trainer service may read them again, see :meth:`TrainerService.rows_needed_after`)."""
_POLL_S = 0.5
"""Blocking bus reads return at least this often, so a stop is never held up."""
SEED_STRIDE = 10_007
"""Step ``k``'s groups are seeded from ``run.seed + k * SEED_STRIDE``."""

T = TypeVar("T")


@dataclass
class _Group:
    """A complete group taken from the bus by the trainer side."""

    seq: int
    version: int
    fields: dict[str, Any]
    trajs: list[Trajectory]
    lease_id: str
    sample_ids: list[str]
    played_s: tuple[float, float] = (math.nan, math.nan)
    """(start, end) of the group's play in perf_counter seconds, set when it is retired; nan: unknown
    (a group started before a resume)."""


class Controller:
    """Runs training (and evaluation) for one config over a runtime's services.

    Args:
        cfg: the validated run config.
        runtime: the rollout and trainer services (see :func:`relax_agent.runtime.local.build_local_runtime`).
        bus: the data bus the services write to (a :class:`~relax_agent.data.TransferQueue`).
        reporter: receives progress events (console bar); ``None`` for silence.
    """

    def __init__(self, cfg: RelaxConfig, runtime: Runtime, bus: Any, reporter: Any = None):
        self.cfg = cfg
        self.runtime = runtime
        self.bus = bus
        self.reporter = reporter
        self.out = Path(cfg.run.output_dir)
        self.logger = M.MetricsLogger(self.out, tensorboard=cfg.logging.tensorboard)
        self.ckpts = CheckpointManager(self.out, cfg.checkpoint.keep_last,
                                       frozenset({0}) if cfg.checkpoint.keep_warmup else frozenset())
        self.sampler = TaskSampler(len(runtime.train_tasks), cfg.run.seed)
        """Task order at the last step boundary (what a checkpoint saves)."""
        self.step = 0
        self.version = 0
        self.groups_drawn = 0
        """Groups drawn by the last complete step (names and seeds the next ones)."""
        self.stop = StopRequest()
        self.B, self.G = cfg.rollout.tasks_per_step, cfg.rollout.group_size
        self.s = cfg.max_staleness if cfg.mode == "async" else 0
        self.weights_dirty = False
        """True while an update has changed the trainer's weights but its step is not complete
        (a checkpoint then would not match any step)."""
        self.sft_done = cfg.trainer.sft_warmup_steps == 0
        """The supervised warm-up ran (or none is configured)."""

    def close(self) -> None:
        """Close the runtime's services and the bus."""
        self.runtime.close()

    @property
    def trainer(self) -> TrainerService:
        """The runtime's trainer service; RuntimeError for a runtime built to evaluate only."""
        if self.runtime.trainer is None:
            raise RuntimeError("this runtime has no trainer service (it was built to evaluate only)")
        return self.runtime.trainer

    # -- resume -----------------------------------------------------------------------------
    def restore(self, ckpt: Path) -> None:
        """Continue from ``ckpt`` (the policy was already loaded from ``ckpt/model``); its
        weights are published to the engines as the checkpoint's policy version."""
        check_resume_tasks(ckpt, len(self.runtime.train_tasks), self.cfg)
        state, trainer_state = load_state(ckpt)
        self.sampler.load_state_dict(state["sampler"])
        self.step, self.version = state["step"], state["policy_version"]
        self.groups_drawn = state.get("groups_drawn", self.step * self.B)
        self.sft_done = state.get("sft_done", True)
        self.trainer.restore(trainer_state, self.version)

    def save(self) -> Path:
        """Checkpoint the last complete step."""
        state = {"policy_version": self.version, "sampler": self.sampler.state_dict(), "groups_drawn": self.groups_drawn,
                 "sft_done": self.sft_done}
        trainer = self.trainer
        return self.ckpts.save(self.step, trainer.save_model, trainer.state_dict(), state, dump_config(self.cfg))

    # -- the run ----------------------------------------------------------------------------
    def params(self, temperature: float | None = None) -> SamplingParams:
        """Sampling parameters of ``rollout`` (``temperature`` overrides the configured one when given)."""
        r = self.cfg.rollout
        return SamplingParams(r.max_new_tokens, temperature or r.temperature, r.top_p)

    def train(self) -> dict[str, Any]:
        """Run until ``trainer.steps``; returns the last step's metrics and eval results."""
        summary: dict[str, Any] = {}
        with self.stop:
            try:
                if self.cfg.eval.at_start and self.step == 0 and self.version == 0:
                    summary["eval_start"] = self.run_eval()
                if not self.sft_done:
                    summary["sft"] = self.sft_warmup()
                    if self.cfg.checkpoint.keep_warmup:
                        summary["checkpoint_warmup"] = str(self.save())
                    if self.cfg.eval.after_warmup:
                        summary["eval_warmup"] = self.run_eval(name="warmup")
                if self.step < self.cfg.trainer.steps:
                    summary.update(self._pipeline())
                if self.cfg.eval.at_end:
                    summary["eval_end"] = self.run_eval()
            except KeyboardInterrupt:
                summary["interrupted"] = True
            finally:
                summary["checkpoint"] = self._final_checkpoint()
                summary["plot"] = str(self.plot()) if self.cfg.logging.plot else None
                self.logger.close()
        return summary

    def _final_checkpoint(self) -> str | None:
        if not self.cfg.trainer.steps or self.weights_dirty:
            # no RL step configured (the warm-up's checkpoint, if any, is the run's), or an update
            # failed half-way (the trainer's weights match no step): the newest checkpoint there is
            latest = self.ckpts.latest()
            return None if latest is None else str(latest)
        return str(self.save())

    def _pipeline(self) -> dict[str, Any]:
        """Create the partition, run producers, the advantage consumer and the trainer until
        ``trainer.steps``; returns ``{"last": last step's metrics}``."""
        from relax_agent.data import queue_capacity

        routes = self.runtime.rollout.routes
        capacity, consumers = queue_capacity(self.B, self.s, self.G), [ADVANTAGE_CONSUMER, TRAINER]
        if self.trainer.rows_needed_after() is not None:
            # the rows of up to checkpoint.every_steps updates wait on the bus for a checkpoint
            capacity += self.cfg.checkpoint.every_steps * self.B * self.G
            consumers.append(KEEPER)
        self.bus.create_partition(PARTITION, capacity, R.rollout_schema(*(routes or ())), group_size=self.G,
                                  retire_after=consumers)
        run = _Run(self)
        try:
            self.stop.run(run.main)
        finally:
            run.close()
        return {"last": run.last_row} if run.last_row else {}

    def sft_warmup(self) -> dict[str, float]:
        """The supervised warm-up (``trainer.sft_warmup_steps`` updates on the env's demonstrations
        of the train split, ``trainer.sft_batch_size`` each, in a seeded order that cycles epoch by
        epoch); its weights are published as the next policy version. Progress goes to
        ``sft.jsonl``; returns the first and last loss. Ctrl-C stops it between updates (nothing
        is checkpointed: the warm-up starts again on resume); a finished warm-up is saved as
        ``checkpoints/step_000000`` (``checkpoint.keep_warmup``)."""
        import json

        import numpy as np

        t = self.cfg.trainer
        demos = self.runtime.rollout.demonstrations(self.runtime.train_tasks, self.cfg.run.seed)
        n = len(demos["task_id"])
        rng = np.random.default_rng(self.cfg.run.seed)
        order: list[int] = []
        while len(order) < t.sft_warmup_steps * t.sft_batch_size:
            order += rng.permutation(n).tolist()
        self._report("sft_start", {"total": t.sft_warmup_steps})
        losses = []
        self.out.mkdir(parents=True, exist_ok=True)
        with (self.out / "sft.jsonl").open("w") as log:
            for k in range(t.sft_warmup_steps):
                idx = order[k * t.sft_batch_size:(k + 1) * t.sft_batch_size]
                rows = {name: [demos[name][i] for i in idx]
                        for name in (R.TOKEN_IDS, R.LOSS_MASK, R.ROLLOUT_LOGPROBS, R.MEDIA) if name in demos}
                self.weights_dirty = True
                metrics = self.trainer.sft(rows, t.sft_lr)
                losses.append(metrics["sft/loss"])
                log.write(json.dumps({"sft/step": k + 1, **metrics}) + "\n")
                log.flush()
                self._report("sft", {"step": k + 1, "total": t.sft_warmup_steps, **metrics})
                self.stop.check()
        self.version += 1
        self.trainer.end_sft(self.version)
        self.weights_dirty = False
        self.sft_done = True
        out = {"sft/steps": float(t.sft_warmup_steps), "sft/demonstrations": float(n),
               "sft/loss_first": losses[0], "sft/loss_last": losses[-1], "policy_version": self.version}
        self.logger.log(self.step, out)
        return out

    # -- evaluation and plots ---------------------------------------------------------------
    def run_eval(self, run: Callable[[Callable[[], Any]], Any] | None = None, name: str | None = None) -> dict[str, Any]:
        """Evaluate on the held-out tasks; ``run`` drives the coroutines (default: Ctrl-C cancels them).

        Every sample goes to ``eval/step_NNNNNN.samples.jsonl`` in the run folder (task, prompt,
        response, parsed calls, verdict with reason; see :func:`relax_agent.evaluation.sample_record`).
        ``name`` (e.g. "warmup") evaluates off the step cadence: the samples go to
        ``eval/<name>.samples.jsonl`` and the metrics row's ``eval/*`` keys become ``eval_<name>/*``,
        so it supersedes no step's evaluation.
        """
        e = self.cfg.eval
        tasks = self.runtime.heldout_tasks[: e.num_tasks]
        self._report("eval_start", {"total": len(tasks) * len(e.seeds)})
        stem = name or f"step_{self.step:06d}"
        result = evaluate(self.runtime.rollout, tasks, e.seeds, self.params(e.temperature),
                          on_done=lambda t: self._report("episode", {}), run=run or self.stop.run,
                          samples_path=self.out / "eval" / f"{stem}.samples.jsonl")
        row = {k: v for k, v in result.items() if not isinstance(v, list)}
        if name:
            row = {k.replace("eval/", f"eval_{name}/", 1): v for k, v in row.items()}
        self.logger.log(self.step, row)
        self._report("eval", result)
        return result

    def plot(self) -> Path:
        """Draw the run's curves from ``metrics.jsonl`` to ``plots/curves.png``; returns that path."""
        return M.plot_curves(self.logger.path, self.out / "plots" / "curves.png")

    def _report(self, event: str, data: dict[str, Any]) -> None:
        if self.reporter is not None:
            self.reporter(event, self.step, data)

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0


def _mark_played(span: list[float], _fut: Any) -> None:
    """Done-callback of a group's rollout: its ``[start, end]`` span gets its end."""
    span[1] = time.perf_counter()


class _Run:
    """One pass of the pipeline: the coroutines and the trainer thread of :meth:`Controller.train`."""

    _kind_of_token: dict[int, str] | None  # read on first use by _placeholder_ids

    def __init__(self, ctrl: Controller) -> None:
        cfg = ctrl.cfg
        self.ctrl = ctrl
        self.gate = StalenessGate(ctrl.B, ctrl.s)
        self.draws = TaskSampler(len(ctrl.runtime.train_tasks), cfg.run.seed)
        self.draws.load_state_dict(ctrl.sampler.state_dict())
        self.next_seq = ctrl.groups_drawn
        self.seq_of: dict[str, int] = {}
        """group id -> sequence number, for groups started and not yet trained or dropped."""
        self.trained: set[str] = set()
        """Group ids trained or dropped (a re-delivered lease of one is acked and skipped)."""
        self.dropped: list[_Group] = []
        """Groups dropped as too stale since the last step; dumped (untrained) with the next step."""
        self.dropped_this_step = 0
        self.filtered: list[_Group] = []
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
        self.train_branches = ctrl.cfg.rollout.driver == "agent" and ctrl.cfg.rollout.agent.train_branches
        if self.train_branches:  # the trainer reads each row's side segments from its trajectory
            self.train_fields += (R.TRAJECTORY,)
        self.keep = ctrl.trainer.rows_needed_after() is not None
        """Trained rows wait on the bus (consumer :data:`KEEPER`) until a checkpoint covers them."""
        self.kept: list[tuple[int, list[str]]] = []
        """(policy version of the update, sample ids) of the groups kept for a trainer restart."""

    def close(self) -> None:
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
        task = self.ctrl.runtime.train_tasks[self.draws.next(1)[0]]
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

    async def _collect(self) -> tuple[list[_Group], float]:
        """Take B complete groups as they come; drop those that would exceed max_staleness and,
        under dynamic sampling, filter those without signal while the draw cap allows."""
        groups: list[_Group] = []
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
            elif self.draw_cap is not None and not _informative(group, self.estimator):
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

    def _filter(self, group: _Group) -> None:
        """Dynamic sampling: retire a group without signal untrained and free its place for a new draw."""
        self.filtered.append(group)
        self._retire(group)
        self.gate.drop()
        self.filtered_this_step += 1

    def _take(self, batch: Any, held: list[_Group]) -> _Group | None:
        """The group of ``batch``; None when it is a re-delivery of a group already trained or
        dropped (acked now) or held for this step (the newer lease replaces the held one)."""
        gid = batch.group_ids[0]
        if gid in self.trained:
            self._ack(batch.lease_id)
            return None
        versions = {int(v) for v in batch.versions}
        assert len(versions) == 1, f"a group carries one sample version, got {versions}"
        group = _Group(self.seq_of[gid], versions.pop(), dict(batch.fields), list(batch.fields[R.TRAJECTORY]),
                       batch.lease_id, list(batch.sample_ids))
        for i, other in enumerate(held):
            if other.seq == group.seq:
                held[i] = group
                return None
        return group

    def _drop(self, group: _Group) -> None:
        self.dropped.append(group)
        self._retire(group)
        self.gate.drop()
        self.dropped_this_step += 1

    def _retire(self, group: _Group, trained_into: int | None = None) -> None:
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

    def _step(self, groups: list[_Group], wait_s: float, t_last: float) -> float:
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
        for hook in ctrl.runtime.step_hooks:
            row.update(hook(row))
        ctrl.logger.log(ctrl.step, row)
        ctrl.logger.log_histogram(ctrl.step, STALENESS_HIST, [trained_at - v for v in versions])
        ctrl._report("step", row)
        self.last_row = row
        return t_end

    def _update(self, groups: list[_Group]) -> tuple[dict[str, float], set[str]]:
        """Train on the rows of ``groups`` that are trainable with a non-zero advantage and publish
        the new version; returns the metrics and the ids of the rows that entered the gradient."""
        ctrl = self.ctrl
        out: dict[str, float] = {}
        final = None
        if self.estimator in BATCH_NORMALIZED:
            final, out = _batch_normalized(groups)
        adv_of = (lambda g, i: float(g.fields[R.ADVANTAGE][i])) if final is None else (lambda g, i: final[(g.seq, i)])
        keep = [(grp, i) for grp in groups for i in range(len(grp.trajs))
                if bool(grp.fields[R.TRAINABLE][i]) and adv_of(grp, i) != 0.0]
        kept = {grp.sample_ids[i] for grp, i in keep}
        n_valid = sum(int(np.count_nonzero(grp.fields[R.TRAINABLE])) for grp in groups)
        out.update({"train/samples": float(len(keep)), "train/zero_advantage": float(n_valid - len(keep))})
        if not keep:
            return out, kept  # every group was uniform: no gradient, no new version
        ref = TrainRef(PARTITION, tuple(grp.sample_ids[i] for grp, i in keep), self.train_fields, ctrl.version + 1,
                       None if final is None else tuple(final[(grp.seq, i)] for grp, i in keep))
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

    def _row(self, groups: list[_Group], sampled: list[_Group], versions: list[int], trained_at: int,
             train_metrics: dict[str, float], wait_s: float, step_s: float, rollout_s: float) -> dict[str, Any]:
        """The step's metric row, from the rows' episode fields. ``groups``: the step's groups (trained
        or not), ``versions`` their rows'; ``sampled``: those and the groups dynamic sampling filtered
        (the rollout metrics describe every episode the step's rollouts played, not only the
        informative ones)."""
        ctrl = self.ctrl
        live = self.gate.started - self.gate.dropped - self.gate.steps_done * ctrl.B
        n = sum(len(grp.sample_ids) for grp in groups)
        row = {**episode_metrics(_episode_fields(sampled), rollout_s), **ctrl.runtime.rollout.metrics(),
               **train_metrics,
               **overlong_field_metrics(_episode_fields(groups), ctrl.cfg.rollout.overlong,
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
    def _rollout_s(groups: list[_Group], step_s: float) -> float:
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


def _episode_fields(groups: list[_Group]) -> dict[str, list[Any]]:
    """The episode fields (:data:`relax_agent.records.EPISODE_FIELDS`) of ``groups``' rows, concatenated in order."""
    return {name: [v for grp in groups for v in grp.fields[name]] for name in R.EPISODE_FIELDS}


def nothing_sampled(trajs: list[Trajectory], step: int, max_total_tokens: int) -> str:
    """Why step ``step``'s episodes ``trajs`` (none of which sampled a policy token) gave nothing:
    the message of the :class:`~relax_agent.errors.RolloutError` that ends the run, naming the most
    common cause (a prompt that fills ``rollout.max_total_tokens``, or the episodes' error) and its fix."""
    from collections import Counter

    full = [t for t in trajs if t.error is None and t.prompt_len >= max_total_tokens]
    head = f"step {step}: none of its {len(trajs)} episodes sampled a token, so there is nothing to train"
    if full:
        longest = max(full, key=lambda t: t.prompt_len)
        return (f"{head}; {len(full)} of them have a prompt that alone fills rollout.max_total_tokens="
                f"{max_total_tokens} (task {longest.task_id!r}: {longest.prompt_len} tokens); set "
                f"rollout.max_total_tokens above {longest.prompt_len} or shorten the prompts")
    causes = Counter(t.error if t.error is not None else f"stop reason {t.stop_reason.value}" for t in trajs)
    cause, n = causes.most_common(1)[0]
    return f"{head}; {n} of them ended with: {cause}"


def _informative(group: _Group, estimator: str = "grpo") -> bool:
    """A group carries a signal: some trainable sample has a non-zero advantage (its valid
    rewards differ; DAPO's ``0 < #correct < G`` for a binary reward). For ``reinforce_pp``, whose
    group-level value is the reward itself, the same test reads: the trainable samples' values differ."""
    adv, ok = group.fields[R.ADVANTAGE], group.fields[R.TRAINABLE]
    if estimator == "reinforce_pp":
        return len({float(adv[i]) for i in range(len(adv)) if bool(ok[i])}) > 1
    return any(bool(ok[i]) and float(adv[i]) != 0.0 for i in range(len(adv)))


ADV_BATCH_MEAN = "advantage/batch_mean"
ADV_BATCH_STD = "advantage/batch_std"


def _batch_normalized(groups: list[_Group]) -> tuple[dict[tuple[int, int], float], dict[str, float]]:
    """REINFORCE++'s step-level normalisation of the groups' advantage fields over their trainable
    rows' policy tokens (:func:`~relax_agent.train.algorithms.batch_normalized_advantages`).

    Returns ``({(group seq, row): advantage}, metrics)``; the metrics are the token-weighted mean and
    std of the values before normalisation (:data:`ADV_BATCH_MEAN`, :data:`ADV_BATCH_STD`)."""
    import torch

    from relax_agent.train.algorithms import batch_normalized_advantages

    keys = [(grp.seq, i) for grp in groups for i in range(len(grp.trajs))]
    pre = torch.tensor([float(grp.fields[R.ADVANTAGE][i]) for grp in groups for i in range(len(grp.trajs))],
                       dtype=torch.float64)
    counts = torch.tensor([grp.trajs[i].num_policy_tokens for grp in groups for i in range(len(grp.trajs))],
                          dtype=torch.float64)
    valid = torch.tensor([bool(grp.fields[R.TRAINABLE][i]) for grp in groups for i in range(len(grp.trajs))])
    final = batch_normalized_advantages(pre, counts, valid)
    n = counts * valid.double()
    total = float(n.sum())
    mean = float((n * pre).sum()) / max(total, 1.0)
    std = (float((n * (pre - mean) ** 2).sum()) / max(total - 1.0, 1.0)) ** 0.5
    return dict(zip(keys, final.tolist(), strict=True)), {ADV_BATCH_MEAN: mean, ADV_BATCH_STD: std}
