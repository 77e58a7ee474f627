"""Weighted combination of rewards: ``reward = sum_k weight_k * reward_k``.

All components score the same items concurrently. A combined result is ok only if every
component is ok for that item; otherwise it is ``timeout`` when every failed component timed
out, else ``error``, with no reward (never a partial sum). Metrics are namespaced per
component: ``<name>/reward`` and ``<name>/<metric>``; ``extra["components"]`` keeps each
component's status, reward and error.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from relax_agent.errors import ConfigError
from relax_agent.reward_services.protocol import (
    ERROR_KEY,
    ChecksAtStart,
    RewardFunction,
    RewardItem,
    RewardResult,
    RewardStatus,
    check_number,
)


@dataclass(frozen=True)
class Component:
    """One weighted term of a :class:`CombinedReward`."""

    name: str
    weight: float
    reward: RewardFunction


class CombinedReward:
    """A :class:`RewardFunction` that sums weighted components.

    Raises:
        ConfigError: no components, duplicate names, or a non-finite weight.
    """

    def __init__(self, components: list[Component]):
        if not components:
            raise ConfigError("a combined reward needs at least one component")
        names = [c.name for c in components]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"reward component names must be unique; repeated: {dupes}")
        for c in components:
            if not math.isfinite(c.weight):
                raise ConfigError(f"reward component {c.name!r} has non-finite weight {c.weight!r}")
        self.components = list(components)

    async def score(self, items: list[RewardItem]) -> list[RewardResult]:
        """Score ``items`` with every component concurrently; per item, the weighted sum of the
        components' rewards (an error when a component failed for it, see :meth:`_combine`)."""
        per_component = await asyncio.gather(*(c.reward.score(items) for c in self.components))
        for c, results in zip(self.components, per_component, strict=True):
            assert [r.id for r in results] == [i.id for i in items], f"component {c.name} broke result order"
        return [self._combine(item.id, [rs[k] for rs in per_component]) for k, item in enumerate(items)]

    def _combine(self, item_id: str, parts: list[RewardResult]) -> RewardResult:
        metrics: dict[str, float] = {}
        summary: dict[str, dict[str, object]] = {}
        for c, r in zip(self.components, parts, strict=True):
            summary[c.name] = {"status": r.status.value, "reward": r.reward, "weight": c.weight}
            if not r.ok:
                summary[c.name][ERROR_KEY] = r.extra.get(ERROR_KEY)
                continue
            metrics[f"{c.name}/reward"] = r.reward  # type: ignore[assignment]
            metrics.update({f"{c.name}/{k}": v for k, v in r.metrics.items()})
        failed = [(c.name, r) for c, r in zip(self.components, parts, strict=True) if not r.ok]
        if failed:
            status = RewardStatus.TIMEOUT if all(r.status is RewardStatus.TIMEOUT for _, r in failed) else RewardStatus.ERROR
            cause = "; ".join(f"{name}: {r.extra.get(ERROR_KEY, r.status.value)}" for name, r in failed)
            return RewardResult(id=item_id, status=status, metrics=metrics, extra={ERROR_KEY: cause, "components": summary})
        total = sum(c.weight * r.reward for c, r in zip(self.components, parts, strict=True))  # type: ignore[operator]
        try:
            check_number(total, "the weighted sum of the components")
        except ValueError as exc:
            return RewardResult(id=item_id, status=RewardStatus.ERROR, metrics=metrics,
                                extra={ERROR_KEY: str(exc), "components": summary})
        return RewardResult(id=item_id, reward=total, metrics=metrics, extra={"components": summary})

    async def check(self) -> None:
        """Run every component's start-up check (see :func:`check_reward`)."""
        await asyncio.gather(*(check_reward(c.reward) for c in self.components))

    async def aclose(self) -> None:
        """Close each distinct component reward function once."""
        seen: set[int] = set()
        for c in self.components:
            if id(c.reward) not in seen:
                seen.add(id(c.reward))
                await c.reward.aclose()


async def check_reward(reward: RewardFunction) -> None:
    """Await ``reward.check()`` where the reward has one (remote clients, combinations).

    Raises:
        AuthError, RewardServiceError: see :meth:`RewardClient.check`.
    """
    if isinstance(reward, ChecksAtStart):
        await reward.check()
