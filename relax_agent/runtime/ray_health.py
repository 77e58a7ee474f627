"""Heartbeats: a named Ray actor that keeps each service's last beat, stamped on its own clock.

Services beat from inside their own work loop (a rollout replica from an asyncio task on the
event loop that runs its episodes, the trainer around each call), so a service whose loop hangs
without raising (a blocked loop, a stopped process) stops beating and its heartbeat age grows.
The trainer also beats from a helper thread while a call runs, saying which call and for how long
(``doing``, ``call_s``): its hang is the call's length (``runtime.trainer_hang_timeout_s``, watched
by the trainer service), and the beat tells a process that runs from one that is stopped. Ages are
measured on the actor's clock, so clocks of other nodes do not matter.

Beat payload (a dict, every key optional): ``pid``, ``in_flight`` (groups being played),
``groups_done``, ``episodes_done``, ``policy_version``, ``step`` (trainer), ``busy`` (trainer in a call),
``doing`` (the trainer's call: ``train``, ``save_model``, ...), ``call_s`` (seconds in it).
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
    from relax_agent.runtime.ray import on_this_node

    return cls.options(name=name, namespace=namespace, get_if_exists=True, scheduling_strategy=on_this_node()).remote()
