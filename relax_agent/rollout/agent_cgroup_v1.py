"""Episode cgroups on the v1 ``memory`` and ``pids`` hierarchies: ``memory.limit_in_bytes`` (and
``memory.memsw.limit_in_bytes``: no swap past it), ``pids.max``; ``memory.oom_control`` counts OOM
kills (see :mod:`~relax_agent.rollout.agent_cgroups`)."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

_OPTIONAL = "memory.memsw.limit_in_bytes"
_REMOVE_TRIES = 50
_REMOVE_WAIT_S = 0.1


def own_paths(membership: str) -> dict[str, str]:
    """This process's v1 cgroup path per controller (``{"memory": "/a/b", ...}``) from
    ``/proc/self/cgroup`` text."""
    paths = {}
    for line in membership.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            paths[controller] = path
    return paths


class CgroupV1:
    """Per-episode cgroups under ``<root>/{memory,pids}/<own cgroup>/relax-agents-<random>``.

    Raises:
        FileNotFoundError: a hierarchy is not mounted (names it).
        PermissionError: its directory is not writable.
    """

    def __init__(self, root: Path, membership: str, memory_limit_mb: int, max_processes: int) -> None:
        own, tag = own_paths(membership), f"relax-agents-{secrets.token_hex(4)}"
        self.parents: dict[str, Path] = {}
        for controller in ("memory", "pids"):
            here = root / controller / own.get(controller, "/").lstrip("/")
            if not (here / "cgroup.procs").exists():
                raise FileNotFoundError(f"no cgroup v1 {controller} hierarchy at {root / controller}")
            self.parents[controller] = here / tag
        for parent in self.parents.values():
            parent.mkdir()
        limit_bytes = str(memory_limit_mb * 2**20)
        self.limits = {"memory": [("memory.limit_in_bytes", limit_bytes), ("memory.memsw.limit_in_bytes", limit_bytes)],
                       "pids": [("pids.max", str(max_processes))]}

    def create(self, name: str) -> tuple[str, ...]:
        """See :class:`~relax_agent.rollout.agent_cgroups.AgentCgroups`."""
        procs = []
        for controller, parent in self.parents.items():
            path = parent / name
            path.mkdir()
            for knob, value in self.limits[controller]:
                if knob != _OPTIONAL or (path / knob).exists():  # memsw exists only with swap accounting
                    (path / knob).write_text(value)
            procs.append(str(path / "cgroup.procs"))
        return tuple(procs)

    def oom_kills(self, name: str) -> int:
        """See :class:`~relax_agent.rollout.agent_cgroups.AgentCgroups`."""
        for line in (self.parents["memory"] / name / "memory.oom_control").read_text().splitlines():
            key, _, count = line.partition(" ")
            if key == "oom_kill":
                return int(count)
        return 0

    def remove(self, name: str) -> None:
        """See :class:`~relax_agent.rollout.agent_cgroups.AgentCgroups`."""
        for parent in self.parents.values():
            _rmdir_when_empty(parent / name)

    def close(self) -> None:
        """See :class:`~relax_agent.rollout.agent_cgroups.AgentCgroups`."""
        for parent in self.parents.values():
            try:
                parent.rmdir()
            except OSError:
                pass


def _rmdir_when_empty(path: Path) -> None:
    """Remove the cgroup ``path``, waiting up to 5 s for its last processes to exit."""
    for _ in range(_REMOVE_TRIES):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(_REMOVE_WAIT_S)
    os.rmdir(path)  # raises what the kernel says
