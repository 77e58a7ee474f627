"""The weight coordinator as a named Ray actor, so it outlives the trainer and every replica.

:class:`CoordinatorActor` holds one :class:`~relax_agent.weights.coordinator.Coordinator`. The
trainer actor's :class:`~relax_agent.weights.sync.WeightSync` and every replica's
:class:`~relax_agent.weights.subscriber.EngineSubscriber` reach it through
:class:`ActorCoordinator`, which has the in-process coordinator's methods (the bytes still travel
over the tcp transport, straight from the trainer to each replica).

A publisher that registers after another one did (a restarted trainer) gets a fresh coordinator,
so a new epoch: the old one is closed (its long polls return at once), subscribers find
themselves unknown, register again and take the new epoch's latest version whatever its number.
"""

from __future__ import annotations

import threading
from typing import Any

import ray

from relax_agent.weights.coordinator import ApplyReport, Coordinator
from relax_agent.weights.meta import VersionMeta


class CoordinatorActor:
    """Ray actor (threaded: each long poll holds one of ``max_concurrency`` threads)."""

    def __init__(self) -> None:
        self._coord = Coordinator()
        self._has_publisher = False
        self._lock = threading.Lock()

    def register_publisher(self, address: str | None) -> str:
        """Register the (re)started trainer; a second registration starts a new epoch."""
        with self._lock:
            if self._has_publisher:
                old, self._coord = self._coord, Coordinator()
                old.close()
            self._has_publisher = True
            return self._coord.register_publisher(address)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one :class:`Coordinator` method on the current epoch's coordinator."""
        return getattr(self._coord, method)(*args, **kwargs)

    def epoch(self) -> str:
        return self._coord.epoch


def start_coordinator(name: str, namespace: str) -> Any:
    """The run's coordinator actor (created, or found when it exists)."""
    cls = ray.remote(num_cpus=0, max_concurrency=256, max_restarts=0)(CoordinatorActor)
    return cls.options(name=name, namespace=namespace, get_if_exists=True).remote()


class ActorCoordinator:
    """The :class:`~relax_agent.weights.coordinator.CoordinatorApi` (plus the publisher's methods)
    over a :class:`CoordinatorActor` handle; picklable, so it travels to actors."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return ray.get(self.handle.call.remote(method, *args, **kwargs))

    # publisher side (WeightSync)
    def register_publisher(self, address: str | None) -> str:
        return ray.get(self.handle.register_publisher.remote(address))

    def commit(self, meta: VersionMeta, publisher: str | None = None) -> VersionMeta:
        return self._call("commit", meta, publisher=publisher)

    def retract(self, version: int) -> bool:
        return self._call("retract", version)

    def subscribers(self) -> list[str]:
        return self._call("subscribers")

    def wait_reports(self, version: int, subscribers: list[str],
                     timeout_s: float) -> tuple[dict[str, ApplyReport], list[str]]:
        return self._call("wait_reports", version, subscribers, timeout_s)

    def reported_version(self, subscriber: str) -> int | None:
        return self._call("reported_version", subscriber)

    @property
    def latest_version(self) -> int | None:
        meta = self.latest()
        return None if meta is None else meta.version

    def close(self) -> None:
        """Nothing: the coordinator is shared; the runtime stops its actor at the end of the run."""

    # both sides
    def latest(self) -> VersionMeta | None:
        return self._call("latest")

    def describe(self) -> dict[str, Any]:
        return self._call("describe")

    # subscriber side (EngineSubscriber)
    def register_subscriber(self, name: str) -> str:
        return self._call("register_subscriber", name)

    def unregister_subscriber(self, subscriber: str) -> None:
        self._call("unregister_subscriber", subscriber)

    def is_registered(self, subscriber: str) -> bool:
        return self._call("is_registered", subscriber)

    def wait_for_version(self, after: int | None, timeout_s: float, subscriber: str | None = None,
                         epoch: str | None = None) -> VersionMeta | None:
        return self._call("wait_for_version", after, timeout_s, subscriber, epoch)

    def report(self, report: ApplyReport) -> None:
        self._call("report", report)
