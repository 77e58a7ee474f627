"""The metadata actor: one :class:`~relax_agent.data.store.Store` served from an asyncio loop (a
blocked put or get awaits a condition, never the loop), over Ray calls or the same-node channel."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import ray

from relax_agent.data.channel import ChannelServer
from relax_agent.data.ray.wire import InStore, Parked, check_picklable, pack
from relax_agent.data.samplers import Sampler
from relax_agent.data.store import RefField, Store
from relax_agent.errors import DataError, QueueTimeoutError

_METHODS = frozenset({"create_partition", "put", "get", "read", "ack", "nack", "drop_dead", "clear", "stats"})


class MetadataActor:
    """The Ray actor behind :class:`RayTransferQueue` (created by it; ``max_concurrency`` high)."""

    def __init__(self, lease_timeout_s: float, adopt_values: bool = False) -> None:
        self._adopt_values = adopt_values
        self._store = Store(lease_timeout_s)
        self._cond = asyncio.Condition()
        self._channel: ChannelServer | None = None
        self._parked: dict[int, tuple[bool, Any]] = {}
        self._tokens = itertools.count()

    async def call(self, method: str, *args: Any) -> tuple[bool, Any]:
        """Run one bus method; returns ``(True, result)`` or ``(False, exception)`` so our own
        errors reach the caller with their type."""
        try:
            if method not in _METHODS:
                raise DataError(f"unknown data-bus method {method!r}; expected one of {sorted(_METHODS)}")
            if method == "put":
                check_picklable(args[0], args[1], args[2])
                if self._adopt_values:
                    args = (*args[:2], await self._adopt(args[2]), *args[3:])
            async with self._cond:
                return True, await getattr(self, "_" + method)(*args)
        except (DataError, QueueTimeoutError, LookupError) as exc:
            return False, exc

    async def _adopt(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Re-put the producer's object-store values from this actor, which then owns them, so
        they outlive the producer (one copy inside the object store, off the event loop)."""
        out = {}
        for name, value in fields.items():
            if isinstance(value, RefField):
                data = await value.ref
                value = RefField(await asyncio.to_thread(ray.put, data), value.dtype, value.row_shapes)
            out[name] = value
        return out

    async def channel(self) -> tuple[str, bytes, str]:
        """``(socket path, auth key, node id)`` of the same-node channel, started on first use."""
        if self._channel is None:
            self._channel = ChannelServer(self._channel_call, asyncio.get_running_loop())
        return self._channel.address, self._channel.authkey, ray.get_runtime_context().get_node_id()

    async def _channel_call(self, method: str, args: tuple) -> tuple[bool, Any]:
        try:
            reply = await self.call(method, *args)
        except Exception as exc:  # unexpected: hand it to the caller instead of dropping the connection
            return False, exc
        pieces = None if not reply[0] else reply[1][4] if method == "get" else reply[1][0] if method == "read" else None
        if pieces is not None and any(isinstance(box, InStore) for segs in pieces.values() for box, _, _ in segs):
            token = next(self._tokens)
            self._parked[token] = reply
            return True, Parked(token)
        return reply

    async def unpark(self, token: int) -> tuple[bool, Any]:
        """The reply parked by the channel under ``token`` (object references travel through Ray)."""
        return self._parked.pop(token)

    async def _create_partition(self, *args: Any) -> None:
        self._store.create_partition(*args)

    async def _put(self, partition: str, ids: list[str], fields: dict[str, Any], group_ids: list[str] | None,
                   versions: list[int] | None, timeout_s: float | None, overwrite: bool) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._expire()
            plan = self._store.plan_put(partition, ids, fields, group_ids, versions, overwrite)
            free = self._store.free_rows(partition)
            if free >= plan.new_rows:
                break
            if not await self._wait(deadline):
                raise QueueTimeoutError(f"put of {plan.new_rows} new rows to partition {partition!r}: still "
                                        f"{free} free rows after timeout_s={timeout_s}")
        self._store.commit_put(plan)
        self._cond.notify_all()

    async def _get(self, partition: str, fields: list[str], consumer: str, batch_size: int,
                   timeout_s: float | None, sampler: str | Sampler) -> tuple:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._expire()
            taken = self._store.take(partition, fields, consumer, batch_size, sampler, time.monotonic())
            if taken is not None:
                break
            if not await self._wait(deadline):
                raise QueueTimeoutError(f"get of {batch_size} rows with fields {fields} for consumer {consumer!r} "
                                        f"from partition {partition!r}: not ready after timeout_s={timeout_s}; "
                                        f"{self._store.not_ready(partition, fields, consumer, batch_size)}")
        try:
            pieces, blob = pack(taken)
        except DataError:  # checked at put, so only a value that changed since: release the rows
            self._store.nack(taken.lease_id)
            self._cond.notify_all()
            raise
        return taken.lease_id, taken.sample_ids, taken.group_ids, taken.versions, pieces, taken.specs, blob

    async def _read(self, partition: str, sample_ids: list[str], fields: list[str]) -> tuple:
        taken = self._store.read(partition, sample_ids, fields)
        pieces, blob = pack(taken)
        return pieces, taken.specs, blob

    async def _ack(self, lease_id: str) -> bool:
        done = self._store.ack(lease_id)
        self._cond.notify_all()
        return done

    async def _nack(self, lease_id: str) -> bool:
        done = self._store.nack(lease_id)
        self._cond.notify_all()
        return done

    async def _drop_dead(self, lease_id: str, sample_ids: list[str]) -> list[str]:
        dropped = self._store.drop_dead(lease_id, sample_ids)
        self._cond.notify_all()
        return dropped

    async def _clear(self, partition: str) -> None:
        self._store.clear(partition)
        self._cond.notify_all()

    async def _stats(self, partition: str) -> dict[str, Any]:
        self._expire()
        return self._store.stats(partition)

    def _expire(self) -> None:
        if self._store.expire(time.monotonic()):
            self._cond.notify_all()

    async def _wait(self, deadline: float | None) -> bool:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        wake = [t for t in (deadline, self._store.next_deadline()) if t is not None]
        try:
            await asyncio.wait_for(self._cond.wait(), timeout=max(0.0, min(wake) - now) if wake else None)
        except asyncio.TimeoutError:
            pass
        return True
