"""A scripted :class:`RewardFunction` for tests of code that consumes rewards."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from relax_agent.reward_services.protocol import RewardItem, RewardResult, RewardStatus


class FakeReward:
    """Scores items from a table or a function, fails the ids it is told to, records calls.

    Args:
        rewards: a constant, a mapping id -> reward (missing ids score ``default``), or a
            function of the item.
        fail: id -> status (error/timeout) to answer for that id.
        delay_s: sleep before answering each ``score`` call.
        default: reward for ids missing from a ``rewards`` mapping.

    Attributes:
        calls: the ids of each ``score`` call, in order.
        closed: True after ``aclose``.
    """

    def __init__(self, rewards: float | Mapping[str, float] | Callable[[RewardItem], float] = 1.0, *,
                 fail: Mapping[str, RewardStatus | str] | None = None, delay_s: float = 0.0, default: float = 0.0):
        self._rewards = rewards
        self._fail = {k: RewardStatus(v) for k, v in (fail or {}).items()}
        self._delay_s = delay_s
        self._default = default
        self.calls: list[list[str]] = []
        self.closed = False

    def _reward(self, item: RewardItem) -> float:
        if callable(self._rewards):
            return float(self._rewards(item))
        if isinstance(self._rewards, Mapping):
            return float(self._rewards.get(item.id, self._default))
        return float(self._rewards)

    async def score(self, items: list[RewardItem]) -> list[RewardResult]:
        """Record the ids in :attr:`calls`, wait the configured delay, then the scripted reward per item
        (a failed result for an id told to fail)."""
        self.calls.append([i.id for i in items])
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        return [RewardResult.failed(i.id, self._fail[i.id], "scripted failure") if i.id in self._fail
                else RewardResult(id=i.id, reward=self._reward(i)) for i in items]

    async def aclose(self) -> None:
        """Mark the reward closed."""
        self.closed = True
