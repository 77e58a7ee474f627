"""Each agent process in a jail of its own, so that agents cannot reach each other or the run.

With ``rollout.agent.isolation: namespace`` (``auto`` picks it where it works: as root, with
util-linux ``unshare``, ``setpriv`` and ``mount``, and a kernel that allows the namespaces) the agent
command runs as

    unshare --pid --fork --kill-child --mount-proc --net -- PYTHON -I jail_init.py ... -- COMMAND

(:mod:`relax_agent.rollout.jail_init` is the jail's first process) and holds:

- **an unprivileged uid of its own** (one per running episode, from :data:`UID_BASE`; its group the
  same number, no supplementary groups, no capabilities, no new privileges): it cannot write the
  repository, the venv or the run directory (root-owned), nor read another episode's directory;
- **a private /tmp**: a fresh tmpfs showing only its ``TMPDIR`` (mode 0700, owned by its uid; its
  task and output files; removed at the episode's end) and the directories of its program and
  working directory when those are under ``/tmp``, at their usual paths; fresh ``/dev/shm``,
  ``/var/tmp`` and ``/run/lock``; umask 077. Other episodes' directories, the run's files in
  ``/tmp`` (Ray's session directories and sockets) and anything else there are out of sight;
- **a pid namespace** with its own ``/proc``: it sees only its own processes (no other agent's key in
  an environment or command line); when the agent exits the kernel kills every process it left;
- **a network namespace** holding only a loopback on which ``127.0.0.1:<endpoint port>`` forwards to
  the endpoint's Unix socket: the run's other services (the trainer's ports, Ray, the control
  endpoint) and the outside network are unreachable.

- **memory and process limits** (``rollout.agent.memory_limit_mb``, ``max_processes``): a cgroup per
  episode (:mod:`~relax_agent.rollout.agent_cgroups`) where this process may create them; else a
  warning, and no limits.

What it does not hold: the agent can read whatever is world-readable on the host's filesystem
(the code, the venv, world-readable data) and write world-writable places other than those above,
and the directories exposed in its ``/tmp`` as their modes allow; the agent's program and every file
it reads must be readable by others (``/root`` and pytest's ``tmp_path`` are not).

``none`` runs the command as it is (its own process group; children that leave it are found by the
episode key in their environment and killed).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from relax_agent.errors import ConfigError, EnvError
from relax_agent.rollout import jail_init

log = logging.getLogger("relax_agent.rollout")

UNSHARE_ARGV = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--")
"""The namespaces of a jail (``--mount-proc`` implies a private mount namespace)."""
UID_BASE = 1_500_000
"""First uid given to jailed agents (far above distribution ranges; no files on the host own them)."""
UID_COUNT = 65536
"""Jailed agents that may run at once."""
_NOBODY = 65534
_TOOLS = ("unshare", "setpriv", "mount")


def jail_argv(uid: int, socket_path: Path | None, port: int, command: list[str],
              cgroup_procs: tuple[str, ...] = (), exposed: tuple[str, ...] = ()) -> list[str]:
    """The argv that runs ``command`` jailed as ``uid`` in the cgroups whose ``cgroup.procs`` files
    are ``cgroup_procs``, with ``exposed`` (directories) in its otherwise empty ``/tmp`` and, when
    ``socket_path`` is given, ``127.0.0.1:port`` forwarded to that Unix socket (else no network)."""
    net = ["--socket", str(socket_path), "--port", str(port)] if socket_path is not None else []
    joins = [arg for procs in cgroup_procs for arg in ("--cgroup-procs", procs)]
    shown = [arg for path in exposed for arg in ("--expose", path)]
    return [*UNSHARE_ARGV, sys.executable, "-I", jail_init.__file__, "--uid", str(uid), *net, *joins, *shown,
            "--", *command]


def exposed_paths(tmp: Path, command: list[str], cwd: str | None) -> tuple[str, ...]:
    """What a jailed agent's ``/tmp`` shows: ``tmp`` (its ``TMPDIR``), then the directory of each
    file ``command`` names and its working directory (only those under ``/tmp`` matter)."""
    here = cwd or os.getcwd()
    files = [os.path.join(here, part) for part in command if os.path.isfile(os.path.join(here, part))]
    dirs = [str(tmp), here, *(os.path.dirname(os.path.abspath(f)) for f in files)]
    return tuple(dict.fromkeys(dirs))


@functools.lru_cache(maxsize=1)
def namespace_refusal() -> str | None:
    """Why ``namespace`` isolation cannot run here (None: it can). Probed once per process by
    jailing ``true`` as ``nobody``."""
    if os.geteuid() != 0:
        return "it needs root (namespaces, mounts and a uid per agent)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (util-linux)"
    try:
        done = subprocess.run(jail_argv(_NOBODY, None, 0, ["true"]), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the probe failed: {exc}"
    if done.returncode != 0:
        return f"the kernel refused it: {done.stderr.strip()[-300:]}"
    return None


def resolve_isolation(mode: str) -> str:
    """``"namespace"`` or ``"none"`` for ``rollout.agent.isolation`` = ``mode``.

    Raises:
        ConfigError: ``namespace`` was asked for where it cannot run (names why).
    """
    if mode == "none":
        return "none"
    refusal = namespace_refusal()
    if refusal is None:
        return "namespace"
    if mode == "namespace":
        raise ConfigError(f"rollout.agent.isolation='namespace' cannot run here: {refusal}; use 'auto' or 'none'")
    log.warning("rollout.agent.isolation=auto: agents run without a jail (%s): as this process's user, with "
                "its network, able to see each other's processes", refusal)
    return "none"


def episode_base(isolation: str) -> Path:
    """A new directory for the episodes' private directories: under ``namespace`` isolation owned by
    ``nobody`` with mode 0711 (the jail's first process reaches the endpoint socket in it)."""
    base = Path(tempfile.mkdtemp(prefix="relax-agents-"))
    if isolation == "namespace":
        os.chown(base, _NOBODY, _NOBODY)
        base.chmod(0o711)
    return base


class UidPool:
    """Hands each running jailed episode a uid of its own from ``[UID_BASE, UID_BASE + UID_COUNT)``,
    the one released longest ago first (a uid comes back only after every other one was used, so a
    file an agent left in a world-writable place is not its next episode's)."""

    def __init__(self, base: int = UID_BASE, count: int = UID_COUNT) -> None:
        self._count = count
        self._free = collections.deque(range(base, base + count))

    def acquire(self) -> int:
        """A uid no running episode holds.

        Raises:
            EnvError: every uid is held (more than ``count`` agents at once).
        """
        if not self._free:
            raise EnvError(f"more than {self._count} jailed agents at once: no free uid")
        return self._free.popleft()

    def release(self, uid: int) -> None:
        """Give ``uid`` back once its episode's processes are gone."""
        self._free.append(uid)


def unreachable_reason(path: str) -> str | None:
    """Why a jailed agent cannot read the existing file ``path``, with the fix (None: it can)."""
    if os.path.dirname(os.path.realpath(path)) == os.path.realpath("/tmp"):
        return "its /tmp of its own shows only directories under /tmp, not files: move it into a directory of its own"
    blocked = unreadable_part(path)
    if blocked is None:
        return None
    return f"it runs as an unprivileged uid and {blocked} is not open to others: make it readable by all"


def unreadable_part(path: str) -> str | None:
    """The first part of the existing file ``path`` that an unprivileged uid cannot reach: a
    directory on the way without the others' execute bit, or the file without the others' read bit
    (None: it can read it)."""
    parts = Path(os.path.abspath(path))
    for directory in reversed(parts.parents):
        if not os.stat(directory).st_mode & stat.S_IXOTH:
            return str(directory)
    return None if os.stat(parts).st_mode & stat.S_IROTH else str(parts)
