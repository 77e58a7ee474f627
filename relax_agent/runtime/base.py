"""The services the control loop talks to, wherever they run.

The loop never touches an engine or a model: it asks a :class:`RolloutService` to play a
group (the service writes the group's rows into the data bus itself), reads scalar fields back
from the bus, and names a step's rows to a :class:`TrainerService` (a :class:`TrainRef`), which
reads them from the bus, trains and publishes the new policy version through the weight sync. A runtime (``local`` in this process; Ray actors
or Serve deployments elsewhere) implements both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from relax_agent.records import Trajectory
from relax_agent.rollout.engines.base import SamplingParams

Task = dict[str, Any]

PARTITION = "rollouts"
"""The data-bus partition rollout services write groups into and the loop reads them from."""


@dataclass(frozen=True)
class GroupJob:
    """One GRPO group to play.

    Attributes:
        seq: the group's number in the run (step ``seq // tasks_per_step``, slot ``seq % tasks_per_step``).
        group_id: id of the group's rows on the bus; sample ids are ``{group_id}/{i}``.
        task: the task all ``group_size`` episodes play.
        seed: episode ``i`` is seeded ``seed + i``.
        group_size: episodes in the group.
    """

    seq: int
    group_id: str
    task: Task
    seed: int
    group_size: int


@dataclass(frozen=True)
class GroupDone:
    """A group whose rows are on the bus.

    Attributes:
        job: what was played.
        sample_ids: [group_size] row ids, in episode order.
        version: the engine's policy version when the group started (the rows' bus version).
        rollout_s: wall seconds the group took.
    """

    job: GroupJob
    sample_ids: list[str]
    version: int
    rollout_s: float


class RolloutService(Protocol):
    """Plays episodes against the policy; writes each finished group's rows to the data bus."""

    @property
    def routes(self) -> tuple[tuple[int, ...], str] | None:
        """``((layers, top_k), dtype)`` of the MoE routes the engine records for routing replay (the
        rows then carry the route fields), or None."""
        ...

    @property
    def policy_version(self) -> int:
        """The version the next generation will use."""
        ...

    async def play_group(self, job: GroupJob, params: SamplingParams) -> GroupDone:
        """Play ``job``'s episodes concurrently and put their rows (fields of
        :func:`relax_agent.records.rollout_schema`, without the advantage) into the bus partition.

        Every episode yields a row: a failed one is a row with ``trainable`` False and its cause
        in the trajectory. Raises only when the bus refuses the rows.
        """
        ...

    def specs(self, tasks: Sequence[Task], group_size: int, prefix: str, seed: int) -> list[Any]:
        """Episode specs (evaluation plays these without the bus)."""
        ...

    async def run(self, specs: Sequence[Any], params: SamplingParams,
                  on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Play ``specs`` and return their trajectories (evaluation; nothing is trained)."""
        ...

    def demonstrations(self, tasks: Sequence[Task], seed: int) -> dict[str, list[Any]]:
        """Rendered reference replies of ``tasks`` for the supervised warm-up: fields
        ``token_ids``, ``loss_mask``, ``rollout_logprobs`` (B ragged rows [T_i]), ``media`` (B
        :class:`~relax_agent.records.MediaInputs` or None; optional) and ``task_id`` (see :func:`relax_agent.rollout.demonstrations.demonstration_fields`).

        Raises:
            ConfigError: the env offers no demonstrations.
        """
        ...

    def metrics(self) -> dict[str, float]:
        """The service's own metrics since the previous call (the engine's prefix-cache hit rate;
        under Ray, replicas, restarts and heartbeats), merged into each step's row."""
        ...

    def close(self) -> None:
        """Release the engine(s) and anything else the service started."""


