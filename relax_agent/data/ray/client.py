"""The handle of the Ray data bus every process holds (:class:`RayTransferQueue`): it attaches to (or
creates) the named metadata actor, puts large values in the object store, and reads replies back."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray

from relax_agent.data.channel import ChannelClient
from relax_agent.data.config import DataConfig
from relax_agent.data.protocol import Batch
from relax_agent.data.ray.actor import MetadataActor
from relax_agent.data.ray.cluster import on_this_node
from relax_agent.data.ray.wire import LOST, Parked, dead_rows, unpack
from relax_agent.data.samplers import Sampler
from relax_agent.data.schema import OBJECT, FieldSpec
from relax_agent.data.store import RefField, check_ids, check_versions
from relax_agent.errors import ConfigError, DataError

log = logging.getLogger("relax_agent.data")


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
                                      get_if_exists=True, scheduling_strategy=on_this_node()).remote(
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
            if ok and isinstance(value, Parked):
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
                out = unpack(partition, ids, pieces, specs, blob, "their lease is released")
            except DataError as exc:
                dead = dead_rows(pieces) if isinstance(exc.__cause__, LOST) else []
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
        return unpack(partition, ids, pieces, specs, blob, "nothing was read")

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
