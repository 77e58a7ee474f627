"""The weight coordinator as a named Ray actor, so it outlives the trainer and every replica.

:class:`CoordinatorActor` holds one :class:`~relax_agent.weights.coordinator.Coordinator`. The
trainer actor's :class:`~relax_agent.weights.sync.WeightSync` and every replica's
:class:`~relax_agent.weights.subscriber.EngineSubscriber` reach it through
:class:`ActorCoordinator`, which has the in-process coordinator's methods (the bytes still travel
over the tcp transport, straight from the trainer to each replica).

Any process joined to the run's Ray can look the actor up by name, so every call carries the
caller's :class:`~relax_agent.weights.auth.RunCredential` (made by the driver, handed to the
actors it starts): registering the publisher, committing and retracting versions need the
publisher secret (only the trainer has it); subscribing, polling, reporting and reading need the
subscriber secret (the replicas', also the tcp weight server's challenge secret). A call without
the right one raises :class:`~relax_agent.errors.WeightSyncError` and changes nothing.

A publisher that registers after another one did (a restarted trainer) gets a fresh coordinator,
so a new epoch: the old one is closed (its long polls return at once), subscribers find
themselves unknown, register again and take the new epoch's latest version whatever its number.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import ray

from relax_agent.errors import WeightSyncError
from relax_agent.runtime.ray import on_this_node
from relax_agent.weights.auth import RunCredential, same_secret
from relax_agent.weights.coordinator import ApplyReport, Coordinator
from relax_agent.weights.meta import VersionMeta

log = logging.getLogger("relax_agent.weights")

PUBLISHER_METHODS = frozenset({"commit", "retract", "subscribers", "wait_reports", "wait_reports_dropping",
                               "reported_version"})
"""Coordinator methods only the publisher calls (need the publisher secret)."""
SUBSCRIBER_METHODS = frozenset({"latest", "describe", "register_subscriber", "unregister_subscriber",
                                "is_registered", "wait_for_version", "report"})
"""Coordinator methods subscribers (and the driver) call (need the subscriber secret)."""


class CoordinatorActor:
    """Ray actor (threaded: each long poll holds one of ``max_concurrency`` threads).

    Args:
        credential: the run's credential with both secrets; every call is checked against it.
    """

    def __init__(self, credential: RunCredential) -> None:
        if not credential.subscriber or not credential.publisher:
            raise WeightSyncError("the weight coordinator actor needs the run's publisher and subscriber secrets")
        self._credential = credential
        self._coord = Coordinator()
        self._has_publisher = False
        self._lock = threading.Lock()
        self.refused = 0

    def _require(self, method: str, given: Any, publisher: bool) -> None:
        """Raise WeightSyncError (and log it) unless ``given`` is a credential good for ``method``."""
        if isinstance(given, RunCredential) and same_secret(
                self._credential.publisher if publisher else self._credential.subscriber,
                given.publisher if publisher else given.subscriber):
            return
        with self._lock:
            self.refused += 1
        role = "publisher" if publisher else "subscriber"
        log.warning("weight coordinator: refused %s: the caller does not hold the run's %s credential", method, role)
        raise WeightSyncError(f"weight coordinator: {method} refused: it needs the run's {role} credential, "
                              "which this caller does not hold")

    def check(self, credential: Any) -> bool:
        """Whether ``credential`` is this run's subscriber credential (lets a driver tell its own
        coordinator from another run's actor under the same name)."""
        return isinstance(credential, RunCredential) and same_secret(self._credential.subscriber,
                                                                    credential.subscriber)

    def register_publisher(self, address: str | None, credential: Any = None) -> str:
        """Register the (re)started trainer; a second registration starts a new epoch.

        Raises:
            WeightSyncError: ``credential`` lacks the run's publisher secret (nothing changes).
        """
        self._require("register_publisher", credential, publisher=True)
        with self._lock:
            if self._has_publisher:
                old, self._coord = self._coord, Coordinator()
                old.close()
            self._has_publisher = True
            return self._coord.register_publisher(address)

    def call(self, method: str, *args: Any, credential: Any = None, **kwargs: Any) -> Any:
        """Run one :class:`Coordinator` method on the current epoch's coordinator.

        Raises:
            WeightSyncError: ``method`` is not one a caller may use, or ``credential`` is not good
                for it (see the module docstring); a commit without the publisher's fencing token.
        """
        if method in PUBLISHER_METHODS:
            self._require(method, credential, publisher=True)
            if method == "commit" and kwargs.get("publisher") is None:
                raise WeightSyncError("weight coordinator: commit refused: no publisher fencing token")
        elif method in SUBSCRIBER_METHODS:
            self._require(method, credential, publisher=False)
        else:
            raise WeightSyncError(f"weight coordinator: unknown method {method!r}")
        return getattr(self._coord, method)(*args, **kwargs)

    def epoch(self) -> str:
        """The coordinator's epoch (random unless given: a restarted coordinator is told apart by it)."""
        return self._coord.epoch


