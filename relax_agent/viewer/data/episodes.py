"""An episode row of a rollout dump (or an evaluation sample): its group and index, whether it failed
or a weight update crossed it, the filter the pages apply, and the numbers read from it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from relax_agent.errors import ConfigError

_SAMPLE_ID = re.compile(r"^(?P<group>.+)/(?P<index>\d+)(?P<seg>/(?:seg|ctx)\d+)?$")


def group_of(sample_id: str) -> tuple[str, int]:
    """``(group id, index in the group)`` of a sample id ``"{group_id}/{index}"`` (an agent's later
    segment ``".../{index}/segK"`` and an earlier context ``".../{index}/ctxK"`` belong to the same group
    and index). Ids of another shape are
    their own group, index 0."""
    m = _SAMPLE_ID.match(sample_id)
    if not m:
        return sample_id, 0
    return m.group("group"), int(m.group("index"))


def is_failed(row: dict[str, Any]) -> bool:
    """The episode has no usable reward: its reward status is not ``ok``, it carries an error, or the
    reward is missing / not finite (the same rule as ``Trajectory.trainable``)."""
    reward = row.get("reward")
    return (str(row.get("reward_status", "ok")) != "ok" or bool(row.get("error"))
            or not isinstance(reward, (int, float)) or not math.isfinite(reward))


def crossed_update(row: dict[str, Any]) -> bool:
    """A weight update landed inside one of the episode's turns (a turn's ``token_versions`` holds
    more than one policy version)."""
    return any(len(set(v or ())) > 1 for v in row.get("token_versions") or ())


@dataclass(frozen=True)
class EpisodeFilter:
    """Which episodes / samples to keep (all ``None``: keep all).

    Attributes:
        failed: True keeps only failed episodes (see :func:`is_failed`; for evaluation samples: not
            correct), False only the others.
        min_reward, max_reward: inclusive reward bounds; a failed episode without a reward never
            passes a bound.
        stop_reason: keep only this stop reason (e.g. "length", "max_turns", "env_error").
        crossed: True keeps only episodes a weight update crossed, False only the others.
    """

    failed: bool | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    stop_reason: str | None = None
    crossed: bool | None = None

    def __post_init__(self) -> None:
        for name in ("min_reward", "max_reward"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ConfigError(f"{name}={v!r}: expected a finite number")
        if self.min_reward is not None and self.max_reward is not None and self.min_reward > self.max_reward:
            raise ConfigError(f"min_reward={self.min_reward} > max_reward={self.max_reward}: expected min <= max")

    def keep(self, row: dict[str, Any], failed: bool, stop_reason: str) -> bool:
        """Whether ``row`` (an episode or evaluation sample whose failure and stop reason the caller
        decided) passes the filter."""
        if self.failed is not None and failed != self.failed:
            return False
        if self.stop_reason and stop_reason != self.stop_reason:
            return False
        if self.crossed is not None and crossed_update(row) != self.crossed:
            return False
        if self.min_reward is not None or self.max_reward is not None:
            r = row.get("reward")
            if not isinstance(r, (int, float)) or not math.isfinite(r):
                return False
            if self.min_reward is not None and r < self.min_reward:
                return False
            if self.max_reward is not None and r > self.max_reward:
                return False
        return True
