"""The schedule of the one control loop: which rollout groups may start, which may be trained.

Staleness control (``max_staleness = s``, ``B = rollout.tasks_per_step``):

- **Gate.** A group's *sample version* is the engine's policy version when the group starts.
  A new group starts only while ``started - dropped < (steps_done + s + 1) * B``: at most
  ``(s + 1) * B`` groups are live (running or queued), the queue never holds more than
  ``queue_capacity(B, s, G)`` rows, and a group started before step ``k`` completes is at
  most ``s`` versions behind when the trainer reaches it, unless it outlives ``s`` later
  steps of faster groups.
- **Budget.** No group starts that no remaining step could train: at most
  ``(steps - steps_trained) * B`` groups start in a run (plus one per drop), so the last steps
  do not share the machine with rollouts that would be thrown away.
- **Drop.** Such a long-tail group is dropped (acked, counted in ``async/dropped_groups``)
  instead of trained, so no trained sample ever lags more than ``s`` versions:
  ``trainer_version - sample_version <= s`` holds for every row of ``rollouts/*.jsonl``.
- **s = 0** is exactly on-policy: the B groups of step ``k`` start only after step ``k - 1``
  published its weights, so rollout and training take turns. ``mode: colocate`` is this
  schedule with the weights always copied in-process (``weights.transport: inproc``);
  ``mode: async`` takes any ``s`` and any transport.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np

STALENESS_MEAN = "async/staleness_mean"
STALENESS_MAX = "async/staleness_max"
STALENESS_HIST = "async/staleness"
DROPPED_GROUPS = "async/dropped_groups"
LIVE_GROUPS = "async/live_groups"
FILTERED_GROUPS = "dynamic_sampling/filtered_groups"
"""Groups of the step retired untrained because their rewards did not vary."""
DRAWN_GROUPS = "dynamic_sampling/drawn_groups"
"""Groups the trainer took for the step: trained, filtered and dropped as too stale."""
DS_CAP_REACHED = "dynamic_sampling/cap_reached"
"""1 when the step hit ``max_draws_per_step`` and kept a uniform group, else 0."""


class StalenessGate:
    """Admission control for new rollout groups (see the module docstring).

    Args:
        tasks_per_step: B, groups the trainer consumes per step.
        max_staleness: s >= 0.
        max_groups: groups the remaining steps can train (``remaining steps x B``); None: no bound.

    Counters: ``started`` groups, ``dropped`` (too stale, retired untrained), ``steps_done``.
    All methods run on the event loop's thread.
    """

    def __init__(self, tasks_per_step: int, max_staleness: int, max_groups: int | None = None) -> None:
        self.tasks_per_step = tasks_per_step
        self.max_staleness = max_staleness
        self.max_groups = max_groups
        self.started = 0
        self.dropped = 0
        self.steps_done = 0
        self._changed = asyncio.Event()

    def may_start(self) -> bool:
        """True while a new group fits: ``started - dropped < (steps_done + s + 1) * B`` and
        ``started - dropped < max_groups``."""
        live = self.started - self.dropped
        if self.max_groups is not None and live >= self.max_groups:
            return False
        return live < (self.steps_done + self.max_staleness + 1) * self.tasks_per_step

    async def admit(self) -> None:
        """Wait until a new group may start, and count it as started."""
        while not self.may_start():
            self._changed.clear()
            await self._changed.wait()
        self.started += 1

    def step_done(self) -> None:
        """Count a finished training step and wake admissions waiting on it."""
        self.steps_done += 1
        self._changed.set()

    def drop(self) -> None:
        """A started group was retired untrained (too stale, or filtered by dynamic sampling): its
        place goes to a new group."""
        self.dropped += 1
        self._changed.set()

    def too_stale(self, trainer_version: int, sample_version: int) -> bool:
        """True when training this sample now would exceed ``max_staleness``."""
        return trainer_version - sample_version > self.max_staleness


def staleness_metrics(staleness: list[int], max_staleness: int) -> dict[str, float]:
    """Mean, max and a histogram (``async/staleness/<k>``: samples k versions behind, k = 0..s)."""
    counts = Counter(staleness)
    out = {STALENESS_MEAN: float(np.mean(staleness)) if staleness else 0.0,
           STALENESS_MAX: float(max(staleness, default=0))}
    out.update({f"{STALENESS_HIST}/{k}": float(counts.get(k, 0)) for k in range(max_staleness + 1)})
    return out