def start_coordinator(name: str, namespace: str, credential: RunCredential) -> Any:
    """The run's coordinator actor (created with ``credential`` on this process's node, or found when it
    exists).

    Raises:
        WeightSyncError: an actor of that name exists and belongs to another run (another credential).
    """
    cls = ray.remote(num_cpus=0, max_concurrency=256, max_restarts=0)(CoordinatorActor)
    handle = cls.options(name=name, namespace=namespace, get_if_exists=True,
                         scheduling_strategy=on_this_node()).remote(credential)
    if not ray.get(handle.check.remote(credential.subscriber_only())):
        raise WeightSyncError(f"a weight coordinator actor named {name!r} in Ray namespace {namespace!r} belongs "
                              "to another run; set another data.ray_actor_name (or data.ray_namespace)")
    return handle


class ActorCoordinator:
    """The :class:`~relax_agent.weights.coordinator.CoordinatorApi` (plus the publisher's methods)
    over a :class:`CoordinatorActor` handle; picklable, so it travels to actors.

    Args:
        handle: the coordinator actor.
        credential: what this holder may do: the trainer's has the publisher secret, a replica's
            (:meth:`RunCredential.subscriber_only`) does not.
    """

    def __init__(self, handle: Any, credential: RunCredential) -> None:
        self.handle = handle
        self.credential = credential

    def for_subscribers(self) -> ActorCoordinator:
        """This coordinator with a subscriber-only credential (for replicas and the driver)."""
        return ActorCoordinator(self.handle, self.credential.subscriber_only())

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return ray.get(self.handle.call.remote(method, *args, credential=self.credential, **kwargs))

    # publisher side (WeightSync)
    def register_publisher(self, address: str | None) -> str:
        """Register the publisher serving bytes at ``address``; returns its fencing token
        (:meth:`Coordinator.register_publisher`)."""
        return ray.get(self.handle.register_publisher.remote(address, self.credential))

    def commit(self, meta: VersionMeta, publisher: str | None = None) -> VersionMeta:
        """Make ``meta`` the latest version (:meth:`Coordinator.commit`); returns it stamped."""
        return self._call("commit", meta, publisher=publisher)

    def retract(self, version: int) -> bool:
        """Withdraw ``version`` if it is the latest (:meth:`Coordinator.retract`)."""
        return self._call("retract", version)

    def subscribers(self) -> list[str]:
        """Ids of the registered subscribers."""
        return self._call("subscribers")

    def wait_reports(self, version: int, subscribers: list[str],
                     timeout_s: float) -> tuple[dict[str, ApplyReport], list[str]]:
        """Wait up to ``timeout_s`` for ``subscribers`` to report ``version``; returns (reports, missing)
        (:meth:`Coordinator.wait_reports`)."""
        done, missing, _ = self.wait_reports_dropping(version, subscribers, timeout_s, math.inf)
        return done, missing

    def wait_reports_dropping(self, version: int, subscribers: list[str], timeout_s: float,
                              silence_s: float) -> tuple[dict[str, ApplyReport], list[str], list[str]]:
        """:meth:`wait_reports`, unregistering missing subscribers silent for ``silence_s``; returns
        (reports, missing, dropped) (:meth:`Coordinator.wait_reports_dropping`)."""
        return self._call("wait_reports_dropping", version, subscribers, timeout_s, silence_s)

    def reported_version(self, subscriber: str) -> int | None:
        """The version of ``subscriber``'s last report (None: none yet, or not registered)."""
        return self._call("reported_version", subscriber)

    @property
    def latest_version(self) -> int | None:
        """The number of the latest complete version (None before the first commit)."""
        meta = self.latest()
        return None if meta is None else meta.version

    def close(self) -> None:
        """Nothing: the coordinator is shared; the runtime stops its actor at the end of the run."""

    # both sides
    def latest(self) -> VersionMeta | None:
        """The latest complete version (None before the first commit)."""
        return self._call("latest")

    def describe(self) -> dict[str, Any]:
        """Publisher, subscribers, latest version and last reports (for status endpoints)."""
        return self._call("describe")

    # subscriber side (EngineSubscriber)
    def register_subscriber(self, name: str) -> str:
        """Add a subscriber named ``name``; returns its id."""
        return self._call("register_subscriber", name)

    def unregister_subscriber(self, subscriber: str) -> None:
        """Remove ``subscriber``."""
        self._call("unregister_subscriber", subscriber)

    def is_registered(self, subscriber: str) -> bool:
        """Whether ``subscriber`` is registered with this coordinator (also a keep-alive)."""
        return self._call("is_registered", subscriber)

    def wait_for_version(self, after: int | None, timeout_s: float, subscriber: str | None = None,
                         epoch: str | None = None) -> VersionMeta | None:
        """Long poll for a version newer than ``after`` (:meth:`Coordinator.wait_for_version`); None after
        ``timeout_s`` or once ``subscriber`` is not registered."""
        return self._call("wait_for_version", after, timeout_s, subscriber, epoch)

    def report(self, report: ApplyReport) -> None:
        """Record a subscriber's outcome for a version."""
        self._call("report", report)
