"""Rollout autoscaling (``runtime.autoscale``): add a replica while the trainer waits for data, drain
one while the replicas wait for the trainer.

The signal is the trainer's idle fraction of each step, ``timing/data_wait_s / timing/step_s`` of the
loop's metric row: with rollout the bottleneck the trainer waits for groups; with the trainer the
bottleneck the groups wait for it (the replicas sit at the staleness gate) and its wait is near 0.
This is the signal Relax's and AReaL's rollout autoscalers act on (trainer starvation against
rollout back-pressure), reduced to one number the loop already measures; queue depth would say the
same thing later (the bus fills only once the gate lets groups run ahead).

The decision (:meth:`Autoscaler.decide`) is a pure function of the rows seen, the current target and
the bound, so it is tested without Ray; the Ray runtime calls :meth:`Autoscaler.observe` from the
loop's step hook and applies the decision through the supervisor's ``scale``, the same path as
``relax-agent scale``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

from relax_agent import metrics as M

log = logging.getLogger("relax_agent.runtime")

IDLE_FRACTION = "runtime/trainer_idle_frac"
"""The window's mean trainer idle fraction the last decision looked at (absent until a window is full)."""
AUTOSCALE = "runtime/autoscale"
"""The step's decision: +1 (a replica added), -1 (one drained), 0 (none)."""


class ReplicaTarget(Protocol):
    """What the autoscaler drives: the Ray supervisor (:class:`~relax_agent.runtime.ray_supervisor.Supervisor`)
    or a fake in tests."""

    target: int

    def scale(self, replicas: int) -> Any:
        """Set the rollout replica target (raises ``ConfigError`` beyond the bound)."""

    def max_replicas(self) -> tuple[int, str]:
        """The most replicas :meth:`scale` accepts now, and what sets that bound."""


class Autoscaler:
    """Decides, after each training step, whether to add or drain a rollout replica.

    Args:
        cfg: ``runtime.autoscale`` (:class:`~relax_agent.config.AutoscaleConfig`).
        replicas: the supervisor whose target it moves.
        max_rollout_replicas: ``runtime.max_rollout_replicas`` (the bound when
            ``cfg.max_replicas`` is None).
    """

    def __init__(self, cfg: Any, replicas: ReplicaTarget, max_rollout_replicas: int) -> None:
        self.cfg = cfg
        self.replicas = replicas
        self.upper = cfg.max_replicas if cfg.max_replicas is not None else max_rollout_replicas
        self.window: deque[float] = deque(maxlen=cfg.window_steps)
        self.steps_seen = 0
        self.cooldown = 0
        self.last_mean: float | None = None
        """The window mean the last step was judged on (None: that step was not judged)."""

    @staticmethod
    def idle_fraction(row: Mapping[str, Any]) -> float | None:
        """``timing/data_wait_s / timing/step_s`` of a step's metric row, in [0, 1]; None when the row
        has no positive step time."""
        step_s = float(row.get(M.STEP_TIME, 0.0) or 0.0)
        if step_s <= 0.0:
            return None
        return min(max(float(row.get(M.DATA_WAIT, 0.0) or 0.0) / step_s, 0.0), 1.0)

    def decide(self, idle: float | None, target: int, bound: int) -> int:
        """The new replica target after a step whose trainer idle fraction was ``idle`` (None: not
        measured, no decision), given the current ``target`` and the cluster's ``bound``.

        The first step is not counted (it waits for the replicas' start); a step in the cooldown
        after a change is not counted either; a decision needs a full window."""
        self.steps_seen += 1
        self.last_mean = None
        if idle is None or self.steps_seen == 1:
            return target
        if self.cooldown > 0:
            self.cooldown -= 1
            return target
        self.window.append(idle)
        if len(self.window) < self.cfg.window_steps:
            return target
        mean = self.last_mean = sum(self.window) / len(self.window)
        upper = min(self.upper, bound)
        if mean > self.cfg.scale_up_above and target < upper:
            new = target + 1
        elif mean < self.cfg.scale_down_below and target > self.cfg.min_replicas:
            new = target - 1
        elif target > upper:  # the cluster shrank (a host left): follow it down
            new = upper
        else:
            return target
        self.window.clear()
        self.cooldown = self.cfg.cooldown_steps
        return new

    def observe(self, row: Mapping[str, Any]) -> dict[str, float]:
        """The loop's step hook: decide from ``row`` (a step's metric row) and apply the decision to the
        supervisor; returns the metrics to add to the row (:data:`AUTOSCALE`, :data:`IDLE_FRACTION`)."""
        target = self.replicas.target
        bound, why = self.replicas.max_replicas()
        new = self.decide(self.idle_fraction(row), target, bound)
        out: dict[str, float] = {AUTOSCALE: float((new > target) - (new < target))}
        if self.last_mean is not None:
            out[IDLE_FRACTION] = self.last_mean
        if new != target:
            self.replicas.scale(new)
            log.info("autoscale: the trainer waited for data %.0f%% of the last %d steps; rollout replicas %d -> %d%s",
                     100 * (self.last_mean or 0.0), self.cfg.window_steps, target, new,
                     self._bound_note(new, target, bound, why))
        return out

    def _bound_note(self, new: int, target: int, bound: int, why: str) -> str:
        """" (the bound: ...)" when a step up reached the bound, naming what sets it; "" otherwise."""
        if new <= target or new < min(self.upper, bound):
            return ""
        if bound < self.upper:
            return f" (the bound: {why})"
        key = "runtime.autoscale.max_replicas" if self.cfg.max_replicas is not None else "runtime.max_rollout_replicas"
        return f" (the bound: {key}={self.upper})"
