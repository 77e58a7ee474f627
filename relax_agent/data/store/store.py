"""The store itself: partitions created and cleared, ready rows taken under a lease by a sampler,
live rows read by id, and each partition's counters."""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from relax_agent.data.samplers import RowMeta, Sampler, resolve_sampler
from relax_agent.data.schema import FieldSpec, parse_spec
from relax_agent.data.store.checks import check_ids
from relax_agent.data.store.leases import Leases
from relax_agent.data.store.puts import Puts
from relax_agent.data.store.state import Consumer, Lease, Partition, Taken, segments
from relax_agent.errors import DataError


class Store(Puts, Leases):
    """All partitions and leases of one data bus (see the package docstring)."""

    def __init__(self, lease_timeout_s: float) -> None:
        self.lease_timeout_s = lease_timeout_s
        self._partitions: dict[str, Partition] = {}
        self._leases: dict[str, Lease] = {}
        self._finished: OrderedDict[str, tuple[str, Lease]] = OrderedDict()
        self._ids = itertools.count()
        self._token = uuid.uuid4().hex[:8]

    # -- partitions -------------------------------------------------------------------------

    def create_partition(
        self,
        partition: str,
        capacity_rows: int,
        schema: Mapping[str, FieldSpec | str | tuple] | None = None,
        group_size: int | None = None,
        retire_after: Sequence[str] = (),
    ) -> None:
        """See :meth:`relax_agent.data.TransferQueue.create_partition`."""
        if capacity_rows < 1:
            raise DataError(f"partition {partition!r}: capacity_rows={capacity_rows} must be at least 1")
        if group_size is not None and group_size < 1:
            raise DataError(f"partition {partition!r}: group_size={group_size} must be at least 1")
        specs = {name: parse_spec(s) for name, s in (schema or {}).items()}
        new = Partition(partition, capacity_rows, specs, schema is not None, group_size, tuple(retire_after))
        old = self._partitions.get(partition)
        if old is not None:
            same = (old.capacity_rows, old.fixed_schema, old.group_size, old.retire_after) == (
                new.capacity_rows, new.fixed_schema, new.group_size, new.retire_after)
            if not same or (new.fixed_schema and old.schema != new.schema):
                raise DataError(f"partition {partition!r} already exists with other settings")
            return
        self._partitions[partition] = new

    def clear(self, partition: str) -> None:
        """Drop every row, cursor and lease of ``partition``; it keeps its settings and schema."""
        part = self._partition(partition)
        for lease in [lease for lease in self._leases.values() if lease.partition == partition]:
            self._finish(lease, "cleared")
        fresh = Partition(part.name, part.capacity_rows, part.schema, part.fixed_schema, part.group_size,
                          part.retire_after)
        fresh.cleared = part.cleared | part.retired | part.dead | set(part.rows)
        self._partitions[partition] = fresh

    def free_rows(self, partition: str) -> int:
        """Rows ``partition`` can still take before it reaches ``capacity_rows``."""
        part = self._partition(partition)
        return part.capacity_rows - len(part.rows)

    # -- get ----------------------------------------------------------------------------------

    def check_fields(self, partition: str, fields: Sequence[str]) -> None:
        """Check the ``fields`` a get asks of ``partition``.

        Raises:
            DataError: no field is named, or (fixed schema) a field is not in the schema.
        """
        part = self._partition(partition)
        if not fields:
            raise DataError(f"partition {partition!r}: get needs at least one field")
        if part.fixed_schema:
            unknown = [f for f in fields if f not in part.schema]
            if unknown:
                raise DataError(f"partition {partition!r}: unknown field(s) {unknown}; the schema has "
                                f"{sorted(part.schema)}")

    def not_ready(self, partition: str, fields: Sequence[str], consumer: str, batch_size: int) -> str:
        """Why a get is still waiting, for its timeout message: the requested fields no row of the
        partition has yet, else how many rows the consumer could take."""
        part = self._partition(partition)
        missing = [f for f in fields if not any(f in row.values for row in part.rows.values())]
        if missing:
            return (f"no row has field(s) {missing} yet (fields written so far: {sorted(part.schema)}; "
                    "a field nobody writes is never ready)")
        cons = part.consumer(consumer)
        ready = sum(1 for _ in self._ready(part, cons, fields))
        return f"{ready} of batch_size={batch_size} rows have all fields and are free for {consumer!r}"

    def take(self, partition: str, fields: Sequence[str], consumer: str, batch_size: int,
             sampler: str | Sampler, now: float) -> Taken | None:
        """Lease ``batch_size`` ready rows to ``consumer``, or ``None`` if the sampler wants more.

        Raises:
            DataError: unknown partition/field, ``batch_size`` below 1 or above the capacity, bad sampler.
        """
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size} must be at least 1")
        self.check_fields(partition, fields)
        part = self._partitions[partition]
        if batch_size > part.capacity_rows:
            raise DataError(f"partition {partition!r}: batch_size={batch_size} can never be ready with "
                            f"capacity_rows={part.capacity_rows}")
        pick = resolve_sampler(sampler, part.group_size, partition)
        cons = part.consumer(consumer)
        chosen = pick.select(self._ready(part, cons, fields), batch_size)
        if not chosen:
            return None
        lease_id = f"{self._token}-{next(self._ids)}"
        self._leases[lease_id] = Lease(lease_id, partition, consumer, chosen, now + self.lease_timeout_s)
        rows = [part.rows[sid] for sid in chosen]
        for sid in chosen:
            cons.leased[sid] = lease_id
        return Taken(
            lease_id, chosen, [r.group_id for r in rows], [r.version for r in rows],
            {name: segments(rows, name) for name in fields}, {name: part.schema[name] for name in fields},
        )

    def _ready(self, part: Partition, cons: Consumer, fields: Sequence[str]) -> Iterator[RowMeta]:
        order = part.order
        while cons.start < len(order) and (order[cons.start] is None or order[cons.start] in cons.acked):
            cons.start += 1
        for sid in itertools.islice(order, cons.start, None):
            if sid is None or sid in cons.acked or sid in cons.leased:
                continue
            row = part.rows[sid]
            if all(f in row.values for f in fields):
                yield RowMeta(sid, row.group_id, row.version, row.lengths)

    def read(self, partition: str, sample_ids: Sequence[str], fields: Sequence[str]) -> Taken:
        """The ``fields`` of live rows ``sample_ids`` in that order, without a lease (``lease_id`` is
        empty): a reader that was handed the ids by their lease holder (the trainer, by the loop).

        Raises:
            DataError: unknown partition or field, an empty or repeated id list, an id that is not a
                live row (never put, or retired: named with which), a row without one of ``fields``.
        """
        ids = check_ids(partition, "sample_ids", sample_ids)
        if not ids:
            raise DataError(f"read from partition {partition!r}: no sample_ids given")
        if len(set(ids)) != len(ids):
            raise DataError(f"read from partition {partition!r}: sample_ids repeat "
                            f"{sorted({sid for sid in ids if ids.count(sid) > 1})[:3]}")
        self.check_fields(partition, fields)
        part = self._partitions[partition]
        gone = [sid for sid in ids if sid not in part.rows]
        if gone:
            retired = [sid for sid in gone if sid in part.retired]
            raise DataError(f"read from partition {partition!r}: {len(gone)} of {len(ids)} rows are not live "
                            f"({len(retired)} retired, {len(gone) - len(retired)} never put), e.g. {gone[:3]}")
        rows = [part.rows[sid] for sid in ids]
        lacking = {name: [sid for sid, row in zip(ids, rows, strict=True) if name not in row.values] for name in fields}
        lacking = {name: bad for name, bad in lacking.items() if bad}
        if lacking:
            name, bad = next(iter(lacking.items()))
            raise DataError(f"read from partition {partition!r}: rows {bad[:3]} have no field {name!r} yet")
        return Taken("", ids, [r.group_id for r in rows], [r.version for r in rows],
                     {name: segments(rows, name) for name in fields}, {name: part.schema[name] for name in fields})

    # -- stats ----------------------------------------------------------------------------------

    def stats(self, partition: str) -> dict[str, Any]:
        """Counters of one partition: rows, capacity, fields, per-consumer acked/leased, leases."""
        part = self._partition(partition)
        return {
            "rows": len(part.rows),
            "capacity_rows": part.capacity_rows,
            "put_rows": part.put_rows,
            "retired_rows": len(part.retired),
            "redelivered_rows": part.redelivered_rows,
            "dead_rows": len(part.dead),
            "fields": {name: str(spec) for name, spec in part.schema.items()},
            "consumers": {name: {"acked": len(c.acked), "leased": len(c.leased)} for name, c in part.consumers.items()},
            "active_leases": sum(1 for lease in self._leases.values() if lease.partition == partition),
        }
