"""Runs groups of episodes concurrently through one rollout driver (whose engine batches them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relax_agent.records import Trajectory
from relax_agent.rollout import rewarding
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec, PlaysEnv, RolloutDriver
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams
from relax_agent.rollout.env_driver import EnvDriver
from relax_agent.rollout.parsers import ToolCallParser


@dataclass(frozen=True)
class RolloutLimits:
    """Per-episode limits (see :class:`~relax_agent.rollout.driver.EpisodeSpec`)."""

    max_turns: int = 1
    max_total_tokens: int = 2048
    step_timeout_s: float = 60.0
    episode_timeout_s: float = 1800.0
    context: Any = None
    """``rollout.context`` (:class:`~relax_agent.rollout.config.ContextConfig`); None: ``truncate``."""


def episode_specs(tasks: Sequence[dict[str, Any]], group_size: int, prefix: str, seed: int,
                  limits: RolloutLimits) -> list[EpisodeSpec]:
    """Episode specs for ``tasks``, ``group_size`` each, under ``limits``; ids are
    ``{prefix}/g{task index}/{i}``, episode ``i`` of task ``g`` is seeded ``seed + g * group_size + i``.
    Pure: needs no engine (the driver of a ``runtime: ray`` run makes them without a model)."""
    out = []
    for g, task in enumerate(tasks):
        group_id = f"{prefix}/g{g}"
        for i in range(group_size):
            out.append(EpisodeSpec(
                sample_id=f"{group_id}/{i}", group_id=group_id, task_id=str(task["id"]), task=task,
                seed=seed + g * group_size + i, max_turns=limits.max_turns, max_total_tokens=limits.max_total_tokens,
                step_timeout_s=limits.step_timeout_s, episode_timeout_s=limits.episode_timeout_s,
                context=limits.context,
            ))
    return out


def _env_driver(make_env: Callable[[], Any] | None, engine: InferenceEngine | None, renderer: ChatRenderer | None,
                parser: ToolCallParser | None) -> EnvDriver:
    """``EnvDriver(make_env, engine, renderer, parser)``; TypeError when one of them is None."""
    if make_env is None or engine is None or renderer is None or parser is None:
        raise TypeError("RolloutRunner without a driver needs make_env, engine, renderer and parser")
    return EnvDriver(make_env, engine, renderer, parser)


class RolloutRunner:
    """Plays GRPO groups: ``group_size`` episodes per task, all concurrently.

    Args:
        make_env: builds a fresh environment per episode (episodes never share one).
        engine: the inference engine; concurrent requests are batched by the engine.
        renderer: chat renderer for prompts and observation deltas.
        parser: tool-call parser.
        limits: turn, token and time limits.
        reward: a ``RewardFunction`` that re-scores each finished episode; None keeps the env's reward.
        env_id: recorded in reward requests' metadata.
        driver: plays each episode; default ``EnvDriver(make_env, engine, renderer, parser)``.
            A driver of its own (e.g. agent-driven) needs none of those four: pass None for them.

    Raises:
        TypeError: no ``driver`` and one of those four is None.

    Attributes:
        engine: the driver's engine (the loop reads its ``policy_version`` and loads weights into it).
    """

    def __init__(self, make_env: Callable[[], Any] | None, engine: InferenceEngine | None,
                 renderer: ChatRenderer | None, parser: ToolCallParser | None, limits: RolloutLimits,
                 reward: Any = None, env_id: str = "", driver: RolloutDriver | None = None):
        self.driver = driver if driver is not None else _env_driver(make_env, engine, renderer, parser)
        self.engine = self.driver.engine
        self.reward = reward
        self.env_id = env_id
        self.limits = limits

    def env_player(self) -> PlaysEnv | None:
        """The driver when it plays an env with a renderer and parser (:class:`PlaysEnv`); None for a
        driver of its own kind."""
        return self.driver if isinstance(self.driver, PlaysEnv) else None

    def specs(self, tasks: Sequence[dict[str, Any]], group_size: int, prefix: str, seed: int) -> list[EpisodeSpec]:
        """Episode specs for ``tasks``, ``group_size`` each (see :func:`episode_specs`)."""
        return episode_specs(tasks, group_size, prefix, seed, self.limits)

    async def run(self, specs: Sequence[EpisodeSpec], params: SamplingParams,
                  on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Play every spec concurrently; results come back in spec order.

        Every spec yields exactly one trajectory (the driver's contract): an env that cannot be
        built, a failing step, a timeout are failed records with their cause. Finished episodes
        are then scored by ``reward`` (failed ones pass through), and ``on_done`` sees each.
        """

        async def one(spec: EpisodeSpec) -> Trajectory:
            traj = await self.driver.play(spec, params)
            if self.reward is not None:
                traj = await rewarding.score(self.reward, traj, spec.task, self.env_id)
            if on_done is not None:
                on_done(traj)
            return traj

        return list(await asyncio.gather(*(one(s) for s in specs)))
