"""Each agent process in a jail of its own, so that agents cannot reach each other.

With ``rollout.agent.isolation: namespace`` (``auto`` picks it where it works: as root, with
``unshare`` and ``setpriv`` and a kernel that allows the namespaces) the agent command runs as

    unshare --pid --fork --kill-child --mount-proc -- setpriv --bounding-set=-all --inh-caps=-all --no-new-privs -- COMMAND

- its own **pid namespace** with its own ``/proc``: it sees only its own processes, so it cannot read
  another agent's environment (its per-episode key) or command line, signal it or trace it; when the
  agent exits (or is killed) the kernel kills every process left in the namespace, including children
  that left the process group with ``setsid``;
- **no capabilities** (bounding set emptied, no new privileges): though it may run as root, file
  permissions bind it; the episodes' private directories sit in a base directory it may traverse but
  not list (owned by ``nobody``, mode 0711), each directory mode 0700 with a random name, so an
  agent reaches its own ``TMPDIR`` and no other.

``none`` runs the command as it is (its own process group; children that leave it are found by the
episode key in their environment and killed).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from relax_agent.errors import ConfigError

log = logging.getLogger("relax_agent.rollout")

JAIL_ARGV = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--",
             "setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--")
"""What the agent command is prefixed with under ``namespace`` isolation."""
_NOBODY = 65534


@functools.lru_cache(maxsize=1)
def namespace_refusal() -> str | None:
    """Why ``namespace`` isolation cannot run here (None: it can). Probed once per process."""
    if os.geteuid() != 0:
        return "it needs root (a pid namespace and a private /proc)"
    missing = [tool for tool in ("unshare", "setpriv") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (util-linux)"
    try:
        done = subprocess.run([*JAIL_ARGV, "true"], capture_output=True, text=True, timeout=30)
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
    log.warning("rollout.agent.isolation=auto: agents run without a namespace of their own (%s); they can "
                "see each other's processes", refusal)
    return "none"


def episode_base(isolation: str) -> Path:
    """A new directory for the episodes' private directories: under ``namespace`` isolation owned by
    ``nobody`` with mode 0711 (jailed agents may enter their own directory, not list the others)."""
    base = Path(tempfile.mkdtemp(prefix="relax-agents-"))
    if isolation == "namespace":
        os.chown(base, _NOBODY, _NOBODY)
        base.chmod(0o711)
    return base
