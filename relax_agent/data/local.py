"""In-process data bus: one :class:`~relax_agent.data.store.Store` behind a ``threading.Condition``.

The embedded default: producers and consumers are threads (or asyncio code calling through
``asyncio.to_thread``) of one process. Arrays are stored and handed out without copies.
Expired leases are processed whenever a call or a waiter wakes; waiters wake at the next
lease deadline, so re-delivery needs no background thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from relax_agent.data.config import DataConfig
from relax_agent.data.protocol import Batch
from relax_agent.data.samplers import Sampler
from relax_agent.data.schema import FieldSpec, assemble
from relax_agent.data.store import Store, Taken
from relax_agent.errors import QueueTimeoutError


class LocalTransferQueue:
    """The in-process backend of :class:`relax_agent.data.TransferQueue` (see there for the API)."""

    def __init__(self, cfg: DataConfig | None = None) -> None:
        self.cfg = cfg or DataConfig()
        self._store = Store(self.cfg.lease_timeout_s)
        self._cond = threading.Condition()

    def create_partition(self, partition: str, capacity_rows: int,
                         schema: Mapping[str, FieldSpec | str | tuple] | None = None, *,
                         group_size: int | None = None, retire_after: Sequence[str] = ()) -> None:
        """See :meth:`relax_agent.data.TransferQueue.create_partition`."""
        with self._cond:
            self._store.create_partition(partition, capacity_rows, schema, group_size, retire_after)

    def put(self, partition: str, sample_ids: Sequence[str], fields: Mapping[str, Sequence[Any] | np.ndarray], *,
            group_ids: Sequence[str] | None = None, versions: Sequence[int] | None = None,
            timeout_s: float | None = None, overwrite: bool = False) -> None:
        """See :meth:`relax_agent.data.TransferQueue.put`; waits for free rows until ``timeout_s``.

        Raises:
            QueueTimeoutError: the partition still lacks room for the new rows after ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._expire()
                plan = self._store.plan_put(partition, sample_ids, fields, group_ids, versions, overwrite)
                free = self._store.free_rows(partition)
                if free >= plan.new_rows:
                    break
                if not self._wait(deadline):
                    raise QueueTimeoutError(f"put of {plan.new_rows} new rows to partition {partition!r}: still "
                                            f"{free} free rows after timeout_s={timeout_s}")
            self._store.commit_put(plan)
            self._cond.notify_all()

    def get(self, partition: str, fields: Sequence[str], consumer: str, batch_size: int,
            timeout_s: float | None = None, sampler: str | Sampler = "fifo") -> Batch:
        """See :meth:`relax_agent.data.TransferQueue.get`; waits for ready rows until ``timeout_s``.

        Raises:
            QueueTimeoutError: no batch is ready after ``timeout_s`` (the message says what is missing).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._expire()
                taken = self._store.take(partition, fields, consumer, batch_size, sampler, time.monotonic())
                if taken is not None:
                    break
                if not self._wait(deadline):
                    raise QueueTimeoutError(f"get of {batch_size} rows with fields {list(fields)} for consumer "
                                            f"{consumer!r} from partition {partition!r}: not ready after "
                                            f"timeout_s={timeout_s}; "
                                            f"{self._store.not_ready(partition, fields, consumer, batch_size)}")
        return _batch(taken, partition, consumer)

    def read(self, partition: str, sample_ids: Sequence[str], fields: Sequence[str]) -> dict[str, np.ndarray | list]:
        """See :meth:`relax_agent.data.TransferQueue.read`."""
        with self._cond:
            taken = self._store.read(partition, sample_ids, fields)
        return _batch(taken, partition, "").fields

    def ack(self, lease_id: str) -> bool:
        """See :meth:`relax_agent.data.TransferQueue.ack`; wakes waiting puts (retired rows free room)."""
        with self._cond:
            done = self._store.ack(lease_id)
            self._cond.notify_all()
            return done

    def nack(self, lease_id: str) -> bool:
        """See :meth:`relax_agent.data.TransferQueue.nack`; wakes waiting gets."""
        with self._cond:
            done = self._store.nack(lease_id)
            self._cond.notify_all()
            return done

    def clear(self, partition: str) -> None:
        """See :meth:`relax_agent.data.TransferQueue.clear`; wakes every waiter."""
        with self._cond:
            self._store.clear(partition)
            self._cond.notify_all()

    def stats(self, partition: str) -> dict[str, Any]:
        """See :meth:`relax_agent.data.TransferQueue.stats` (expired leases are ended first)."""
        with self._cond:
            self._expire()
            return self._store.stats(partition)

    def close(self) -> None:
        """Drop every partition (a fresh, empty store)."""
        with self._cond:
            self._store = Store(self.cfg.lease_timeout_s)

    def _expire(self) -> None:
        if self._store.expire(time.monotonic()):
            self._cond.notify_all()

    def _wait(self, deadline: float | None) -> bool:
        """Wait for a change, a lease deadline or ``deadline``; False once ``deadline`` passed."""
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        wake = [t for t in (deadline, self._store.next_deadline()) if t is not None]
        self._cond.wait(max(0.0, min(wake) - now) if wake else None)
        return True


def _batch(taken: Taken, partition: str, consumer: str) -> Batch:
    fields = {
        name: assemble(taken.specs[name], [stored.values[start:stop] for stored, start, stop in segments])
        for name, segments in taken.segments.items()
    }
    return Batch(taken.lease_id, partition, consumer, taken.sample_ids, taken.group_ids, taken.versions, fields)
