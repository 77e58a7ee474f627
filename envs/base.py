"""Base class for text/tool environments: a real ``gymnasium.Env`` over chat messages.

Contract (docs/design/index.md): ``reset(seed, options={"task": task})`` returns the opening messages and
``info["tools"]`` (JSON schemas); ``step(action)`` takes one assistant message (``content``
plus parsed ``tool_calls``) and returns ``(new_messages, reward, terminated, truncated, info)``.
Tasks come from :meth:`TextEnv.tasks`; the trainer samples them and passes one per reset.
An env may also define ``async def areset(...)`` and ``async def astep(action)`` with the same
returns; the rollout driver then awaits them instead of running ``reset``/``step`` in a
worker thread. For tool envs, :class:`relax_agent.envs.ToolEnv` does the tool plumbing; check any
env with :mod:`relax_agent.envs.testing`.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import gymnasium as gym

from relax_agent.envs.spaces import ConversationSpace, MessageSpace


@runtime_checkable
class SteppedAsync(Protocol):
    """An env with ``async def areset`` and ``async def astep`` (the same returns as ``reset`` and
    ``step``): the rollout driver awaits them instead of running the sync methods in a thread.
    :func:`steps_async` also checks that both are coroutine functions."""

    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        """Like ``reset``, awaited."""
        ...

    async def astep(self, action: dict[str, Any]) -> Any:
        """Like ``step``, awaited."""
        ...


def steps_async(env: Any) -> bool:
    """True when ``env`` is :class:`SteppedAsync` with both methods ``async def``."""
    return (isinstance(env, SteppedAsync) and inspect.iscoroutinefunction(env.areset)
            and inspect.iscoroutinefunction(env.astep))


@runtime_checkable
class HasTasks(Protocol):
    """An env (its ``unwrapped``) that lists its dataset: what the trainer samples tasks from."""

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """The task dicts of ``split`` ("train" or "heldout"), each with a unique ``"id"``."""
        ...


@runtime_checkable
class DescribesReward(Protocol):
    """An env that says in words how it scores (``relax-agent envs describe`` prints it).

    Attributes:
        reward_description: one or two sentences; empty when not described.
    """

    reward_description: str


@runtime_checkable
class DeclaresTools(Protocol):
    """An env whose tools are known before a reset (:class:`~relax_agent.envs.ToolEnv`).

    Attributes:
        tool_schemas: the OpenAI function schemas the policy is offered.
    """

    tool_schemas: list[dict[str, Any]]


class TextEnv(gym.Env):
    """A gymnasium environment whose observations and actions are chat messages.

    Subclasses implement :meth:`tasks`, :meth:`_reset_task` and :meth:`step`.
    """

    metadata = {"render_modes": []}
    reward_description: str = ""
    split: str = "train"
    """The split ``reset`` draws a task from when ``options`` holds none."""

    def __init__(self) -> None:
        self.observation_space = ConversationSpace()
        self.action_space = MessageSpace()
        self.task: dict[str, Any] | None = None

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """The dataset: a list of task dicts, each with a unique ``"id"``.

        Args:
            split: "train" or "heldout" (deterministic, disjoint).

        Raises:
            DataError: unknown split.
        """
        raise NotImplementedError

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode on ``options["task"]``, or on a task of ``split`` drawn with ``seed``.

        Returns:
            (observation, info) of :meth:`_reset_task`: the opening messages and the task's info.
        """
        super().reset(seed=seed)
        task = (options or {}).get("task")
        if task is None:
            pool = self.tasks(self.split)
            task = pool[int(self.np_random.integers(len(pool)))]
        self.task = task
        return self._reset_task(task)

    def _reset_task(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        raise NotImplementedError
