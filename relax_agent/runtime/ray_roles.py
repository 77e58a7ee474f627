"""Which role died: the actors a ``runtime: ray`` run cannot go on without, and failures told by
their root cause.

The data bus, the weight coordinator and the heartbeat table are not restarted (they hold the
run's state). When one dies, every other role fails soon after in its own way: the trainer's
publish raises Ray's ``ActorDiedError`` inside the trainer actor (which, read naively, looks like
the trainer dying), the driver's bus reads raise ``ConnectionError`` from the bus's socket, a
replica's put raises inside the replica. :class:`RoleWatch` pings those actors and names the one
that died, so each of these paths ends the run with one :class:`~relax_agent.errors.RoleDiedError`
naming the role, its actor and the cause, instead of restarting the trainer or a replica in vain.

:func:`describe_failure` gives the one-line root cause of an exception that crossed Ray (the
cause inside a ``RayTaskError``; for a dead actor its name, class, pid and why it died), never
Ray's wrapper header (``ray::TrainerActor.train() (pid=..., ip=..., actor_id=..., repr=...)``).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from relax_agent.errors import RelaxError, RoleDiedError

DATA_BUS, COORDINATOR, HEALTH = "data bus", "weight coordinator", "heartbeat table"
_WHY_FATAL = {DATA_BUS: "it holds the rows in flight", COORDINATOR: "it holds the published versions and the replicas' "
              "subscriptions", HEALTH: "without it no replica or trainer can be supervised"}

_WHY = re.compile(r"The actor is dead because (.*?)(?:\s+(?:Some common causes|There are some potential root "
                  r"causes|If the process was killed|Check the logs)|$)", re.S)
_FIELD = re.compile(r"^\s*(class_name|name|pid):\s*(\S+)\s*$", re.M)
_MAX_CHARS = 400


def root_cause(exc: BaseException) -> BaseException:
    """``exc`` with Ray's ``RayTaskError`` wrappers taken off (the exception the remote code raised)."""
    seen = 0
    while isinstance(exc, ray.exceptions.RayTaskError) and getattr(exc, "cause", None) is not None and seen < 16:
        exc, seen = exc.cause, seen + 1
    return exc


ACTOR_DIED = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.OutOfMemoryError)
"""What a call to a trainer or replica actor raises when its process is gone: it died or was killed,
including by Ray's memory monitor (``OutOfMemoryError``), which the runtime handles as a death."""

MEMORY_HINT = ("Ray's memory monitor killed it: the node's memory use passed RAY_memory_usage_threshold (0.95 "
               "by default); lower trainer.micro_batch_tokens, rollout.tasks_per_step or the rollout replicas "
               "on that node, or give the node more memory")
"""Said after a death by ``OutOfMemoryError``: the settings that change a node's memory use."""


def oom_hint(exc: BaseException) -> str:
    """``"; " + MEMORY_HINT`` when ``exc`` (or its root cause) is Ray's ``OutOfMemoryError``, else ``""``."""
    return f"; {MEMORY_HINT}" if isinstance(root_cause(exc), ray.exceptions.OutOfMemoryError) else ""


def describe_failure(exc: BaseException) -> str:
    """One line: the root cause of ``exc`` (see the module docstring), at most 400 characters.

    A dead actor reads ``ActorDiedError: actor NAME (CLASS, pid N) is dead: WHY``; any other
    exception ``Type: first line of its message``.
    """
    cause = root_cause(exc)
    text = str(cause)
    if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        fields = dict(_FIELD.findall(text))
        why = _WHY.search(text)
        who = fields.get("name")
        what = ", ".join(x for x in (fields.get("class_name"), f"pid {fields['pid']}" if "pid" in fields else None) if x)
        reason = (" ".join(why.group(1).split()) if why else " ".join(text.splitlines()[:1])).rstrip(".")
        if "name" in fields:
            line = f"{type(cause).__name__}: actor {who}" + (f" ({what})" if what else "") + f" is dead: {reason}"
        else:
            line = f"{type(cause).__name__}: {reason}"
    else:
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        line = f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    return line if len(line) <= _MAX_CHARS else line[:_MAX_CHARS - 3] + "..."


class RoleWatch:
    """Pings the actors a run cannot go on without and remembers the first that died.

    Args:
        actors: role (:data:`DATA_BUS`, :data:`COORDINATOR`, :data:`HEALTH`) -> (actor name, handle).
        namespace: their Ray namespace (named in messages).
        timeout_s: longest wait for a ping; an actor that does not answer in time is not counted
            dead (it may be busy or the machine loaded), only one whose ping raises is.
    """

    def __init__(self, actors: Mapping[str, tuple[str, Any]], namespace: str, timeout_s: float = 10.0) -> None:
        self.actors = dict(actors)
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.fatal: RoleDiedError | None = None
        """The first role found dead (kept: the run cannot go on, every later check returns it)."""
        self._lock = threading.Lock()

    def check(self, roles: Sequence[str] | None = None) -> RoleDiedError | None:
        """Ping ``roles`` (default: all); returns (and keeps) a :class:`RoleDiedError` for the first
        dead one, or None while all answer or time out."""
        if self.fatal is not None:
            return self.fatal
        names = [r for r in (roles or self.actors) if r in self.actors]
        refs = {}
        for role in names:
            try:
                refs[role] = self.actors[role][1].__ray_ready__.remote()
            except Exception as exc:  # a handle Ray already knows is dead may refuse the call
                return self.mark_dead(role, exc)
        deadline = time.monotonic() + self.timeout_s
        for role, ref in refs.items():
            try:
                ray.get(ref, timeout=max(deadline - time.monotonic(), 0.01))
            except ray.exceptions.GetTimeoutError:
                continue
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                return self.mark_dead(role, exc)
        return None

    def mark_dead(self, role: str, exc: BaseException) -> RoleDiedError:
        """Record that ``role`` died of ``exc`` (the first death is kept); returns its :class:`RoleDiedError`."""
        with self._lock:
            if self.fatal is None:
                name = self.actors[role][0]
                self.fatal = RoleDiedError(
                    f"the {role} (Ray actor {name!r} in namespace {self.namespace!r}) died "
                    f"({describe_failure(exc)}); {_WHY_FATAL.get(role, 'the run needs it')} and it is not "
                    "restarted, so the run cannot go on")
            return self.fatal

    def explain(self, exc: BaseException) -> BaseException:
        """The :class:`RoleDiedError` of a dead role when one died (``exc`` was its consequence),
        else ``exc`` itself."""
        found = self.check()
        return exc if found is None else found


class GuardedBus:
    """The driver's data bus with deaths named: once :class:`RoleWatch` knows a role died, every call
    raises its :class:`RoleDiedError`; a call that fails with anything but relax-agent's own errors
    (``ConnectionError`` from the bus's socket, Ray's ``ActorDiedError``) asks the watch which role
    died and raises that instead, or the original error when none did.

    Args:
        bus: a :class:`~relax_agent.data.ray.RayTransferQueue` (the driver's; replicas get the bus itself).
        watch: the run's :class:`RoleWatch`.
    """

    _CALLS = frozenset({"create_partition", "put", "get", "read", "ack", "nack", "clear", "stats"})

    def __init__(self, bus: Any, watch: RoleWatch) -> None:
        self._bus, self._watch = bus, watch

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._bus, name)
        if name not in self._CALLS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._watch.fatal is not None:
                raise self._watch.fatal
            try:
                return attr(*args, **kwargs)
            except RelaxError:
                raise
            except Exception as exc:
                found = self._watch.explain(exc)
                if found is exc:
                    raise
                raise found from exc

        return call
