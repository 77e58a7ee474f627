"""Episode cgroups on the unified hierarchy (cgroup v2): ``memory.max``, ``memory.swap.max``,
``pids.max``; ``memory.events`` counts OOM kills (see :mod:`~relax_agent.rollout.agent_cgroups`)."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

_CONTROLLERS = ("memory", "pids")
_REMOVE_TRIES = 50
_REMOVE_WAIT_S = 0.1


def own_path(membership: str) -> str:
    """This process's cgroup v2 path (``/a/b``) from ``/proc/self/cgroup`` text.

    Raises:
        FileNotFoundError: no ``0::`` line (no unified hierarchy).
    """
    for line in membership.splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise FileNotFoundError("no cgroup v2 membership in /proc/self/cgroup")


class CgroupV2:
    """Per-episode cgroups under ``<root>/<own cgroup>/relax-agents-<random>``.

    Raises:
        PermissionError: the own cgroup does not delegate ``memory`` and ``pids`` to children
            (names its ``cgroup.subtree_control``).
    """

    def __init__(self, root: Path, membership: str, memory_limit_mb: int, max_processes: int) -> None:
        here = root / own_path(membership).lstrip("/")
        enabled = (here / "cgroup.subtree_control").read_text().split()
        if not all(c in enabled for c in _CONTROLLERS):
            raise PermissionError(f"{here} does not delegate {' and '.join(_CONTROLLERS)} to its children "
                                  f"(cgroup.subtree_control: {' '.join(enabled) or 'empty'})")
        self.parent = here / f"relax-agents-{secrets.token_hex(4)}"
        self.parent.mkdir()
        (self.parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in _CONTROLLERS))
        self.limits = {"memory.max": str(memory_limit_mb * 2**20), "memory.swap.max": "0",
                       "pids.max": str(max_processes)}

    def create(self, name: str) -> tuple[str, ...]:
        """See :class:`~relax_agent.rollout.agent_cgroups.AgentCgroups`."""
        path = self.parent / name
        path.mkdir()
        for knob, value in self.limits.items():
            if knob != "memory.swap.max" or (path / knob).exists():  # exists only with swap accounting
                (path / knob).write_text(value)
        return (str(path / "cgroup.procs"),)

    def oom_kills(self, name: str) -> int:
        """See :class:`~relax_agent.rollout.agent_cgroups.AgentCgroups`."""
        for line in (self.parent / name / "memory.events").read_text().splitlines():
            key, _, count = line.partition(" ")
            if key == "oom_kill":
                return int(count)
        return 0

    def remove(self, name: str) -> None:
        """See :class:`~relax_agent.rollout.agent_cgroups.AgentCgroups`. Kills what is left
        (``cgroup.kill``) when the directory stays busy."""
        path = self.parent / name
        for _ in range(_REMOVE_TRIES):
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if (path / "cgroup.kill").exists():
                    (path / "cgroup.kill").write_text("1")
                time.sleep(_REMOVE_WAIT_S)
        os.rmdir(path)  # raises what the kernel says

    def close(self) -> None:
        """See :class:`~relax_agent.rollout.agent_cgroups.AgentCgroups`."""
        try:
            self.parent.rmdir()
        except OSError:
            pass
