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

_BUILTINS: list[dict[str, Any]] = []


def register(id: str, entry_point: str | Callable[..., gymnasium.Env], **kwargs: Any) -> None:
    """Register an environment in gymnasium's registry (same arguments as ``gymnasium.register``).

    Re-registering an id with the same entry point is a no-op.
    """
    existing = gymnasium.registry.get(id)
    if existing is not None and existing.entry_point == entry_point:
        return
    gymnasium.register(id=id, entry_point=entry_point, disable_env_checker=True, **kwargs)


def register_envs() -> None:
    """Register every built-in environment (gymnasium's ``gymnasium.envs`` entry point)."""
    from relax_agent.envs import bfcl, python_exec

    bfcl.register_all()
    python_exec.register()


register_envs()

__all__ = ["ConversationSpace", "MessageSpace", "TextEnv", "register", "register_envs"]
