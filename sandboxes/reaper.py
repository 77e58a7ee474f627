"""Nothing leaks: container labels, the reaper, and exit-time cleanup.

Three layers keep sandboxes from outliving their run:

1. **In-process cleanup.** Sandboxes close on episode end, exceptions and cancellation
   (``async with``, :class:`~relax_agent.sandboxes.SandboxPool`); what is still open when the
   interpreter exits (normal exit, Ctrl-C, SIGTERM turned into ``SystemExit``) is removed by
   :func:`run_cleanups`, registered with :mod:`atexit`.
2. **The reaper.** Every container carries labels: :data:`LABEL_SANDBOX` (run id),
   :data:`LABEL_OWNER` (host, pid and process start time of the trainer), :data:`LABEL_CREATED`
   and :data:`LABEL_EXPIRES` (unix seconds). :func:`reap` removes containers whose owner
   process is dead (same host) or whose expiry has passed; it runs when a process starts its
   first Docker sandbox and from ``relax-agent sandbox reap``.
3. **The TTL.** A container's main process is ``sleep TTL`` under ``docker-init`` with
   ``--rm``: even if the trainer is SIGKILLed and no reaper ever runs, the container exits and
   is removed after ``ttl_s``.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LABEL_SANDBOX = "relax-agent.sandbox"
"""Present on every sandbox container; its value is the run id."""
LABEL_OWNER = "relax-agent.owner"
"""``<hostname>:<pid>:<process start ticks>:<pid namespace>`` of the process that created the container."""
LABEL_CREATED = "relax-agent.created-at"
"""Unix time (seconds) the container was created."""
LABEL_EXPIRES = "relax-agent.expires-at"
"""Unix time (seconds) after which the reaper removes the container unconditionally."""

_lock = threading.Lock()
_cleanups: dict[str, Callable[[], None]] = {}
_atexit_installed = False


def start_ticks(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def pid_namespace() -> str:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``), or "0" when unknown: a pid
    means a process only inside its own namespace."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return "0"
    digits = "".join(c for c in link if c.isdigit())
    return digits or "0"


def owner_token(pid: int | None = None) -> str:
    """The :data:`LABEL_OWNER` value for ``pid`` (default: this process):
    ``<hostname>:<pid>:<start ticks>:<pid namespace>``."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{start_ticks(pid) or 0}:{pid_namespace()}"


def default_run_id() -> str:
    """``<hostname>-<pid>``: the run id used when the config sets none."""
    return f"{socket.gethostname()}-{os.getpid()}"


def owner_alive(token: str) -> bool | None:
    """Whether the process named by an owner token still runs; None when it cannot be told from here:
    another host, or another pid namespace on this host (a container or sandbox with the same
    hostname sees other processes under the same pids).

    A pid that was reused by another process counts as dead (its start time differs).
    """
    host, _, rest = token.partition(":")
    pid_s, _, rest = rest.partition(":")
    ticks, _, namespace = rest.partition(":")
    if host != socket.gethostname():
        return None
    if namespace not in ("", "0") and namespace != pid_namespace():
        return None
    if not pid_s.isdigit():
        return False
    now_ticks = start_ticks(int(pid_s))
    return now_ticks is not None and (ticks in ("", "0") or now_ticks == ticks)


@dataclass(frozen=True)
class Reaped:
    """One container the reaper removed (or would remove, in a dry run)."""

    id: str
    name: str
    run_id: str
    reason: str
    """"all", "run", "expired", "owner-dead" or "stopped"."""


def _reason(labels: dict[str, str], status: str, now: float, run_id: str | None, everything: bool) -> str | None:
    if everything:
        return "all"
    if run_id is not None:
        return "run" if labels.get(LABEL_SANDBOX) == run_id else None
    try:
        expires = float(labels.get(LABEL_EXPIRES, "inf"))
    except ValueError:
        expires = 0.0
    if expires < now:
        return "expired"
    if owner_alive(labels.get(LABEL_OWNER, "")) is False:
        return "owner-dead"
    if status in ("exited", "dead"):
        return "stopped"
    return None


def remove_container(client: Any, container_id: str) -> None:
    """Force-remove a container, ignoring one that is already gone or being removed."""
    import docker.errors

    try:
        client.api.remove_container(container_id, force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:
        if exc.status_code != 409:  # 409: removal already in progress (auto-remove)
            raise


def reap(client: Any, *, run_id: str | None = None, everything: bool = False, now: float | None = None,
         dry_run: bool = False) -> list[Reaped]:
    """Remove sandbox containers that no live run needs.

    Default: containers whose expiry passed, whose owner process (on this host) is dead, or
    that have stopped. ``run_id``: exactly that run's containers. ``everything``: all sandbox
    containers on the daemon (also those of live runs).

    Returns:
        The containers removed (or that would be, with ``dry_run``).
    """
    now = time.time() if now is None else now
    out = []
    for c in client.api.containers(all=True, filters={"label": LABEL_SANDBOX}):
        labels = c.get("Labels") or {}
        reason = _reason(labels, c.get("State", ""), now, run_id, everything)
        if reason is None:
            continue
        name = (c.get("Names") or ["?"])[0].lstrip("/")
        if not dry_run:
            remove_container(client, c["Id"])
        out.append(Reaped(id=c["Id"], name=name, run_id=labels.get(LABEL_SANDBOX, ""), reason=reason))
    return out


def reap_own(client: Any) -> int:
    """Remove every container this process created; returns how many."""
    mine = client.api.containers(all=True, filters={"label": f"{LABEL_OWNER}={owner_token()}"})
    for c in mine:
        remove_container(client, c["Id"])
    return len(mine)


def register_cleanup(key: str, fn: Callable[[], None]) -> None:
    """Run ``fn()`` at interpreter exit unless :func:`unregister_cleanup` is called first."""
    global _atexit_installed
    with _lock:
        _cleanups[key] = fn
        if not _atexit_installed:
            atexit.register(run_cleanups)
            _atexit_installed = True


def unregister_cleanup(key: str) -> None:
    """Forget a cleanup registered under ``key`` (no error if absent)."""
    with _lock:
        _cleanups.pop(key, None)


def run_cleanups() -> int:
    """Run every registered cleanup now (errors are swallowed: this runs at exit); returns the count."""
    with _lock:
        fns = list(_cleanups.values())
        _cleanups.clear()
    for fn in fns:
        try:
            fn()
        except Exception:  # noqa: BLE001 - at exit, keep cleaning the rest
            pass
    return len(fns)


def _sigterm_to_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def install_sigterm_handler() -> bool:
    """Make SIGTERM raise ``SystemExit`` (so ``finally`` blocks and atexit cleanups run).

    Only when called in the main thread and SIGTERM still has its default action: an
    application's own handler is left alone. Returns True when the handler was installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _sigterm_to_exit)
    return True
