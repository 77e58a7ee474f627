"""The weight-sync coordinator: who publishes, who subscribes, which version is complete.

The publisher ``commit``\\ s a :class:`VersionMeta` once the version's bytes can be fetched;
from then on it is the latest complete version. Subscribers long-poll
``wait_for_version(after=...)``, fetch the bytes through their transport, and ``report``
whether they applied it; the publisher ``wait_applied`` for the subscribers registered
when it committed. The same methods are served over HTTP by
:mod:`relax_agent.weights.service` for replicas in other processes.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from relax_agent.errors import WeightSyncError
from relax_agent.weights.meta import VersionMeta


@dataclass(frozen=True)
class ApplyReport:
    """What one subscriber says about one version.

    Attributes:
        subscriber: subscriber id.
        version: the version it tried.
        error: None when applied, else why it was refused (the engine kept its old version).
        stats: timings in seconds and byte counts (``receive_s``, ``pause_s``, ``bytes``, ...).
    """

    subscriber: str
    version: int
    error: str | None = None
    stats: dict[str, float] = field(default_factory=dict)


class CoordinatorApi(Protocol):
    """What publishers and subscribers call; :class:`Coordinator` in-process, ``HttpCoordinator`` remote."""

    def register_subscriber(self, name: str) -> str: ...

    def unregister_subscriber(self, subscriber: str) -> None: ...

    def commit(self, meta: VersionMeta) -> None: ...

    def latest(self) -> VersionMeta | None: ...

    def wait_for_version(self, after: int | None, timeout_s: float,
                         subscriber: str | None = None) -> VersionMeta | None: ...

    def report(self, report: ApplyReport) -> None: ...


class Coordinator:
    """In-process coordinator (thread-safe). Keeps only the latest complete version."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._latest: VersionMeta | None = None
        self._previous: VersionMeta | None = None
        self._commits = itertools.count(1)
        self._publisher: str | None = None
        self._subscribers: dict[str, str] = {}
        self._reports: dict[str, ApplyReport] = {}
        self._ids = itertools.count()

    def register_publisher(self, address: str | None) -> None:
        """Record the publisher (one per coordinator) and where it serves bytes."""
        with self._cond:
            self._publisher = address or "in-process"

    def register_subscriber(self, name: str) -> str:
        """Add a subscriber; returns its id (``name.n``)."""
        with self._cond:
            sub_id = f"{name}.{next(self._ids)}"
            self._subscribers[sub_id] = name
            return sub_id

    def unregister_subscriber(self, subscriber: str) -> None:
        with self._cond:
            self._subscribers.pop(subscriber, None)
            self._reports.pop(subscriber, None)
            self._cond.notify_all()

    def subscribers(self) -> list[str]:
        with self._cond:
            return list(self._subscribers)

    def commit(self, meta: VersionMeta) -> VersionMeta:
        """Make ``meta`` the latest complete version and wake every long-poll.

        Returns:
            ``meta`` stamped with this commit's serial (what subscribers receive).

        Raises:
            WeightSyncError: ``meta.version`` is not newer than the latest.
        """
        with self._cond:
            if self._latest is not None and meta.version <= self._latest.version:
                raise WeightSyncError(f"version {meta.version} is not newer than the latest "
                                      f"complete version {self._latest.version}")
            self._previous, self._latest = self._latest, replace(meta, commit=next(self._commits))
            # reports about a retracted version of this number (or above) are not about this commit
            self._reports = {s: r for s, r in self._reports.items() if r.version < meta.version}
            self._cond.notify_all()
            return self._latest

    def retract(self, version: int) -> bool:
        """Withdraw ``version`` (a subscriber refused it): the version committed before it is the
        latest complete one again, so late joiners never pull the refused one, and ``version``
        may be committed again. Returns False (and changes nothing) if ``version`` is not the latest.
        """
        with self._cond:
            if self._latest is None or self._latest.version != version:
                return False
            self._latest, self._previous = self._previous, None
            self._cond.notify_all()
            return True

    def latest(self) -> VersionMeta | None:
        with self._cond:
            return self._latest

    @property
    def latest_version(self) -> int | None:
        latest = self.latest()
        return None if latest is None else latest.version

    def wait_for_version(self, after: int | None, timeout_s: float,
                         subscriber: str | None = None) -> VersionMeta | None:
        """Long poll: the latest version once it is newer than ``after`` (None: any).

        Returns None after ``timeout_s``, or as soon as ``subscriber`` (if given) is unregistered.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._latest is None or (after is not None and self._latest.version <= after):
                remaining = deadline - time.monotonic()
                if subscriber is not None and subscriber not in self._subscribers:
                    return None
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._latest

    def report(self, report: ApplyReport) -> None:
        """Record a subscriber's outcome for a version."""
        with self._cond:
            if report.subscriber in self._subscribers:
                self._reports[report.subscriber] = report
                self._cond.notify_all()

    def wait_applied(self, version: int, subscribers: list[str], timeout_s: float) -> dict[str, ApplyReport]:
        """Block until each of ``subscribers`` still registered has reported ``version`` (or newer).

        Returns:
            subscriber id -> its report (unregistered subscribers are left out).

        Raises:
            WeightSyncError: ``timeout_s`` passed first; names the subscribers still missing.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                live = [s for s in subscribers if s in self._subscribers]
                missing = [s for s in live if s not in self._reports or self._reports[s].version < version]
                if not missing:
                    return {s: self._reports[s] for s in live}
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WeightSyncError(f"version {version}: subscribers {missing} did not report within "
                                          f"{timeout_s} s (weights.publish_timeout_s)")
                self._cond.wait(remaining)

    def describe(self) -> dict[str, Any]:
        """Publisher, subscribers, latest version and last reports (for status endpoints)."""
        with self._cond:
            return {"publisher": self._publisher, "subscribers": list(self._subscribers),
                    "latest_version": None if self._latest is None else self._latest.version,
                    "reports": {s: r.version for s, r in self._reports.items()}}
