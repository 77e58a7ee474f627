"""Heartbeats: a named Ray actor that keeps each service's last beat, stamped on its own clock.

Services beat from inside their own work loop (a rollout replica from an asyncio task on the
event loop that runs its episodes, the trainer around each call), never from a helper thread, so a
service whose loop hangs without raising (a blocked loop, a stopped process) stops beating and its
heartbeat age grows. Ages are measured on the actor's clock, so clocks of other nodes do not matter.

Beat payload (a dict, every key optional): ``pid``, ``in_flight`` (groups being played),
``groups_done``, ``episodes_done``, ``policy_version``, ``step`` (trainer), ``busy`` (trainer in a call).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray


class HealthActor:
    """Ray actor: name -> (monotonic time of the last beat, its payload)."""

    def __init__(self) -> None:
        self._beats: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def beat(self, name: str, info: dict[str, Any]) -> None:
        """Record a heartbeat of service ``name``."""
        with self._lock:
            self._beats[name] = (time.monotonic(), dict(info))

    def forget(self, name: str) -> None:
        """Drop a removed service."""
        with self._lock:
            self._beats.pop(name, None)

    def table(self) -> dict[str, tuple[float, dict[str, Any]]]:
        """name -> (seconds since its last beat, its payload)."""
        with self._lock:
            now = time.monotonic()
            return {name: (now - t, info) for name, (t, info) in self._beats.items()}


def start_health(name: str, namespace: str) -> Any:
    """The run's heartbeat actor (created, or found when it exists)."""
    cls = ray.remote(num_cpus=0, max_concurrency=64, max_restarts=0)(HealthActor)
    return cls.options(name=name, namespace=namespace, get_if_exists=True).remote()
