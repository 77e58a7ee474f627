"""Runs groups of episodes concurrently against one engine (which batches them)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from relax_agent.rollout import rewarding
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams
from relax_agent.envs.tool_env import call_in_thread
from relax_agent.rollout.orchestrator import EpisodeSpec, failed_episode, run_episode
from relax_agent.rollout.parsers import ToolCallParser
from relax_agent.records import Trajectory


@dataclass(frozen=True)
class RolloutLimits:
    """Per-episode limits (see :class:`EpisodeSpec`)."""

    max_turns: int = 1
    max_total_tokens: int = 2048
    step_timeout_s: float = 60.0


class RolloutRunner:
    """Plays GRPO groups: ``group_size`` episodes per task, all concurrently.

    Args:
        make_env: builds a fresh environment per episode (episodes never share one).
        engine: the inference engine; concurrent requests are batched by the engine.
        renderer: chat renderer for prompts and observation deltas.
        parser: tool-call parser.
        limits: turn and token limits.
        reward: a ``RewardFunction`` that re-scores each finished episode; None keeps the env's reward.
        env_id: recorded in reward requests' metadata.
    """

    def __init__(self, make_env: Callable[[], Any], engine: InferenceEngine, renderer: ChatRenderer,
                 parser: ToolCallParser, limits: RolloutLimits, reward: Any = None, env_id: str = ""):
        self.make_env = make_env
        self.reward = reward
        self.env_id = env_id
        self.engine = engine
        self.renderer = renderer
        self.parser = parser
        self.limits = limits

    def specs(self, tasks: Sequence[dict[str, Any]], group_size: int, prefix: str, seed: int) -> list[EpisodeSpec]:
        """Episode specs for ``tasks``, ``group_size`` each; ids are ``{prefix}/{task}/{i}``."""
        out = []
        for g, task in enumerate(tasks):
            group_id = f"{prefix}/g{g}"
            for i in range(group_size):
                out.append(EpisodeSpec(
                    sample_id=f"{group_id}/{i}", group_id=group_id, task_id=str(task["id"]), task=task,
                    seed=seed + g * group_size + i, max_turns=self.limits.max_turns,
                    max_total_tokens=self.limits.max_total_tokens, step_timeout_s=self.limits.step_timeout_s,
                ))
        return out

    async def run(self, specs: Sequence[EpisodeSpec], params: SamplingParams,
                  on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Play every spec concurrently; results come back in spec order.

        Every spec yields exactly one trajectory: an env that cannot be built (raises, or takes
        longer than ``step_timeout_s``) gives a failed record with the cause, like a failing step.
        Synchronous env calls (building included) run in a daemon thread each, so slow tools
        overlap and a hung one cannot hold up the run (see :mod:`relax_agent.rollout.orchestrator`).
        """

        async def one(spec: EpisodeSpec) -> Trajectory:
            try:
                env = await asyncio.wait_for(call_in_thread(self.make_env), spec.step_timeout_s)
            except Exception as exc:  # a broken env constructor is a failed episode, not a crashed run
                traj = failed_episode(spec, exc, during="make_env")
            else:
                traj = await run_episode(env, spec, self.engine, self.renderer, self.parser, params)
            if self.reward is not None:
                traj = await rewarding.score(self.reward, traj, spec.task, self.env_id)
            if on_done is not None:
                on_done(traj)
            return traj

        return list(await asyncio.gather(*(one(s) for s in specs)))
