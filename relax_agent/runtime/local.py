"""``runtime: local``: every role in this process (asyncio for rollout, a worker thread for training).

:class:`LocalRolloutService` plays groups with a :class:`~relax_agent.rollout.runner.RolloutRunner`
against the in-process engine and puts their fields into the data bus;
:class:`LocalTrainerService` reads a step's rows from the bus, collates them, trains a
:class:`~relax_agent.train.backends.base.Trainer` and publishes through a :class:`~relax_agent.weights.WeightSync` attached to that engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from relax_agent.records import Trajectory, trajectory_fields
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.runtime.base import PARTITION, GroupDone, GroupJob, Runtime, Task, TrainRef

SIDE_BRANCHES = "train/side_branches"
"""Side segments of agent episodes trained in the update (``rollout.agent.train_branches``)."""
CONTEXT_SEGMENTS = "train/context_segments"
"""Earlier contexts of multi-segment episodes trained in the update (``rollout.context``)."""


class LocalRolloutService:
    """Implements :class:`~relax_agent.runtime.base.RolloutService` over an in-process runner.

    Args:
        runner: plays episodes against ``runner.engine``.
        bus: the data bus (a :class:`~relax_agent.data.TransferQueue`).
        partition: where groups go.
        routes: ``((layers, top_k), dtype)`` of the engine's recorded MoE routes (routing replay), or None.
    """

    def __init__(self, runner: Any, bus: Any, partition: str = PARTITION,
                 routes: tuple[tuple[int, ...], str] | None = None) -> None:
        self.runner = runner
        self.bus = bus
        self.partition = partition
        self.routes = routes

    @property
    def policy_version(self) -> int:
        """The version of the weights the runner's engine samples with now."""
        return self.runner.engine.policy_version

    async def play_group(self, job: GroupJob, params: SamplingParams) -> GroupDone:
        """Play ``job``'s episodes with the in-process runner and put their rows on the bus (in a worker
        thread, so a full partition does not block the event loop); returns what was put, with the
        version the group started with and its wall time."""
        t0 = time.perf_counter()
        version = self.policy_version
        specs = [dataclasses.replace(s, group_id=job.group_id, sample_id=f"{job.group_id}/{i}")
                 for i, s in enumerate(self.runner.specs([job.task], job.group_size, prefix=job.group_id, seed=job.seed))]
        trajs = await self.runner.run(specs, params)
        ids = [t.sample_id for t in trajs]
        await asyncio.to_thread(self.bus.put, self.partition, ids, trajectory_fields(trajs, self.routes),
                                group_ids=[job.group_id] * len(ids), versions=[version] * len(ids))
        return GroupDone(job, ids, version, time.perf_counter() - t0)

    def specs(self, tasks: Sequence[Task], group_size: int, prefix: str, seed: int) -> list[Any]:
        """The runner's episode specs of ``tasks`` (evaluation plays these without the bus)."""
        return self.runner.specs(tasks, group_size, prefix=prefix, seed=seed)

    def demonstrations(self, tasks: Sequence[Task], seed: int) -> dict[str, list[Any]]:
        """Rendered reference replies of ``tasks`` (:func:`demonstration_fields` with the driver's env,
        renderer and parser)."""
        from relax_agent.rollout.demonstrations import demonstration_fields

        driver = self.runner.driver
        return demonstration_fields(driver.make_env, driver.renderer, driver.parser, tasks, seed)

    async def run(self, specs: Sequence[Any], params: SamplingParams,
                  on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Play ``specs`` with the runner and return their trajectories (evaluation; nothing is put on the bus)."""
        return await self.runner.run(specs, params, on_done)

    def metrics(self) -> dict[str, float]:
        """The engine's own metrics (:func:`engine_metrics`; empty for an engine that reports none)."""
        from relax_agent.rollout.engines.base import engine_metrics

        return dict(engine_metrics(self.runner.engine))  # a user's engine may report none

    def close(self) -> None:
        """Close the runner's engine."""
        self.runner.engine.close()


class LocalTrainerService:
    """Implements :class:`~relax_agent.runtime.base.TrainerService` over an in-process trainer.

    Args:
        trainer: the backend (``trainer.backend``).
        sync: publishes versions to the engines (``weights.transport``).
        pad_token_id: fills padding in collated batches.
        save_tokenizer: writes the tokenizer beside a saved model (``path -> None``).
        bus: the data bus the step's rows are read from (a :class:`~relax_agent.data.TransferQueue`).
    """

    def __init__(self, trainer: Any, sync: Any, pad_token_id: int,
                 save_tokenizer: Callable[[Path], None] | None = None, bus: Any = None) -> None:
        self.trainer = trainer
        self.sync = sync
        self.pad_token_id = pad_token_id
        self._save_tokenizer = save_tokenizer
        self.bus = bus

    def train(self, ref: TrainRef) -> dict[str, float]:
        """Read ``ref``'s rows, take one update and publish the weights as ``ref.version``; returns the
        update's metrics, the bus read time (``timing/bus_read_s``) and the weight-sync metrics."""
        fields, read_s = self.read(ref)
        out = self.update(fields, ref.side_branches)
        out["timing/bus_read_s"] = read_s
        out.update(self._publish(ref.version))
        return out

    def read(self, ref: TrainRef) -> tuple[dict[str, Any], float]:
        """``ref``'s fields from the bus (advantages replaced when ``ref`` carries them) and the
        seconds the read took.

        Raises:
            DataError: a row is not on the bus.
        """
        import numpy as np

        from relax_agent import records as R

        assert self.bus is not None, "a trainer service that trains reads from a bus"
        t0 = time.perf_counter()
        fields = self.bus.read(ref.partition, list(ref.sample_ids), list(ref.fields))
        if ref.advantages is not None:
            fields[R.ADVANTAGE] = [np.float32(a) for a in ref.advantages]
        return fields, time.perf_counter() - t0

    def update(self, fields: Mapping[str, Any], side_branches: bool = False) -> dict[str, float]:
        """Collate ``fields`` (B rows of :data:`~relax_agent.records.TRAIN_FIELDS`) and take one
        update without publishing; returns ``train/*`` metrics and ``timing/train_s``. With a
        ``trajectory`` field the rows' earlier contexts train too, and with ``side_branches`` their
        side segments (:func:`~relax_agent.train.collate.with_segments`, metrics
        :data:`CONTEXT_SEGMENTS`, :data:`SIDE_BRANCHES`)."""
        from relax_agent import records as R
        from relax_agent.train.collate import collate_fields, with_segments

        added = None
        if R.TRAJECTORY in fields:  # multi-segment episodes, rollout.agent.train_branches
            fields, *added = with_segments(fields, side_branches)
        batch = collate_fields(fields, self.pad_token_id)
        t0 = time.perf_counter()
        out = dict(self.trainer.train_step(batch))
        out["timing/train_s"] = time.perf_counter() - t0
        if added is not None:
            out[CONTEXT_SEGMENTS], out[SIDE_BRANCHES] = float(added[0]), float(added[1])
        return out

    def rows_needed_after(self) -> int | None:
        """None: an in-process trainer is never rebuilt, so it never reads a row again."""
        return None  # an in-process trainer is never rebuilt: it reads each row once

    def _publish(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        stats = self.sync.publish(self.trainer.policy_state_dict(), version)
        return {"timing/weight_sync_s": time.perf_counter() - t0, **stats.as_metrics()}

    def sft(self, fields: Mapping[str, Any], lr: float) -> dict[str, float]:
        """One supervised update on demonstration rows (every advantage 1.0) at learning rate ``lr``."""
        from relax_agent.train.collate import collate_fields

        batch = collate_fields(fields, self.pad_token_id, advantages=[1.0] * len(fields["token_ids"]))
        return self.trainer.sft_step(batch, lr)

    def end_sft(self, version: int) -> dict[str, float]:
        """End the trainer's warm-up and publish its weights as ``version``; returns weight-sync metrics."""
        self.trainer.end_sft()
        return self._publish(version)

    def restore(self, trainer_state: dict[str, Any], version: int) -> None:
        """Load ``trainer_state`` into the trainer and publish its weights as ``version``."""
        self.trainer.load_state_dict(trainer_state)
        self._publish(version)

    def state_dict(self) -> dict[str, Any]:
        """The trainer's state for a checkpoint."""
        return self.trainer.state_dict()

    def save_model(self, path: Any) -> None:
        """Write the policy's weights (and, when the service has one, its tokenizer) to folder ``path``."""
        self.trainer.save_model(Path(path))
        if self._save_tokenizer is not None:
            self._save_tokenizer(Path(path))

    def close(self) -> None:
        """Close the weight sync, then the trainer when it holds processes (Megatron ranks)."""
        try:
            self.sync.close()
        finally:
            from relax_agent.train.backends.base import HoldsProcesses

            if isinstance(self.trainer, HoldsProcesses):
                self.trainer.close()


def build_local_runtime(cfg: Any, roles: Any, bus: Any) -> Runtime:
    """The local services of ``roles`` (see :func:`relax_agent.roles.build_roles`) on ``bus``.

    Weights go through ``weights.transport`` in async mode and through ``inproc`` in colocate
    mode (the engine shares the trainer's device and process).
    """
    from relax_agent.rollout.engines.base import route_layout_of
    from relax_agent.weights import build_weight_sync

    routes = route_layout_of(roles.engine)
    rollout = LocalRolloutService(roles.runner, bus, PARTITION, routes)
    trainer = None
    closers: list[Callable[[], None]] = []
    if roles.trainer is not None:
        weights = cfg.weights if cfg.mode == "async" else cfg.weights.model_copy(update={"transport": "inproc"})
        sync = build_weight_sync(weights, engines=[roles.engine])
        tok = roles.tokenizer
        trainer = LocalTrainerService(roles.trainer, sync, _pad_id(tok), getattr(tok, "save_pretrained", None), bus)
        closers.append(trainer.close)
    closers.append(roles.close)
    return Runtime(rollout, trainer, roles.train_tasks, roles.heldout_tasks, roles.tokenizer.decode, closers)


def _pad_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad if pad is not None else tokenizer.eos_token_id)
