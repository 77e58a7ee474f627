"""Scoring finished episodes with a configured reward (local function, service, or a mix).

The env's own return travels in ``metadata["env_reward"]``, so ``source: env`` components
can be mixed with remote ones. A reward that could not be obtained marks the trajectory
``reward_status="error"``/``"timeout"``: it is masked out of the gradient and counted,
never turned into a reward of 0.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from relax_agent.records import Trajectory
from relax_agent.reward_services import ENV_REWARD_KEY, RewardConfig, RewardFunction, RewardItem


def needs_scoring(cfg: RewardConfig) -> bool:
    """False when the config is just the env's own reward (nothing to call)."""
    return not (len(cfg.components) == 1 and cfg.components[0].source == "env" and cfg.components[0].weight == 1.0)


def reward_item(traj: Trajectory, task: dict[str, Any], env_id: str) -> RewardItem:
    """The reward request for one trajectory: conversation before the last answer, the answer,
    the task as ground truth, and the env's return in metadata."""
    msgs = list(traj.messages)
    last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=None)
    response = {k: v for k, v in msgs[last].items() if k != "parse_errors"} if last is not None else ""
    return RewardItem(
        id=traj.sample_id, messages=msgs[:last] if last is not None else msgs, response=response,
        ground_truth=task, metadata={ENV_REWARD_KEY: traj.reward, "task_id": traj.task_id, "env_id": env_id},
    )


async def score(reward: RewardFunction, traj: Trajectory, task: dict[str, Any], env_id: str) -> Trajectory:
    """``traj`` with its reward replaced by the configured reward's verdict (failed episodes pass through)."""
    if traj.error is not None:
        return traj
    (result,) = await reward.score([reward_item(traj, task, env_id)])
    metrics = {**traj.metrics, **{f"reward/{k}": float(v) for k, v in result.metrics.items()}}
    if result.ok:
        return replace(traj, reward=float(result.reward), metrics=metrics)
    cause = str(result.extra.get("error", "reward unavailable"))
    return replace(traj, reward=0.0, reward_status=result.status.value, metrics=metrics, error=f"reward: {cause}")
