"""How a rollout driver calls a gymnasium-style env: bounded calls and checked return values.

Shared by the env driver, the agent driver and the media driver. :class:`EnvCalls` awaits an
env's ``areset``/``astep`` when it has them (also under ``gymnasium.make``'s standard wrappers)
and otherwise runs the sync methods in a daemon thread, each call bounded by
``step_timeout_s`` and the episode's deadline. :func:`check_reset` and :func:`check_step`
turn a malformed return value into an :class:`EnvError` naming what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from relax_agent.envs.base import steps_async
from relax_agent.envs.spaces import is_message
from relax_agent.envs.tool_env import call_in_thread
from relax_agent.errors import EnvError
from relax_agent.rollout.driver import Deadline, EpisodeSpec, call_within


def step_timeout_cause(spec: EpisodeSpec) -> str:
    """The failure cause recorded for an env call that ran past ``spec.step_timeout_s``."""
    return f"env call exceeded step_timeout_s={spec.step_timeout_s}"


_MAKE_WRAPPERS = frozenset({"TimeLimit", "OrderEnforcing", "PassiveEnvChecker"})
"""Wrappers ``gymnasium.make`` adds; the async path stands in for them (TimeLimit via the spec)."""


@dataclass
class EnvCalls:
    """How the driver calls one env: its async ``areset``/``astep`` when the env has them (the
    env's own, or the unwrapped env's under ``gymnasium.make``'s standard wrappers), else the
    sync methods in a worker thread; each call bounded by ``step_timeout_s`` and the deadline."""

    env: Any
    spec: EpisodeSpec
    deadline: Deadline
    steps: int = 0

    def __post_init__(self) -> None:
        self.target, self.max_steps = _async_target(self.env)

    async def _call(self, awaitable: Any, what: str) -> Any:
        return await self.deadline.call(awaitable, what, self.spec.step_timeout_s, step_timeout_cause(self.spec))

    async def reset(self, **kwargs: Any) -> Any:
        """Reset the env (its ``areset``, else ``reset`` in a worker thread), bounded by ``step_timeout_s``
        and the episode's deadline; returns ``(observation, info)``."""
        self.steps = 0
        if self.target is not None:
            return await self._call(self.target.areset(**kwargs), "env.reset")
        return await self._call(call_in_thread(self.env.reset, **kwargs), "env.reset")

    async def step(self, action: dict[str, Any]) -> Any:
        """Step the env with ``action`` (its ``astep``, else ``step`` in a worker thread), bounded as
        :meth:`reset`; returns gymnasium's 5-tuple, ``truncated`` set at ``max_steps`` for an ``astep``
        env (what ``TimeLimit`` does for ``step``)."""
        self.steps += 1
        what = f"env.step {self.steps}"
        if self.target is None:
            return await self._call(call_in_thread(self.env.step, action), what)
        out = await self._call(self.target.astep(action), what)
        if self.max_steps is not None and self.steps >= self.max_steps and isinstance(out, tuple) and len(out) == 5:
            obs, reward, terminated, _, info = out
            out = (obs, reward, terminated, True, info)  # what gymnasium's TimeLimit does
        return out


def _async_target(env: Any) -> tuple[Any, int | None]:
    """(object whose ``areset``/``astep`` to await, TimeLimit steps to apply) or (None, None)."""
    if steps_async(env):
        return env, None
    chain, inner = [], env
    while hasattr(inner, "env") and inner is not getattr(inner, "unwrapped", inner):
        chain.append(type(inner).__name__)
        inner = inner.env
    if inner is env or not steps_async(inner) or not set(chain) <= _MAKE_WRAPPERS:
        return None, None
    spec = getattr(env, "spec", None)
    return inner, (spec.max_episode_steps if "TimeLimit" in chain and spec is not None else None)


def check_reset(out: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``env.reset``'s (observation messages, info) after checking their types.

    Raises:
        EnvError: not a 2-tuple, an observation that is not a list of chat messages, or an info
            that is not a dict; the message names what came back.
    """
    if not isinstance(out, tuple) or len(out) != 2:
        raise EnvError(f"env.reset must return (observation, info), got {_shape(out)}")
    obs, info = out
    return _check_messages(obs, "env.reset"), _check_info(info, "env.reset")


def check_step(out: Any) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
    """``env.step``'s (observation messages, reward, terminated, truncated, info) after checking them.

    Raises:
        EnvError: not a 5-tuple, a reward that is not a finite real number (bools refused), or an
            observation / info of the wrong type; the message names the bad value.
    """
    if not isinstance(out, tuple) or len(out) != 5:
        raise EnvError(f"env.step must return (observation, reward, terminated, truncated, info), got {_shape(out)}")
    obs, reward, terminated, truncated, info = out
    if isinstance(reward, bool) or not isinstance(reward, (int, float, np.number)) or np.ndim(reward) != 0:
        raise EnvError(f"env.step reward must be a number, got {type(reward).__name__} {reward!r}")
    reward = float(reward)
    if not math.isfinite(reward):
        raise EnvError(f"env.step returned a non-finite reward {reward!r}")
    return _check_messages(obs, "env.step"), reward, bool(terminated), bool(truncated), _check_info(info, "env.step")


def _shape(out: Any) -> str:
    return f"{type(out).__name__} of length {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__


def _check_messages(obs: Any, where: str) -> list[dict[str, Any]]:
    """``obs`` as a list of OpenAI-format chat messages.

    Raises:
        ConfigError: a content part of an unknown or unusable type, named (see
            :func:`~relax_agent.rollout.chat.check_parts`).
        EnvError: not a list of messages (names the first bad one).
    """
    from relax_agent.rollout.chat import check_parts

    if not isinstance(obs, (list, tuple)):
        raise EnvError(f"{where} observation must be a list of chat messages, got {type(obs).__name__}")
    check_parts(obs, f"{where} observation")
    for i, msg in enumerate(obs):
        if not is_message(msg):
            raise EnvError(f"{where} observation[{i}] is not an OpenAI-format chat message: {str(msg)[:200]}")
    return list(obs)


def _check_info(info: Any, where: str) -> dict[str, Any]:
    if info is not None and not isinstance(info, dict):
        raise EnvError(f"{where} info must be a dict, got {type(info).__name__}")
    return dict(info or {})


def numeric_info(info: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of an env's ``info`` as floats (the episode's metrics)."""
    return {k: float(v) for k, v in info.items() if isinstance(v, (int, float, bool)) and not isinstance(v, str)}


async def close_env(env: Any, timeout_s: float) -> None:
    """``env.close()`` in a thread, abandoned after ``timeout_s``; never raises."""
    try:
        await call_within(call_in_thread(env.close), timeout_s, "env.close")
    except Exception:  # closing must never mask the episode's own outcome (a hung close is abandoned)
        pass
