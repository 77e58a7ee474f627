"""The rollout driver protocol: who plays one episode.

A :class:`RolloutDriver` turns one :class:`EpisodeSpec` into one
:class:`~relax_agent.records.Trajectory`, always: a fault of the episode (env bug, timeout,
template refusal) is a failed record with its cause, never an exception. The runner and the
control loop only see drivers, so the env-driven loop (:class:`~relax_agent.rollout.env_driver.EnvDriver`)
and an agent-driven one (an OpenAI-compatible endpoint the agent calls) are interchangeable.
Drivers build their records with :class:`~relax_agent.rollout.recorder.TrajectoryRecorder`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from relax_agent.records import Trajectory
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams

T = TypeVar("T")


@dataclass(frozen=True)
class EpisodeSpec:
    """Identity and limits of one episode.

    Attributes:
        sample_id / group_id / task_id: ids recorded on the trajectory.
        task: the task dict passed as ``env.reset(options={"task": task})``.
        seed: seed passed to ``env.reset``; turn k samples with engine seed ``seed * 1009 + k``.
        max_turns: assistant turns before the episode is truncated.
        max_total_tokens: token budget for prompt + turns + observations; checked before every
            engine call and env step (a reply cut by it is not sent to the env, an observation
            that does not fit ends the episode), so only a prompt alone can exceed it.
        step_timeout_s: most seconds one env call (build, ``reset``, ``step``, ``close``) may take.
        episode_timeout_s: most seconds the whole episode may take (env calls and engine calls
            together, ``close`` excepted); past it the episode is a failed record with reward
            status "timeout".
        context: what a full context does (:class:`~relax_agent.rollout.config.ContextConfig`,
            ``rollout.context``); None: the episode ends (``truncate``). ``max_total_tokens`` then bounds
            each context.
    """

    sample_id: str
    group_id: str
    task_id: str
    task: dict[str, Any]
    seed: int
    max_turns: int = 1
    max_total_tokens: int = 2048
    step_timeout_s: float = 60.0
    episode_timeout_s: float = 1800.0
    context: Any = None


@runtime_checkable
class RolloutDriver(Protocol):
    """Plays episodes; one call per episode, many concurrently.

    Attributes:
        engine: the inference engine that samples the policy's turns (its ``policy_version``
            is recorded on every turn).
    """

    engine: InferenceEngine

    async def play(self, spec: EpisodeSpec, params: SamplingParams) -> Trajectory:
        """Play the episode ``spec`` to its end with sampling ``params``.

        Returns:
            Its trajectory; a failed record (``error`` set, reward status "error" or
            "timeout") when the episode could not be played. Returns within about
            ``spec.episode_timeout_s`` (plus the time to release its resources).
        """
        ...


@runtime_checkable
class PlaysEnv(Protocol):
    """A driver that plays a gymnasium env with a renderer and a tool-call parser
    (:class:`~relax_agent.rollout.env_driver.EnvDriver`,
    :class:`~relax_agent.rollout.agent_driver.AgentDriver`): what the warm-up renders
    demonstrations with and what evaluation replays an episode's actions with.

    Attributes:
        make_env: builds a fresh env (one per episode).
        renderer: the chat renderer of the policy.
        parser: the tool-call parser (:class:`~relax_agent.rollout.parsers.ToolCallParser`).
    """

    make_env: Callable[[], Any]
    renderer: Any
    parser: Any


class EpisodeTimeout(TimeoutError):
    """A call of a driver ran past its limit; ``str()`` is the cause recorded on the trajectory.

    Control flow inside drivers only: it becomes a failed record, never reaches a caller.
    """


class Deadline:
    """The wall-clock end of one episode (``time.monotonic`` seconds).

    Args:
        timeout_s: seconds from now the episode may take.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s

    @property
    def remaining_s(self) -> float:
        """Seconds left until the deadline (negative once it has passed)."""
        return self.at - time.monotonic()

    async def call(self, awaitable: Awaitable[T], what: str, limit_s: float | None = None,
                   limit_cause: str = "") -> T:
        """Await ``awaitable`` until it is done, the episode's end, or ``limit_s``, whichever is first.

        A call past its time is cancelled and *abandoned*: the episode does not wait for it, so
        an async env that ignores cancellation cannot keep the episode (or its reward) alive.

        Raises:
            EpisodeTimeout: ``limit_cause`` when ``limit_s`` ran out first, else
                "episode exceeded episode_timeout_s=... during {what}".
        """
        remaining = self.remaining_s
        if limit_s is not None and limit_s < remaining:
            return await call_within(awaitable, limit_s, limit_cause)
        return await call_within(awaitable, remaining, f"episode exceeded episode_timeout_s={self.timeout_s} during {what}")


async def call_within(awaitable: Awaitable[T], timeout_s: float, cause: str) -> T:
    """``await awaitable`` for at most ``timeout_s`` seconds, then cancel it without waiting.

    Unlike ``asyncio.wait_for``, a call that swallows its cancellation is not waited for (and its
    late result is dropped). Cancelling the caller cancels the call.

    Raises:
        EpisodeTimeout: with ``cause``, when the call was not done in time.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(timeout_s, 0.0))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    task.add_done_callback(_drop_result)
    raise EpisodeTimeout(cause)


def _drop_result(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so an abandoned call's late error is not logged as unhandled
