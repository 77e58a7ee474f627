"""The weight-sync coordinator: who publishes, who subscribes, which version is complete.

The publisher ``commit``\\ s a :class:`VersionMeta` once the version's bytes can be fetched;
from then on it is the latest complete version. Every coordinator has an ``epoch`` (a random run
id) stamped on its commits: version numbers restart with a restarted publisher, and the epoch
tells a new run's version 1 from the old run's. Subscriber ids carry the epoch too, so a
subscriber of a previous coordinator is unknown to a new one and registers again. Subscribers long-poll
``wait_for_version(after=...)``, fetch the bytes through their transport, and ``report``
whether they applied it; the publisher ``wait_applied`` for the subscribers registered
when it committed. The same methods are served over HTTP by
:mod:`relax_agent.weights.service` for replicas in other processes.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from relax_agent.errors import WeightSyncError
from relax_agent.weights.meta import VersionMeta

log = logging.getLogger("relax_agent.weights")


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

    def register_subscriber(self, name: str) -> str:
        """Add a subscriber named ``name``; returns its id."""

    def unregister_subscriber(self, subscriber: str) -> None:
        """Remove ``subscriber`` (its last report still answers a publish waiting for it)."""

    def is_registered(self, subscriber: str) -> bool:
        """Whether ``subscriber`` is registered (False for an id of a previous coordinator); also a
        keep-alive."""

    def commit(self, meta: VersionMeta) -> object:  # the in-process one returns the stamped meta
        """Make ``meta`` the latest complete version and wake every long poll.

        Raises:
            WeightSyncError: ``meta.version`` is not newer than the latest (or the publisher is fenced out).
        """

    def latest(self) -> VersionMeta | None:
        """The latest complete version (None before the first commit)."""

    def wait_for_version(self, after: int | None, timeout_s: float, subscriber: str | None = None,
                         epoch: str | None = None) -> VersionMeta | None:
        """Long poll: the latest version once it is newer than ``after`` (see
        :meth:`Coordinator.wait_for_version`); None after ``timeout_s`` or once ``subscriber`` is not
        registered."""

    def report(self, report: ApplyReport) -> None:
        """Record a subscriber's outcome for a version."""