@dataclass(frozen=True)
class TrainRef:
    """One RL update, by reference: the rows the trainer service reads from the bus itself.

    The loop decides which rows train (trainable, non-zero advantage, not too stale) from a few
    scalar fields; the token ids, masks, log-probs, media and routes go from the bus to the trainer
    without passing through the loop's process.

    Attributes:
        partition: the bus partition holding the rows.
        sample_ids: [B] rows entering the gradient, in training order.
        fields: the fields to read (:data:`relax_agent.records.TRAIN_FIELDS`, plus the routing
            fields for replay).
        version: the policy version the update publishes.
        advantages: [B] advantages that replace the rows' ``advantage`` field (REINFORCE++'s
            step-level normalisation); None: the field as written.
        side_branches: with the ``trajectory`` field among ``fields``: agent episodes' side segments
            train too (``rollout.agent.train_branches``); earlier contexts of multi-segment episodes
            always do.
    """

    partition: str
    sample_ids: tuple[str, ...]
    fields: tuple[str, ...]
    version: int
    advantages: tuple[float, ...] | None = None
    side_branches: bool = False

    def __post_init__(self) -> None:
        assert self.advantages is None or len(self.advantages) == len(self.sample_ids), "one advantage per row"


class TrainerService(Protocol):
    """Trains on rows it reads from the bus and publishes each new version through the weight sync."""

    def train(self, ref: TrainRef) -> dict[str, float]:
        """Read ``ref``'s rows from the bus, collate them, take one update and publish the weights as
        ``ref.version``; returns the step's metrics (``train/*``, ``timing/train_s``,
        ``timing/bus_read_s``, ``timing/weight_sync_s``, ``weights/*``).

        Raises:
            DataError: a row of ``ref`` is not on the bus (retired, never put).
            WeightSyncError: the update produced weights the sync refused (non-finite, bad layout).
        """
        ...

    def rows_needed_after(self) -> int | None:
        """The policy version after which the service may read again the rows it trained on (a
        restarted trainer replays the updates since its newest checkpoint from the bus); the loop
        keeps the rows of later versions on the bus. None: it never reads a row twice.

        Call it after a checkpoint was saved (the service then forgets what the checkpoint covers)."""
        ...

    def sft(self, fields: Mapping[str, Any], lr: float) -> dict[str, float]:
        """One supervised update on demonstration rows (``token_ids``, ``loss_mask``,
        ``rollout_logprobs``) at learning rate ``lr``; returns ``sft/*`` metrics."""
        ...

    def end_sft(self, version: int) -> dict[str, float]:
        """End the warm-up and publish its weights as ``version`` (weight-sync metrics)."""
        ...

    def restore(self, trainer_state: dict[str, Any], version: int) -> None:
        """Continue from a checkpoint: load the trainer state and publish its weights as ``version``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The trainer state a checkpoint keeps (optimizer, schedules, counters)."""
        ...

    def save_model(self, path: Any) -> None:
        """Write the policy (weights and tokenizer) to folder ``path``."""
        ...

    def close(self) -> None:
        """Release the trainer (and its process, under Ray)."""


@dataclass
class Runtime:
    """A run's services and what the loop needs beside them.

    Attributes:
        rollout: plays groups into the bus.
        trainer: trains and publishes; None when only evaluating.
        train_tasks / heldout_tasks: the env's splits.
        decode: token ids -> text (responses in the rollout dumps).
        closers: called in order by :meth:`close`.
        step_hooks: called by the loop with each training step's metric row once it is complete
            (the trainer thread); each returns metrics added to the row (the Ray runtime's
            autoscaler, :mod:`relax_agent.runtime.autoscale`).
    """

    rollout: RolloutService
    trainer: TrainerService | None
    train_tasks: list[Task]
    heldout_tasks: list[Task]
    decode: Callable[[Sequence[int]], str]
    closers: list[Callable[[], None]] = field(default_factory=list)
    step_hooks: list[Callable[[Mapping[str, Any]], dict[str, float]]] = field(default_factory=list)

    def close(self) -> None:
        """Close every service (each closer runs even when an earlier one raised)."""
        errors = []
        for close in self.closers:
            try:
                close()
            except Exception as exc:  # close the rest; re-raise the first at the end
                errors.append(exc)
        self.closers = []
        if errors:
            raise errors[0]
