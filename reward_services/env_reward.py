"""The environment's own reward as a :class:`RewardFunction` (``source: env``).

The rollout puts the episode's return (the sum of the env's step rewards) into
``item.metadata["env_reward"]``; this reward passes it through, so an env reward can be
combined with local or remote components like any other.
"""

from __future__ import annotations

from relax_agent.reward_services.protocol import RewardItem, RewardResult, RewardStatus, check_number

ENV_REWARD_KEY = "env_reward"
"""``RewardItem.metadata`` key holding the episode return computed by the environment."""


class EnvReward:
    """Reads ``metadata["env_reward"]``; an item without a number finite in float32 there is an error result."""

    async def score(self, items: list[RewardItem]) -> list[RewardResult]:
        """Each item's ``metadata["env_reward"]`` as its reward (an error result when it is missing or not
        finite in float32)."""
        return [self._one(item) for item in items]

    @staticmethod
    def _one(item: RewardItem) -> RewardResult:
        value = item.metadata.get(ENV_REWARD_KEY)
        try:
            reward = check_number(value, f"metadata[{ENV_REWARD_KEY!r}] (the env's episode return)")
        except ValueError as exc:
            return RewardResult.failed(item.id, RewardStatus.ERROR, str(exc))
        return RewardResult(id=item.id, reward=reward)

    async def aclose(self) -> None:
        """Nothing to release."""
        return None