def check_poll_timeout(timeout_s: Any) -> float:
    """``timeout_s`` of a long poll as a float: a number >= 0 (inf waits until a version comes).

    Raises:
        WeightSyncError: NaN, negative, or not a number (names the value).
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or math.isnan(timeout_s) or timeout_s < 0:
        raise WeightSyncError(f"wait_for_version(timeout_s={timeout_s!r}): expected a number of seconds >= 0")
    return float(timeout_s)


class Coordinator:
    """In-process coordinator (thread-safe). Keeps only the latest complete version.

    Args:
        epoch: this coordinator's run id (default: a fresh random one), stamped on every commit.
    """

    def __init__(self, epoch: str | None = None) -> None:
        self.epoch = epoch or uuid.uuid4().hex[:12]
        self._cond = threading.Condition()
        self._latest: VersionMeta | None = None
        self._previous: VersionMeta | None = None
        self._commits = itertools.count(1)
        self._publisher: str | None = None
        self._publisher_token: str | None = None
        self._subscribers: dict[str, str] = {}
        self._reports: dict[str, ApplyReport] = {}
        self._departed: dict[str, ApplyReport] = {}
        """Last reports of subscribers that unregistered (a publish waiting on them still counts them)."""
        self._ids = itertools.count()
        self._closed = False
        self._seen: dict[str, float] = {}
        """subscriber id -> monotonic time of its last call (register, poll, report, keep-alive)."""
        self._polling: dict[str, int] = {}
        """subscriber id -> long polls it has open now (a subscriber in a poll is never silent)."""
        self.dropped_total = 0
        """Subscribers unregistered for silence (``weights.subscriber_silence_s``) so far."""

    def register_publisher(self, address: str | None) -> str:
        """Record the publisher (one per coordinator) and where it serves bytes.

        Returns:
            its fencing token: from now on ``commit`` refuses a ``publisher`` token other than
            this one (a second registration fences the first publisher out).
        """
        with self._cond:
            self._publisher = address or "in-process"
            self._publisher_token = secrets.token_hex(16)
            return self._publisher_token

    def register_subscriber(self, name: str) -> str:
        """Add a subscriber; returns its id (``name.epoch.n``, unique across coordinators)."""
        with self._cond:
            sub_id = f"{name}.{self.epoch}.{next(self._ids)}"
            self._subscribers[sub_id] = name
            self._seen[sub_id] = time.monotonic()
            return sub_id

    def is_registered(self, subscriber: str) -> bool:
        """Whether ``subscriber`` is registered here (False for an id of a previous coordinator).
        Counts as a keep-alive of ``subscriber``."""
        with self._cond:
            self._touch(subscriber)
            return subscriber in self._subscribers

    def _touch(self, subscriber: str | None) -> None:
        if subscriber is not None and subscriber in self._subscribers:
            self._seen[subscriber] = time.monotonic()

    def unregister_subscriber(self, subscriber: str) -> None:
        """Remove ``subscriber``; its last report still answers a publish that was waiting for it."""
        with self._cond:
            self._subscribers.pop(subscriber, None)
            self._seen.pop(subscriber, None)
            report = self._reports.pop(subscriber, None)
            if report is not None:
                self._departed[subscriber] = report
                while len(self._departed) > 64:
                    self._departed.pop(next(iter(self._departed)))
            self._cond.notify_all()

    def subscribers(self) -> list[str]:
        """Ids of the registered subscribers."""
        with self._cond:
            return list(self._subscribers)

    def commit(self, meta: VersionMeta, publisher: str | None = None) -> VersionMeta:
        """Make ``meta`` the latest complete version and wake every long-poll.

        Args:
            publisher: the fencing token from :meth:`register_publisher`; required (and checked)
                once a publisher registered, except for in-process callers passing None.

        Returns:
            ``meta`` stamped with this commit's serial and this coordinator's epoch (what
            subscribers receive).

        Raises:
            WeightSyncError: ``meta.version`` is not newer than the latest, or ``publisher`` is
                not the registered publisher's token (a fenced-out or foreign publisher).
        """
        with self._cond:
            if publisher is not None and publisher != self._publisher_token:
                raise WeightSyncError(f"version {meta.version}: refused, the committing publisher is not the one "
                                      "registered with this coordinator (fenced out by a newer publisher, or foreign)")
            if self._latest is not None and meta.version <= self._latest.version:
                raise WeightSyncError(f"version {meta.version} is not newer than the latest "
                                      f"complete version {self._latest.version}")
            stamped = replace(meta, commit=next(self._commits), epoch=self.epoch)
            self._previous, self._latest = self._latest, stamped
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
        """The latest complete version (None before the first commit)."""
        with self._cond:
            return self._latest

    @property
    def latest_version(self) -> int | None:
        """The number of the latest complete version (None before the first commit)."""
        latest = self.latest()
        return None if latest is None else latest.version

    def wait_for_version(self, after: int | None, timeout_s: float, subscriber: str | None = None,
                         epoch: str | None = None) -> VersionMeta | None:
        """Long poll: the latest version once it is newer than ``after`` (None: any).

        With ``epoch`` (the epoch of the version ``after`` counts in), a latest version of another
        epoch is newer whatever its number: a restarted publisher's version 1 replaces the old run's
        version 5. Returns None after ``timeout_s``, as soon as ``subscriber`` (if given) is not
        registered (check :meth:`is_registered`: a subscriber of a previous coordinator registers
        again), or once the coordinator is closed.

        Raises:
            WeightSyncError: ``timeout_s`` is NaN, negative or not a number.
        """
        timeout_s = check_poll_timeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if subscriber is not None:
                self._polling[subscriber] = self._polling.get(subscriber, 0) + 1
            try:
                while not self._newer(after, epoch):
                    remaining = deadline - time.monotonic()
                    if subscriber is not None and subscriber not in self._subscribers:
                        return None
                    if remaining <= 0 or self._closed:
                        return None
                    self._cond.wait(None if math.isinf(remaining) else remaining)
                return self._latest
            finally:
                if subscriber is not None:
                    left = self._polling.pop(subscriber) - 1
                    if left > 0:
                        self._polling[subscriber] = left
                    self._touch(subscriber)

    def _newer(self, after: int | None, epoch: str | None) -> bool:
        latest = self._latest
        if latest is None:
            return False
        return after is None or (epoch is not None and latest.epoch != epoch) or latest.version > after

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Wake every long poll (they return None) and answer later ones at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def report(self, report: ApplyReport) -> None:
        """Record a subscriber's outcome for a version."""
        with self._cond:
            if report.subscriber in self._subscribers:
                self._touch(report.subscriber)
                self._reports[report.subscriber] = report
                self._cond.notify_all()

    def wait_applied(self, version: int, subscribers: list[str], timeout_s: float) -> dict[str, ApplyReport]:
        """Block until each of ``subscribers`` still registered has reported ``version`` (or newer).

        Returns:
            subscriber id -> its report (a subscriber that left after reporting keeps its report;
            one that left without reporting is left out).

        Raises:
            WeightSyncError: ``timeout_s`` passed first; names the subscribers still missing.
        """
        reports, missing = self.wait_reports(version, subscribers, timeout_s)
        if missing:
            raise WeightSyncError(f"version {version}: subscribers {missing} did not report within "
                                  f"{timeout_s} s (weights.publish_timeout_s)")
        return reports

    def wait_reports(self, version: int, subscribers: list[str],
                     timeout_s: float) -> tuple[dict[str, ApplyReport], list[str]]:
        """Wait up to ``timeout_s`` for each of ``subscribers`` still registered to report ``version``
        (or newer); never raises on a timeout.

        Returns:
            (subscriber id -> its report about ``version`` or newer, ids that had not reported it
            when the time was up: lagging). A subscriber that reported and then unregistered (a
            replica that reached its last version and left) counts with its report; one that left
            without reporting is in neither.
        """
        done, missing, _ = self.wait_reports_dropping(version, subscribers, timeout_s, math.inf)
        return done, missing

    def wait_reports_dropping(self, version: int, subscribers: list[str], timeout_s: float,
                              silence_s: float) -> tuple[dict[str, ApplyReport], list[str], list[str]]:
        """:meth:`wait_reports`, but a subscriber among the missing that has been silent for
        ``silence_s`` (no long poll open, no call since) is unregistered and not waited for.

        Returns:
            (reports, lagging, dropped): the first two as :meth:`wait_reports`; ``dropped``: ids
            unregistered for silence during this wait (a live subscriber registers again on its
            next poll).
        """
        deadline = time.monotonic() + timeout_s
        check_s = max(0.05, min(silence_s / 4, 1.0)) if not math.isinf(silence_s) else None
        dropped: list[str] = []
        with self._cond:
            while True:
                done = {}
                for s in subscribers:
                    report = self._reports.get(s) or self._departed.get(s)
                    if report is not None and report.version >= version:
                        done[s] = report
                missing = [s for s in subscribers if s in self._subscribers and s not in done]
                if missing and check_s is not None:
                    silent = self._silent(missing, silence_s)
                    for s in silent:
                        self._drop(s, silence_s)
                    dropped += silent
                    missing = [s for s in missing if s not in silent]
                remaining = deadline - time.monotonic()
                if not missing or remaining <= 0:
                    return done, missing, dropped
                self._cond.wait(remaining if check_s is None else min(remaining, check_s))

    def _silent(self, subscribers: list[str], silence_s: float) -> list[str]:
        now = time.monotonic()
        return [s for s in subscribers if not self._polling.get(s) and now - self._seen.get(s, now) > silence_s]

    def _drop(self, subscriber: str, silence_s: float) -> None:
        """Unregister a silent subscriber (lock held)."""
        idle_s = time.monotonic() - self._seen.get(subscriber, time.monotonic())
        self._subscribers.pop(subscriber, None)
        self._seen.pop(subscriber, None)
        self._reports.pop(subscriber, None)
        self.dropped_total += 1
        log.warning("weights: dropped subscriber %s: silent for %.1f s (no poll, report or keep-alive; "
                    "weights.subscriber_silence_s=%s); a publish no longer waits for it", subscriber, idle_s,
                    silence_s)

    def reported_version(self, subscriber: str) -> int | None:
        """The version of ``subscriber``'s last report (None: none yet, or not registered)."""
        with self._cond:
            report = self._reports.get(subscriber)
            return None if report is None else report.version

    def describe(self) -> dict[str, Any]:
        """Publisher, subscribers, latest version and last reports (for status endpoints)."""
        with self._cond:
            return {"publisher": self._publisher, "epoch": self.epoch, "subscribers": list(self._subscribers),
                    "latest_version": None if self._latest is None else self._latest.version,
                    "reports": {s: r.version for s, r in self._reports.items()},
                    "dropped_total": self.dropped_total}
