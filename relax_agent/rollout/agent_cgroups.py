"""Memory and process limits for jailed agents: one cgroup per episode (cgroup v2, or the v1
``memory`` and ``pids`` hierarchies), under a parent the driver creates beside its own cgroup.

:func:`build_agent_cgroups` probes what this host delegates and returns the implementation that
works (:mod:`~relax_agent.rollout.agent_cgroup_v2`, :mod:`~relax_agent.rollout.agent_cgroup_v1`);
the jail's first process joins the episode's cgroup before it starts the agent, so every process of
the jail counts. Past ``memory_limit_mb`` the kernel kills a process of the jail (its OOM killer, the
episode's cgroup only); past ``max_processes`` ``fork`` fails (``EAGAIN``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from relax_agent.errors import SandboxError
from relax_agent.rollout.agent_cgroup_v1 import CgroupV1
from relax_agent.rollout.agent_cgroup_v2 import CgroupV2

CGROUP_ROOT = Path("/sys/fs/cgroup")


class AgentCgroups(Protocol):
    """Per-episode cgroups with the same limits, under one parent of their own."""

    def create(self, name: str) -> tuple[str, ...]:
        """Make episode ``name``'s cgroup (the limits set); the ``cgroup.procs`` files its first
        process writes ``0`` to.

        Raises:
            OSError: the kernel refused a directory or a limit.
        """
        ...

    def oom_kills(self, name: str) -> int:
        """Processes of episode ``name`` the kernel killed for its memory limit so far."""
        ...

    def remove(self, name: str) -> None:
        """Remove episode ``name``'s cgroup once its processes are gone (a no-op when it is gone)."""
        ...

    def close(self) -> None:
        """Remove the parent (after every episode's :meth:`remove`)."""
        ...


def build_agent_cgroups(memory_limit_mb: int, max_processes: int, root: Path = CGROUP_ROOT,
                        self_cgroup: str = "/proc/self/cgroup") -> AgentCgroups:
    """Cgroups for the limits, v2 when ``root`` is a cgroup v2 mount, else the v1 hierarchies.

    Raises:
        SandboxError: neither works here; the message names what is missing.
    """
    membership = Path(self_cgroup).read_text()
    try:
        if (root / "cgroup.controllers").exists():
            return CgroupV2(root, membership, memory_limit_mb, max_processes)
        return CgroupV1(root, membership, memory_limit_mb, max_processes)
    except OSError as exc:
        raise SandboxError(f"no cgroup for agent limits under {root}: {exc}") from exc
