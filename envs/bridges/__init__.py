"""Bridges to environments written for other projects: verifiers, OpenEnv, GEM, TextArena,
reasoning-gym and Harbor task folders.

Each bridge is one module behind the same env protocol every built-in env follows (a
:class:`~relax_agent.envs.TextEnv` registered in gymnasium as ``relax/<Name>-v0``). The foreign
package is imported only inside its module; its scorer gives the reward, while rendering, tool-call
parsing and token records stay relax-agent's (one parser for training and evaluation).

A config names a foreign environment with a scheme prefix in ``env.id``::

    env:
      id: "gem:game:GuessTheNumber-v0-hard"      # = id relax/GEM-v0, kwargs {game: "game:GuessTheNumber-v0-hard"}

:func:`resolve` turns ``"<scheme>:<name>"`` into the bridge's gymnasium id and one keyword
argument; every place that makes an env from an id (``relax-agent train``, ``eval``, ``envs show``,
``envs audit``) goes through :func:`relax_agent.envs.make`, which calls it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from relax_agent.errors import ConfigError


@dataclass(frozen=True)
class Bridge:
    """One foreign ecosystem.

    Attributes:
        scheme: the ``env.id`` prefix (``"gem"`` in ``"gem:game:GuessTheNumber-v0-hard"``).
        env_id: the gymnasium id the bridge's env is registered under.
        kwarg: the constructor argument that receives the name after the scheme.
        module: the bridge module, ``relax_agent.envs.<module>``.
        package: the foreign package's import name; None when the bridge needs none (Harbor).
        extra: the ``relax-agent[<extra>]`` that installs ``package``.
        cls: the env class in ``module``.
    """

    scheme: str
    env_id: str
    kwarg: str
    module: str
    package: str | None
    extra: str | None
    cls: str

    @property
    def entry_point(self) -> str:
        """gymnasium's lazy ``"module:Class"`` entry point of the bridge's env."""
        return f"relax_agent.envs.{self.module}:{self.cls}"


BRIDGES: dict[str, Bridge] = {b.scheme: b for b in (
    Bridge("verifiers", "relax/Verifiers-v0", "env", "bridges.verifiers", "verifiers", "verifiers", "VerifiersEnv"),
    Bridge("openenv", "relax/OpenEnv-v0", "env", "bridges.openenv", "openenv", "openenv", "OpenEnvEnv"),
    Bridge("gem", "relax/GEM-v0", "game", "bridges.gem", "gem", "gem", "GEMEnv"),
    Bridge("textarena", "relax/TextArena-v0", "game", "bridges.textarena", "textarena", "textarena", "TextArenaEnv"),
    Bridge("reasoning_gym", "relax/ReasoningGym-v0", "dataset", "reasoning_gym", "reasoning_gym", "reasoning",
           "ReasoningGymEnv"),
    Bridge("harbor", "relax/Harbor-v0", "task_dir", "bridges.harbor", None, None, "HarborEnv"),
)}
"""Every bridge, by scheme."""


def split_scheme(env_id: str) -> tuple[Bridge | None, str]:
    """``(bridge, name)`` for ``"<scheme>:<name>"``; ``(None, env_id)`` when ``env_id`` has no bridge scheme.

    Raises:
        ConfigError: the scheme is a bridge's but the name after it is empty.
    """
    scheme, sep, name = env_id.partition(":")
    bridge = BRIDGES.get(scheme) if sep else None
    if bridge is None:
        return None, env_id
    if not name.strip():
        raise ConfigError(f"env.id={env_id!r}: expected '{scheme}:<{bridge.kwarg}>' with a name after the colon")
    return bridge, name


def resolve(env_id: str, kwargs: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """The gymnasium id and constructor kwargs that ``env_id`` (and ``kwargs``) stand for.

    ``"gem:game:GuessTheNumber-v0-hard"`` -> ``("relax/GEM-v0", {"game": "game:GuessTheNumber-v0-hard", **kwargs})``;
    any other id is returned unchanged.

    Raises:
        ConfigError: ``kwargs`` also sets the bridge's argument to another value, or the name is empty.
    """
    kwargs = dict(kwargs or {})
    bridge, name = split_scheme(env_id)
    if bridge is None:
        return env_id, kwargs
    if bridge.kwarg in kwargs and kwargs[bridge.kwarg] != name:
        raise ConfigError(f"env.kwargs.{bridge.kwarg}={kwargs[bridge.kwarg]!r} contradicts env.id={env_id!r}; "
                          f"set one of them")
    return bridge.env_id, {**kwargs, bridge.kwarg: name}


def require(scheme: str) -> ModuleType:
    """Import the foreign package of bridge ``scheme``.

    Raises:
        ConfigError: the package is not installed; the message names the extra that installs it.
    """
    bridge = BRIDGES[scheme]
    assert bridge.package is not None, f"bridge {scheme} needs no package"
    try:
        return importlib.import_module(bridge.package)
    except ImportError as exc:
        raise ConfigError(f"{bridge.env_id} ({scheme}:...) needs the {bridge.package!r} package: "
                          f"pip install 'relax-agent[{bridge.extra}]' ({exc})") from exc


def bridge_module(scheme: str) -> ModuleType:
    """The bridge's own module (``relax_agent.envs.bridges.gem`` for ``"gem"``)."""
    return importlib.import_module(f"relax_agent.envs.{BRIDGES[scheme].module}")


def register() -> None:
    """Register every bridge's env id (lazily: the foreign package is imported when an env is made)."""
    from relax_agent.envs import register as register_env

    for bridge in BRIDGES.values():
        register_env(id=bridge.env_id, entry_point=bridge.entry_point)


def offered(scheme: str) -> list[str]:
    """Names the installed package offers for ``"<scheme>:<name>"`` (the bridge module's ``available()``).

    Raises:
        ConfigError: the foreign package is not installed (naming the extra).
    """
    return list(bridge_module(scheme).available())


__all__ = ["BRIDGES", "Bridge", "bridge_module", "offered", "register", "require", "resolve", "split_scheme"]
