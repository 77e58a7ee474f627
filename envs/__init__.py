"""relax_agent.envs: gymnasium-registered environments for agentic, tool-using tasks.

Environments live in gymnasium's own registry under the ``relax/`` namespace::

    import gymnasium, relax_agent.envs
    env = gymnasium.make("relax/BFCL-simple-v0")
    env = gymnasium.make("relax_agent.envs:relax/Calculator-v0")   # same, without the import

Importing this package also loads third-party packages' ``gymnasium.envs`` entry points
(:func:`load_plugins`), so their envs appear in ``gymnasium.registry`` and ``relax-agent envs list``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium

from relax_agent.envs.base import DeclaresTools, DescribesReward, HasTasks, SteppedAsync, TextEnv, steps_async
from relax_agent.envs.spaces import ConversationSpace, MessageSpace
from relax_agent.envs.tool_env import ToolEnv, tool_schema
from relax_agent.errors import EnvError


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


def env_ids() -> list[str]:
    """Ids of the registered chat envs: relax-agent's and plugins' (gymnasium's own envs left out)."""
    def builtin(entry_point: Any) -> bool:
        name = entry_point if isinstance(entry_point, str) else getattr(entry_point, "__module__", "")
        return str(name).startswith("gymnasium.")

    return sorted(i for i, spec in gymnasium.registry.items() if not builtin(spec.entry_point))


def make(env_id: str, **kwargs: Any) -> gymnasium.Env:
    """``gymnasium.make`` for every form an ``env.id`` may take.

    Args:
        env_id: a registered id (``"relax/Calculator-v0"``), ``"module:ns/Name-v0"`` (the module is
            imported first, from the working directory too), or a bridge's ``"<scheme>:<name>"``
            (``"gem:game:GuessTheNumber-v0-hard"``, :mod:`relax_agent.envs.bridges`).
        **kwargs: constructor arguments.

    Raises:
        ConfigError: a bridge's package is missing (naming the extra), or its name contradicts ``kwargs``.
        gymnasium.error.Error: unknown id (with gymnasium's "did you mean").
    """
    env_id, kwargs = resolve_id(env_id, kwargs)
    return gymnasium.make(env_id, **kwargs)


def resolve_id(env_id: str, kwargs: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """The registered gymnasium id and kwargs of an ``env.id`` (see :func:`make`); imports a
    ``"module:"`` prefix's module.

    Raises:
        ConfigError: as :func:`relax_agent.envs.bridges.resolve`.
        ImportError: the ``"module:"`` prefix cannot be imported.
    """
    from relax_agent.envs.bridges import resolve

    env_id, kwargs = resolve(env_id, kwargs)
    module, _, name = env_id.rpartition(":")
    if module:
        import importlib
        import os
        import sys

        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        importlib.import_module(module)
        env_id = name
    return env_id, kwargs


def describe(env_id: str, **kwargs: Any) -> dict[str, Any]:
    """What ``relax-agent envs show`` prints: registration, reward, tasks per split, tool schemas.

    ``env_id`` takes every form :func:`make` takes. Tools come from the env's ``tool_schemas`` when it has them (:class:`ToolEnv`),
    else from ``reset(seed=0)``; a failure there is reported in ``tools_error``, not raised.

    Raises:
        gymnasium.error.Error: unknown id (with gymnasium's "did you mean").
        EnvError: the env gymnasium made has no spec.
    """
    env_id, kwargs = resolve_id(env_id, kwargs)
    env = gymnasium.make(env_id, **kwargs)
    try:
        inner, spec = env.unwrapped, env.spec
        if spec is None:
            raise EnvError(f"gymnasium.make({env_id!r}) returned an env without a spec (not made from the registry)")
        out: dict[str, Any] = {
            "id": env_id, "entry_point": spec.entry_point if isinstance(spec.entry_point, str) else repr(spec.entry_point),
            "kwargs": spec.kwargs, "max_episode_steps": spec.max_episode_steps,
            "reward": (inner.reward_description if isinstance(inner, DescribesReward) else "") or "(not described)",
        }
        if isinstance(inner, HasTasks):
            out["tasks"] = {split: len(inner.tasks(split)) for split in ("train", "heldout")}
        try:
            schemas = inner.tool_schemas if isinstance(inner, DeclaresTools) else None
            out["tools"] = list(schemas) if schemas is not None else env.reset(seed=0)[1].get("tools", [])
        except Exception as exc:  # noqa: BLE001 - e.g. a sandbox backend that is not running here
            out["tools_error"] = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        env.close()


def register_envs() -> None:
    """Register every built-in environment (gymnasium's ``gymnasium.envs`` entry point)."""
    from relax_agent.envs import (
        audio,
        bfcl,
        bridges,
        calculator,
        data_file,
        dataset_tools,
        long_recall,
        python_exec,
        reasoning_gym,
        video,
        visual,
    )

    bfcl.register_all()
    dataset_tools.register()
    python_exec.register()
    data_file.register()
    calculator.register()
    long_recall.register()
    reasoning_gym.register()
    visual.register()
    audio.register()
    video.register()
    bridges.register()


def load_plugins() -> list[str]:
    """Run every other package's ``gymnasium.envs`` entry point; returns the entry points loaded.

    gymnasium 1.x no longer loads this entry-point group itself, so relax-agent does, with
    gymnasium's old semantics: an entry point named ``NS`` registers its ids in namespace ``NS``
    (``register(id="Echo-v0")`` -> ``"NS/Echo-v0"``); ``__root__`` registers ids as given. A plugin
    that fails to load is skipped with a warning naming it.
    """
    import contextlib
    import warnings
    from importlib.metadata import entry_points

    from gymnasium.envs.registration import namespace

    loaded = []
    for ep in entry_points(group="gymnasium.envs"):
        if ep.value.startswith("relax_agent.envs"):
            continue
        root = ep.name.startswith("__") and ep.name.endswith("__")
        try:
            with contextlib.nullcontext() if root else namespace(ep.name):
                fn = ep.load()
                if callable(fn):
                    fn()
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not take the others down
            warnings.warn(f"gymnasium.envs plugin {ep.name} = {ep.value} failed to load: {type(exc).__name__}: {exc}",
                          RuntimeWarning, stacklevel=2)
            continue
        loaded.append(f"{ep.name} = {ep.value}")
    return loaded


register_envs()
load_plugins()

__all__ = ["ConversationSpace", "DeclaresTools", "DescribesReward", "HasTasks", "MessageSpace", "SteppedAsync", "TextEnv", "ToolEnv", "describe", "env_ids", "load_plugins", "make", "register",
           "register_envs", "resolve_id", "steps_async", "tool_schema"]
