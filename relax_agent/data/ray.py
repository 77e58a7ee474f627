"""Ray data bus: a metadata actor (asyncio, never blocks its loop) and the Ray object store.

Any process of the Ray cluster builds a :class:`RayTransferQueue` with the same
``ray_actor_name`` and shares one bus (the actor lives in ``ray_namespace``, not in the
driver's own, often anonymous, namespace); the object pickles, so it can be handed to actors.
Values of object fields must pickle with plain pickle (checked at put): the socket channel
pickles every reply, and a read that cannot unpickle its rows releases their lease at once.

- The actor holds one :class:`~relax_agent.data.store.Store`: rows, cursors and leases. Its
  methods are coroutines; a blocked ``put`` or ``get`` awaits an ``asyncio.Condition`` (with
  a timeout at the next lease deadline), so one waiting consumer never stalls the others.
- A field value larger than ``ray_inline_max_bytes`` is ``ray.put`` once by the producer and
  only its reference and shapes reach the actor; consumers ``ray.get`` it and receive
  read-only numpy views of shared memory (zero-copy). Smaller values travel inside the
  actor's messages and live in the actor.
- Processes on the actor's node send calls without object references over an authenticated
  Unix socket instead of Ray tasks (:mod:`.channel`; ``ray_direct_channel``): same state,
  a fraction of the per-call cost.
- Ray's ownership model applies to the large values: they live as long as the producer
  process that put them. Once a producer has died, Ray may free them at any time (when is up
  to Ray: a copy cached on the reading node can stay readable for a while); a ``get`` that
  meets a freed value drops those rows for good (with the rest of their group in a grouped
  partition), logs a warning, counts them (``dead_rows``) and goes on with the rows behind them; a
  ``read`` of one raises :class:`DataError` naming the rows.
  With ``ray_adopt_values`` the actor re-puts (and so owns) them: they outlive the producer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from relax_agent.data.channel import ChannelClient, ChannelServer
from relax_agent.data.config import DataConfig
from relax_agent.data.protocol import Batch
from relax_agent.data.samplers import Sampler
from relax_agent.data.schema import OBJECT, FieldSpec, assemble
from relax_agent.data.store import RefField, Store, check_ids, check_versions
from relax_agent.errors import ConfigError, DataError, QueueTimeoutError

log = logging.getLogger("relax_agent.data")


@dataclass(frozen=True)
class _InStore:
    """A reference to a chunk in the object store, as the actor hands it out (Ray passes
    references nested in a value through without resolving them)."""

    ref: Any


@dataclass(frozen=True)
class _Inline:
    """A slice of a stored chunk that travels inside a ``get`` reply: item ``index`` of the reply's
    pickled ``inline`` list (pickled by the actor, unpickled by the reader, so that a value one
    side cannot handle fails one read, whose lease is then released, and nothing else)."""

    index: int


@dataclass(frozen=True)
class _Parked:
    """A channel reply that holds object references: fetch it through Ray with ``unpark``."""

    token: int


_LOST = (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)
"""What ``ray.get`` raises for a value freed with its owner."""

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
                _check_picklable(args[0], args[1], args[2])
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
        if pieces is not None and any(isinstance(box, _InStore) for segs in pieces.values() for box, _, _ in segs):
            token = next(self._tokens)
            self._parked[token] = reply
            return True, _Parked(token)
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
            pieces, blob = _pack(taken)
        except DataError:  # checked at put, so only a value that changed since: release the rows
            self._store.nack(taken.lease_id)
            self._cond.notify_all()
            raise
        return taken.lease_id, taken.sample_ids, taken.group_ids, taken.versions, pieces, taken.specs, blob

    async def _read(self, partition: str, sample_ids: list[str], fields: list[str]) -> tuple:
        taken = self._store.read(partition, sample_ids, fields)
        pieces, blob = _pack(taken)
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


def _pack(taken: Any) -> tuple[dict[str, list[tuple[Any, int, int]]], bytes]:
    """A reply's field pieces (object-store references stay references) and its pickled inline values.

    Raises:
        DataError: a value cannot be pickled for the reader.
    """
    inline: list[Any] = []
    pieces: dict[str, list[tuple[Any, int, int]]] = {}
    for name, segments in taken.segments.items():
        pieces[name] = []
        for stored, start, stop in segments:
            if stored.is_ref:
                pieces[name].append((_InStore(stored.values), start, stop))
            else:
                pieces[name].append((_Inline(len(inline)), 0, stop - start))
                inline.append(stored.values[start:stop])
    try:
        return pieces, pickle.dumps(inline, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise DataError(f"rows {taken.sample_ids} hold values that cannot be pickled for the reader "
                        f"({type(exc).__name__}: {exc}); a lease on them is released") from exc


LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0}
"""Ray system config of a local Ray this project starts. Ray runs its worker processes at nice 15 by
default; every role of a run (trainer, rollout replicas, data bus, weight coordinator, heartbeats)
is a Ray worker, so at nice 15 any other busy process on the machine starves the run: a nice-0 busy
loop on each core leaves each worker about 3% of a core, heartbeats lag past
``runtime.heartbeat_timeout_s`` and healthy replicas are replaced as hung. At nice 0 they get a fair
share. (A cluster joined through ``data.ray_address`` keeps its own setting.)"""


def _on_this_node() -> Any:
    """Put the metadata actor on the creating process's node (on a cluster of several hosts the bus
    stays with the driver, not on a worker host that may die)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def start_ray(cfg: DataConfig) -> bool:
    """Make sure Ray runs for the data bus: connect to ``cfg.ray_address`` when set, else start a
    local Ray with ``cfg.ray_num_cpus`` CPUs, no dashboard and :data:`LOCAL_RAY_SYSTEM_CONFIG`.
    Nothing happens when Ray is already initialised in this process.

    Returns:
        True when this call started (or connected) Ray: the caller ``ray.shutdown()``\ s it.

    Raises:
        ConfigError: Ray could not start or connect (names ``data.ray_address`` / ``data.ray_num_cpus``).
    """
    if ray.is_initialized():
        return False
    try:
        if cfg.ray_address is not None:
            ray.init(address=cfg.ray_address, include_dashboard=False)
        else:
            ray.init(num_cpus=cfg.ray_num_cpus, include_dashboard=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = (f"connect to data.ray_address={cfg.ray_address!r}" if cfg.ray_address is not None
                 else f"start a local Ray with data.ray_num_cpus={cfg.ray_num_cpus}")
        raise ConfigError(f"data.backend='ray': cannot {where}: {type(exc).__name__}: {exc}") from exc
    return True


def unpickle_rows(blob: bytes) -> list[Any]:
    """The inline values of a ``get`` reply (the seam where a reader meets values it cannot load)."""
    return pickle.loads(blob)


def _check_picklable(partition: str, sample_ids: list[str], fields: dict[str, Any]) -> None:
    """Refuse inline values that plain pickle cannot carry to a reader: the socket channel pickles
    every reply, so a value only Ray's cloudpickle handles (a lambda, a class defined in a
    driver's ``__main__``) would fail every read of its row.

    Raises:
        DataError: names the field, the sample and the pickling error.
    """
    for name, values in fields.items():
        if isinstance(values, RefField) or (isinstance(values, np.ndarray) and values.dtype.kind != "O"):
            continue
        try:
            pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            for sid, value in zip(sample_ids, values, strict=True):
                try:
                    pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:
                    raise DataError(f"partition {partition!r}: field {name!r} of sample {sid!r}: a "
                                    f"{type(value).__name__} value cannot be pickled by the bus "
                                    f"({type(exc).__name__}: {exc}); put values whose classes every process "
                                    "can import (no lambdas, local or __main__ classes)") from exc
            raise


class RayTransferQueue:
    """The Ray backend of :class:`relax_agent.data.TransferQueue` (see there for the API).

    Raises:
        ConfigError: Ray is not initialised (call ``ray.init(num_cpus=...)`` first).
        DataError: the named metadata actor did not start, or kept dying, within 30 s.
    """

    def __init__(self, cfg: DataConfig | None = None) -> None:
        self.cfg = cfg or DataConfig(backend="ray")
        if not ray.is_initialized():
            raise ConfigError("data.backend='ray' needs a running Ray: call ray.init(num_cpus=...) or "
                              "relax_agent.data.ray.start_ray(cfg) first")
        self._actor = self._attach()
        self._channel: ChannelClient | None = None
        self._channel_lock = threading.Lock()
        self._channel_checked = False
        self._closed = False

    def _attach(self, timeout_s: float = 30.0) -> Any:
        """The named metadata actor, created if absent and waited on until it answers.

        A named actor whose last handle was just dropped is still found by name while Ray tears it
        down; such a handle dies on its first call, so attaching waits for the name to free and
        creates the actor anew.

        Raises:
            DataError: no live metadata actor answered within ``timeout_s`` seconds.
        """
        actor_cls = ray.remote(num_cpus=0, max_concurrency=1000)(MetadataActor)
        deadline = time.monotonic() + timeout_s
        while True:
            actor = actor_cls.options(name=self.cfg.ray_actor_name, namespace=self.cfg.ray_namespace,
                                      get_if_exists=True, scheduling_strategy=_on_this_node()).remote(
                self.cfg.lease_timeout_s, self.cfg.ray_adopt_values)
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=max(deadline - time.monotonic(), 0.1))
                return actor
            except ray.exceptions.ActorDiedError as exc:
                if time.monotonic() > deadline:
                    raise DataError(f"data bus: metadata actor {self.cfg.ray_actor_name!r} kept dying while "
                                    f"attaching for {timeout_s:.0f} s: {exc}") from exc
                time.sleep(0.2)
            except ray.exceptions.GetTimeoutError as exc:
                raise DataError(f"data bus: metadata actor {self.cfg.ray_actor_name!r} did not start within "
                                f"{timeout_s:.0f} s (is the Ray cluster out of resources?)") from exc

    def __getstate__(self) -> dict[str, Any]:
        return {"cfg": self.cfg, "_actor": self._actor}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._channel, self._channel_lock, self._channel_checked = None, threading.Lock(), False
        self._closed = False

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise DataError(f"data bus: {method} after close() (close() stopped the metadata actor)")

    def _call(self, method: str, *args: Any) -> Any:
        self._check_open(method)
        channel = self._same_node_channel()
        has_refs = method == "put" and any(isinstance(v, RefField) for v in args[2].values())
        if channel is None or has_refs:
            ok, value = ray.get(self._actor.call.remote(method, *args))
        else:
            ok, value = channel.call(method, args)
            if ok and isinstance(value, _Parked):
                ok, value = ray.get(self._actor.unpark.remote(value.token))
        if not ok:
            raise value
        return value

    def _same_node_channel(self) -> ChannelClient | None:
        """The Unix-socket channel when enabled and this process runs on the actor's node."""
        if not self._channel_checked:
            with self._channel_lock:
                if not self._channel_checked and self.cfg.ray_direct_channel:
                    address, authkey, node_id = ray.get(self._actor.channel.remote())
                    if node_id == ray.get_runtime_context().get_node_id():
                        self._channel = ChannelClient(address, authkey)
                self._channel_checked = True
        return self._channel

    def create_partition(self, partition: str, capacity_rows: int,
                         schema: Mapping[str, FieldSpec | str | tuple] | None = None, *,
                         group_size: int | None = None, retire_after: Sequence[str] = ()) -> None:
        """See :meth:`relax_agent.data.TransferQueue.create_partition` (runs on the store actor)."""
        self._call("create_partition", partition, capacity_rows, None if schema is None else dict(schema),
                   group_size, tuple(retire_after))

    def put(self, partition: str, sample_ids: Sequence[str], fields: Mapping[str, Sequence[Any] | np.ndarray], *,
            group_ids: Sequence[str] | None = None, versions: Sequence[int] | None = None,
            timeout_s: float | None = None, overwrite: bool = False) -> None:
        """See :meth:`relax_agent.data.TransferQueue.put`; ids and versions are checked here, before
        anything is sent to the store actor."""
        self._check_open("put")
        ids = check_ids(partition, "sample_ids", sample_ids)  # before anything is sent
        groups = None if group_ids is None else check_ids(partition, "group_ids", group_ids)
        checked = None if versions is None else check_versions(partition, versions)
        payload = {name: self._encode(values) for name, values in fields.items()}
        self._call("put", partition, ids, payload, groups, checked, timeout_s, overwrite)

    def _encode(self, values: Sequence[Any] | np.ndarray) -> Any:
        """Large arrays (or lists of arrays of one dtype) go to the object store, the rest inline."""
        limit = self.cfg.ray_inline_max_bytes
        if isinstance(values, np.ndarray):
            if values.nbytes > limit and values.ndim >= 1 and values.dtype.kind != "O":
                return RefField(ray.put(values), values.dtype.name, [values.shape[1:]] * len(values))
            return values
        rows = list(values)
        if rows and all(isinstance(r, np.ndarray) for r in rows):
            dtypes = {r.dtype.name for r in rows}
            if len(dtypes) == 1 and OBJECT not in dtypes and sum(r.nbytes for r in rows) > limit:
                return RefField(ray.put(rows), dtypes.pop(), [r.shape for r in rows])
        return rows

    def get(self, partition: str, fields: Sequence[str], consumer: str, batch_size: int,
            timeout_s: float | None = None, sampler: str | Sampler = "fifo") -> Batch:
        """See :meth:`relax_agent.data.TransferQueue.get`. Rows whose object-store values were lost
        (their producer died, values not adopted) are dropped from the bus with a warning and
        counted (``dead_rows``); the get goes on with the rows behind them."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            lease_id, ids, group_ids, versions, pieces, specs, blob = self._call(
                "get", partition, list(fields), consumer, batch_size, left, sampler)
            try:
                out = _unpack(partition, ids, pieces, specs, blob, "their lease is released")
            except DataError as exc:
                dead = _dead_rows(pieces) if isinstance(exc.__cause__, _LOST) else []
                if not dead:
                    self._release(lease_id)
                    raise
                dropped = self._call("drop_dead", lease_id, [ids[i] for i in dead])
                log.warning("data bus: partition %r: dropped %d rows whose values were lost with their producer "
                            "(%s); set data.ray_adopt_values to keep values past their producer", partition,
                            len(dropped), dropped[:5])
                continue
            return Batch(lease_id, partition, consumer, ids, group_ids, versions, out)

    def read(self, partition: str, sample_ids: Sequence[str], fields: Sequence[str]) -> dict[str, np.ndarray | list]:
        """See :meth:`relax_agent.data.TransferQueue.read` (runs on the store actor)."""
        ids = check_ids(partition, "sample_ids", sample_ids)
        pieces, specs, blob = self._call("read", partition, ids, list(fields))
        return _unpack(partition, ids, pieces, specs, blob, "nothing was read")

    def _release(self, lease_id: str) -> None:
        """Hand the rows of a lease this process could not read out again now (not after the lease timeout)."""
        try:
            self._call("nack", lease_id)
        except LookupError:  # expired or cleared meanwhile: nothing is held
            pass

    def ack(self, lease_id: str) -> bool:
        """See :meth:`relax_agent.data.TransferQueue.ack` (runs on the store actor)."""
        return self._call("ack", lease_id)

    def nack(self, lease_id: str) -> bool:
        """See :meth:`relax_agent.data.TransferQueue.nack` (runs on the store actor)."""
        return self._call("nack", lease_id)

    def clear(self, partition: str) -> None:
        """See :meth:`relax_agent.data.TransferQueue.clear` (runs on the store actor)."""
        self._call("clear", partition)

    def stats(self, partition: str) -> dict[str, Any]:
        """See :meth:`relax_agent.data.TransferQueue.stats` (runs on the store actor)."""
        return self._call("stats", partition)

    def close(self) -> None:
        """Stop the metadata actor (every process sharing this bus loses it); later calls through
        this handle raise :class:`DataError`. Idempotent."""
        if not self._closed:
            self._closed = True
            ray.kill(self._actor)


def _unpack(partition: str, ids: list[str], pieces: dict[str, list[tuple[Any, int, int]]], specs: dict[str, Any],
            blob: bytes, then: str) -> dict[str, np.ndarray | list]:
    """The fields of a ``get`` or ``read`` reply: inline values unpickled, object-store pieces fetched.

    Raises:
        DataError: a value this process cannot unpickle, or one whose producer died (``then`` says
            what became of the rows).
    """
    refs = list({box.ref: None for segs in pieces.values() for box, _, _ in segs if isinstance(box, _InStore)})
    try:
        inline = unpickle_rows(blob)
    except Exception as exc:
        raise DataError(f"partition {partition!r}: rows {ids} hold values this process cannot unpickle "
                        f"({type(exc).__name__}: {exc}); {then} (put values whose classes "
                        "every process of the cluster can import)") from exc
    try:
        resolved = dict(zip(refs, ray.get(refs), strict=True))
    except _LOST as exc:
        raise DataError(f"partition {partition!r}: rows {ids} hold values whose producer process died "
                        f"({type(exc).__name__}); {then}; clear the partition") from exc
    out = {}
    for name, segs in pieces.items():
        parts = [(resolved[box.ref] if isinstance(box, _InStore) else inline[box.index])[start:stop]
                 for box, start, stop in segs]
        out[name] = assemble(specs[name], parts)
    return out


def _dead_rows(pieces: dict[str, list[tuple[Any, int, int]]]) -> list[int]:
    """Batch positions of rows whose object-store values are lost (owner died, object freed); empty
    when every value is reachable (the common case costs one wait on the references, no copy)."""
    refs = [box.ref for segs in pieces.values() for box, _, _ in segs if isinstance(box, _InStore)]
    if not refs:
        return []
    dead: set[int] = set()
    for segs in pieces.values():
        row = 0
        for box, start, stop in segs:
            if isinstance(box, _InStore) and _lost(box.ref):
                dead.update(range(row, row + stop - start))
            row += stop - start
    return sorted(dead)


def _lost(ref: Any) -> bool:
    try:
        ray.get(ref, timeout=30.0)
    except _LOST:
        return True
    return False
