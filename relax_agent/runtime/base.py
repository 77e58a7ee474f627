"""The services the control loop talks to, wherever they run.

The loop never touches an engine or a model: it asks a :class:`RolloutService` to play a
group (the service writes the group's rows into the data bus itself), reads fields back from
the bus, and hands a step's rows to a :class:`TrainerService`, which trains and publishes the
new policy version through the weight sync. A runtime (``local`` in this process; Ray actors
or Serve deployments elsewhere) implements both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

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

    def close(self) -> None: ...


class TrainerService(Protocol):
    """Trains on rows read from the bus and publishes each new version through the weight sync."""

    def train(self, fields: Mapping[str, Any], version: int) -> dict[str, float]:
        """Collate ``fields`` (B rows of :data:`relax_agent.records.TRAIN_FIELDS`, plus the routing
        fields for replay), take one update, publish the weights as ``version``; returns the
        step's metrics (``train/*``, ``timing/train_s``, ``timing/weight_sync_s``, ``weights/*``).

        Raises:
            WeightSyncError: the update produced weights the sync refused (non-finite, bad layout).
        """
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

    def close(self) -> None: ...


@dataclass
class Runtime:
    """A run's services and what the loop needs beside them.

    Attributes:
        rollout: plays groups into the bus.
        trainer: trains and publishes; None when only evaluating.
        train_tasks / heldout_tasks: the env's splits.
        decode: token ids -> text (responses in the rollout dumps).
        closers: called in order by :meth:`close`.
    """

    rollout: RolloutService
    trainer: TrainerService | None
    train_tasks: list[Task]
    heldout_tasks: list[Task]
    decode: Callable[[Sequence[int]], str]
    closers: list[Callable[[], None]] = field(default_factory=list)

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
