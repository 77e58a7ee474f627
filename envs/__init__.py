"""relax_agent.envs: gymnasium-registered environments for agentic, tool-using tasks.

Environments live in gymnasium's own registry under the ``relax/`` namespace::

    import gymnasium, relax_agent.envs
    env = gymnasium.make("relax/BFCL-simple-v0")
"""

from __future__ import annotations

from typing import Any, Callable

import gymnasium

from relax_agent.envs.base import TextEnv
from relax_agent.envs.spaces import ConversationSpace, MessageSpace
from relax_agent.envs.tool_env import ToolEnv, tool_schema

_BUILTINS: list[dict[str, Any]] = []


def register(id: str, entry_point: str | Callable[..., gymnasium.Env], **kwargs: Any) -> None:
    """Register an environment in gymnasium's own registry (same arguments as ``gymnasium.register``).

    Args:
        id: ``"namespace/Name-vN"``, e.g. ``"relax/Calculator-v0"``.
        entry_point: ``"package.module:Class"`` (imported lazily by ``gymnasium.make``) or a callable
            returning the env.
        **kwargs: ``gymnasium.register``'s keywords: ``kwargs`` (constructor defaults, which
            ``gymnasium.make(id, **overrides)`` updates), ``max_episode_steps`` (adds gymnasium's
            ``TimeLimit``: the step that reaches it returns ``truncated=True``), ...

    The passive env checker is off by default (chat observations are checked by the contract
    suite, :mod:`relax_agent.envs.testing`). Registering an id again with the same arguments is a
    no-op; with different ones it replaces the entry (gymnasium warns).
    """
    kwargs.setdefault("disable_env_checker", True)
    existing = gymnasium.registry.get(id)
    if existing is not None and existing.entry_point == entry_point and all(
        getattr(existing, k, None) == v for k, v in kwargs.items()
    ):
        return
    gymnasium.register(id=id, entry_point=entry_point, **kwargs)


def register_envs() -> None:
    """Register every built-in environment (gymnasium's ``gymnasium.envs`` entry point)."""
    from relax_agent.envs import bfcl, calculator, python_exec, reasoning_gym

    bfcl.register_all()
    python_exec.register()
    calculator.register()
    reasoning_gym.register()


register_envs()

__all__ = ["ConversationSpace", "MessageSpace", "TextEnv", "ToolEnv", "register", "register_envs", "tool_schema"]
