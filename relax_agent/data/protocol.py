"""The data-bus interface every backend implements, and the batch a ``get`` returns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from relax_agent.data.samplers import Sampler
from relax_agent.data.schema import FieldSpec


@dataclass(frozen=True)
class Batch:
    """Rows leased to one consumer by ``get``; ``ack(lease_id)`` once they are consumed.

    Attributes:
        lease_id: pass to ``ack`` / ``nack``.
        partition, consumer: where the rows came from and who holds them.
        sample_ids, group_ids: ``[batch]`` row keys, in batch order.
        versions: ``[batch]`` policy version that produced each sample.
        fields: per requested field, ``np.ndarray [batch, *shape]`` for non-ragged numeric
            fields (read-only; a view of the stored chunk when the rows were put together),
            else a list of ``batch`` rows (ragged rows ``[n_i, *shape]``, or Python objects).
    """

    lease_id: str
    partition: str
    consumer: str
    sample_ids: list[str]
    group_ids: list[str]
    versions: list[int]
    fields: dict[str, np.ndarray | list]

    def __len__(self) -> int:
        return len(self.sample_ids)


class TransferQueue(Protocol):
    """A field-level store of rows keyed by sample id, with per-consumer cursors and leases.

    Rows live in named partitions (one per training step, or one shared queue). Producers
    write fields of rows independently and at different times; a consumer's ``get`` blocks
    until ``batch_size`` rows have all the fields it asks for, and leases them to it until
    ``ack``. Leases that are not acked within ``lease_timeout_s`` expire and their rows are
    handed out again (at-least-once); acks are idempotent, so a consumer that acks each lease
    once sees each row counted once.
    """

    def create_partition(
        self,
        partition: str,
        capacity_rows: int,
        schema: Mapping[str, FieldSpec | str | tuple] | None = None,
        *,
        group_size: int | None = None,
        retire_after: Sequence[str] = (),
    ) -> None:
        """Create ``partition`` holding at most ``capacity_rows`` rows (idempotent with equal settings).

        Args:
            schema: field name -> :class:`FieldSpec` (or dtype name / ``(dtype, shape, ragged)``);
                with a schema, other fields are refused. Without one, the first put of a field
                fixes its spec.
            group_size: rows per GRPO group, for ``sampler="group"``.
            retire_after: consumers whose acks retire a row: once each of them acked it, the
                row is dropped and frees capacity. Empty: rows stay until ``clear``.

        Raises:
            DataError: bad capacity, group size or spec, or the partition exists with other settings.
        """
        ...

    def put(
        self,
        partition: str,
        sample_ids: Sequence[str],
        fields: Mapping[str, Sequence[Any] | np.ndarray],
        *,
        group_ids: Sequence[str] | None = None,
        versions: Sequence[int] | None = None,
        timeout_s: float | None = None,
        overwrite: bool = False,
    ) -> None:
        """Write ``fields`` for ``sample_ids`` (all or nothing).

        With ``group_ids`` and ``versions`` the ids are new rows; without, they must exist and
        get the fields added. A field's values are an array ``[rows, ...]`` (stored without a
        copy: do not modify it afterwards) or a sequence of per-row values. New rows wait while
        the partition is full (back-pressure).

        Raises:
            DataError: unknown partition or field, wrong dtype or shape, duplicate or unknown
                sample id, a field written twice without ``overwrite``; nothing is stored.
            QueueTimeoutError: no room for the new rows within ``timeout_s``; nothing is stored.
        """
        ...

    def get(
        self,
        partition: str,
        fields: Sequence[str],
        consumer: str,
        batch_size: int,
        timeout_s: float | None = None,
        sampler: str | Sampler = "fifo",
    ) -> Batch:
        """Lease ``batch_size`` rows that have all ``fields`` and that ``consumer`` has neither
        acked nor leased; blocks until the sampler (``"fifo"``, ``"group"`` or a
        :class:`Sampler`) finds them. Each consumer name has its own cursor.

        A partition created with a schema refuses a field outside it at once (``DataError``
        naming it). Without a schema any field may still be written later by another producer,
        so ``get`` waits for it: pass ``timeout_s`` where a field might never come; the
        timeout's message names the requested fields no row has yet (or how many rows are ready).

        Raises:
            DataError: unknown partition, unknown field (with a schema), bad sampler.
            QueueTimeoutError: not ready within ``timeout_s``; names the fields no row has yet.
        """
        ...

    def read(self, partition: str, sample_ids: Sequence[str], fields: Sequence[str]) -> dict[str, np.ndarray | list]:
        """The ``fields`` of live rows ``sample_ids``, in that order, as ``Batch.fields`` holds them;
        no lease, no cursor: for a reader the lease holder named the rows to (the trainer service
        reads the rows of a step the loop leased). Rows stay readable until retired.

        Raises:
            DataError: unknown partition or field, an id repeated or not a live row (retired or never
                put), a row without one of ``fields``.
        """
        ...

    def ack(self, lease_id: str) -> bool:
        """Mark a lease's rows consumed; True the first time, False on a repeat (idempotent).

        Raises:
            LeaseError: unknown lease, or expired after its rows were handed out again.
        """
        ...

    def nack(self, lease_id: str) -> bool:
        """Hand a lease's rows out again now; False if the lease had already ended.

        Raises:
            LeaseError: unknown lease, or already acked.
        """
        ...

    def clear(self, partition: str) -> None:
        """Drop every row, cursor and lease of ``partition`` (settings and schema stay)."""
        ...

    def stats(self, partition: str) -> dict[str, Any]:
        """Counters: rows, capacity_rows, put_rows, retired_rows, redelivered_rows, dead_rows (rows
        dropped because a value was lost, Ray backend without adopted values), fields,
        consumers (acked / leased per consumer), active_leases."""
        ...

    def close(self) -> None:
        """Release the backend (wakes no waiter; call when no put/get is in flight)."""
        ...
