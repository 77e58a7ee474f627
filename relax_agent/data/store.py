"""The data bus's state machine: partitions, rows, consumer cursors and leases.

Never blocks and never reads a clock: the backends (:mod:`.local` with a
``threading.Condition``, :mod:`.ray` with an asyncio loop in an actor) wrap it, pass ``now``
(``time.monotonic()``) in, and wait when :meth:`Store.free_rows` or :meth:`Store.take` say so.
Every method either raises without changing state or applies its whole change.

Row values are kept as :class:`Stored` chunks (one per field per put) plus a row index, so a
batch put of ``[rows, ...]`` is stored once and a get of consecutive rows is one slice.
"""

from __future__ import annotations

import itertools
import numbers
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_agent.data.samplers import RowMeta, Sampler, resolve_sampler
from relax_agent.data.schema import FieldSpec, make_chunk, parse_spec
from relax_agent.errors import DataError, LeaseError

_FINISHED_LEASES_KEPT = 100_000


def check_ids(partition: str, what: str, ids: Any) -> list[str]:
    """``ids`` (sample or group ids) as a list of str, each given as a str: ``1`` and ``"1"`` would
    be one row after ``str()``, and a bare string would be read as one id per character.

    Raises:
        DataError: ``ids`` is a str/bytes or not a sequence, or an element is not a str; names it.
    """
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise DataError(f"partition {partition!r}: {what}={ids!r} ({type(ids).__name__}) is not a sequence of "
                        f"ids; expected a list of str (e.g. [{ids!r}] for one row)")
    out = list(ids)
    for i, sid in enumerate(out):
        if not isinstance(sid, str):
            raise DataError(f"partition {partition!r}: {what}[{i}]={sid!r} ({type(sid).__name__}) is not an id; "
                            "expected a str (ids are compared as given: 1 and '1' would collide)")
    return [str(sid) for sid in out]


def check_versions(partition: str, versions: Sequence[Any]) -> list[int]:
    """``versions`` as Python ints: each a non-negative integer (numpy integers count; bool does not).

    Raises:
        DataError: a value is not a non-negative integer; names the value and its index.
    """
    out = []
    for i, v in enumerate(versions):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or v < 0:
            raise DataError(f"partition {partition!r}: versions[{i}]={v!r} ({type(v).__name__}) is not a policy "
                            "version; expected a non-negative int")
        out.append(int(v))
    return out


@dataclass(eq=False)
class Stored:
    """One field's values for the rows of one put: an array ``[rows, ...]``, a list, or (Ray
    backend) an object-store reference to one of those (``is_ref``)."""

    values: Any
    is_ref: bool = False


@dataclass(frozen=True)
class RefField:
    """A field whose values already sit in an object store (Ray backend), described for checks.

    Attributes:
        ref: the reference (opaque to the store).
        dtype: numpy dtype name or ``"object"``.
        row_shapes: each row's shape (``[]`` entries for object rows).
    """

    ref: Any
    dtype: str
    row_shapes: list[tuple[int, ...]]


@dataclass
class _Row:
    seq: int
    group_id: str
    version: int
    values: dict[str, tuple[Stored, int]] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)


@dataclass
class _Consumer:
    acked: set[str] = field(default_factory=set)
    leased: dict[str, str] = field(default_factory=dict)
    start: int = 0
    """Index into the partition's order before which every row is acked by this consumer."""


@dataclass
class _Partition:
    name: str
    capacity_rows: int
    schema: dict[str, FieldSpec]
    fixed_schema: bool
    group_size: int | None
    retire_after: tuple[str, ...]
    rows: dict[str, _Row] = field(default_factory=dict)
    order: list[str | None] = field(default_factory=list)
    retired: set[str] = field(default_factory=set)
    consumers: dict[str, _Consumer] = field(default_factory=dict)
    groups: dict[str, tuple[int, int]] = field(default_factory=dict)
    """group id -> (policy version, live rows) of the groups with live rows."""
    put_rows: int = 0
    redelivered_rows: int = 0
    cleared: set[str] = field(default_factory=set)
    """Ids of rows dropped by ``clear``: never stored again (a reader that held one keeps it unique)."""
    dead: set[str] = field(default_factory=set)
    """Ids of rows dropped because a value of theirs was lost (see :meth:`Store.drop_dead`)."""

    def consumer(self, name: str) -> _Consumer:
        return self.consumers.setdefault(name, _Consumer())


@dataclass
class Lease:
    """Rows handed to one consumer until ack, nack or ``deadline`` (monotonic seconds)."""

    lease_id: str
    partition: str
    consumer: str
    sample_ids: list[str]
    deadline: float


@dataclass(frozen=True)
class Taken:
    """A batch picked by :meth:`Store.take`: the lease and, per field, segments
    ``(chunk, start, stop)`` of consecutive rows in batch order."""

    lease_id: str
    sample_ids: list[str]
    group_ids: list[str]
    versions: list[int]
    segments: dict[str, list[tuple[Stored, int, int]]]
    specs: dict[str, FieldSpec]


@dataclass
class _PutPlan:
    partition: _Partition
    sample_ids: list[str]
    new: list[bool]
    chunks: dict[str, tuple[Stored, FieldSpec, list[int]]]
    group_ids: Sequence[str] | None
    versions: Sequence[int] | None

    @property
    def new_rows(self) -> int:
        return sum(self.new)


class Store:
    """All partitions and leases of one data bus (see the module docstring)."""

    def __init__(self, lease_timeout_s: float) -> None:
        self.lease_timeout_s = lease_timeout_s
        self._partitions: dict[str, _Partition] = {}
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
        new = _Partition(partition, capacity_rows, specs, schema is not None, group_size, tuple(retire_after))
        old = self._partitions.get(partition)
        if old is not None:
            same = (old.capacity_rows, old.fixed_schema, old.group_size, old.retire_after) == (
                new.capacity_rows, new.fixed_schema, new.group_size, new.retire_after)
            if not same or (new.fixed_schema and old.schema != new.schema):
                raise DataError(f"partition {partition!r} already exists with other settings")
            return
        self._partitions[partition] = new

    def _partition(self, partition: str) -> _Partition:
        try:
            return self._partitions[partition]
        except KeyError:
            raise DataError(f"partition {partition!r} does not exist; call create_partition first "
                            f"(existing: {sorted(self._partitions)})") from None

    def clear(self, partition: str) -> None:
        """Drop every row, cursor and lease of ``partition``; it keeps its settings and schema."""
        part = self._partition(partition)
        for lease in [lease for lease in self._leases.values() if lease.partition == partition]:
            self._finish(lease, "cleared")
        fresh = _Partition(part.name, part.capacity_rows, part.schema, part.fixed_schema, part.group_size,
                           part.retire_after)
        fresh.cleared = part.cleared | part.retired | part.dead | set(part.rows)
        self._partitions[partition] = fresh

    def free_rows(self, partition: str) -> int:
        """Rows ``partition`` can still take before it reaches ``capacity_rows``."""
        part = self._partition(partition)
        return part.capacity_rows - len(part.rows)

    # -- put ----------------------------------------------------------------------------------

    def plan_put(
        self,
        partition: str,
        sample_ids: Sequence[str],
        fields: Mapping[str, Any],
        group_ids: Sequence[str] | None = None,
        versions: Sequence[int] | None = None,
        overwrite: bool = False,
    ) -> _PutPlan:
        """Validate a put against the current state without changing it.

        Raises:
            DataError: see :meth:`relax_agent.data.TransferQueue.put`.
        """
        part = self._partition(partition)
        ids = check_ids(partition, "sample_ids", sample_ids)
        if group_ids is not None:
            group_ids = check_ids(partition, "group_ids", group_ids)
        if len(set(ids)) != len(ids):
            dup = next(s for s in ids if ids.count(s) > 1)
            raise DataError(f"partition {partition!r}: sample id {dup!r} appears twice in one put")
        creating = group_ids is not None or versions is not None
        new = self._check_ids(part, ids, group_ids, versions, creating)
        if not fields and not creating:
            raise DataError(f"partition {partition!r}: a put needs fields or new rows")
        if part.capacity_rows < sum(new):
            raise DataError(f"partition {partition!r}: a put of {sum(new)} new rows can never fit "
                            f"capacity_rows={part.capacity_rows}")
        chunks = {name: self._chunk(part, name, values, ids) for name, values in fields.items()}
        if not overwrite:
            for name in chunks:
                for sid, is_new in zip(ids, new, strict=True):
                    if not is_new and name in part.rows[sid].values:
                        raise DataError(f"partition {partition!r}: field {name!r} of sample {sid!r} is already "
                                        "written (pass overwrite=True to replace it)")
        return _PutPlan(part, ids, new, chunks, group_ids, versions)

    def _check_ids(self, part: _Partition, ids: list[str], group_ids: Sequence[str] | None,
                   versions: Sequence[int] | None, creating: bool) -> list[bool]:
        if creating:
            if group_ids is None or versions is None:
                raise DataError(f"partition {part.name!r}: new rows need both group_ids and versions")
            if len(group_ids) != len(ids) or len(versions) != len(ids):
                raise DataError(f"partition {part.name!r}: {len(ids)} sample ids but {len(group_ids)} group_ids "
                                f"and {len(versions)} versions")
            versions = check_versions(part.name, versions)
            for sid in ids:
                if sid in part.rows or sid in part.retired or sid in part.dead:
                    raise DataError(f"partition {part.name!r}: duplicate sample id {sid!r} (a row with that id "
                                    "exists; to add fields to it, put without group_ids/versions)")
                if sid in part.cleared:
                    raise DataError(f"partition {part.name!r}: duplicate sample id {sid!r}: a row with that id was "
                                    "stored before a clear(), and a reader may still hold it; use a new id")
            if part.group_size is not None:
                self._check_groups(part, list(group_ids), versions)
            return [True] * len(ids)
        for sid in ids:
            if sid not in part.rows:
                gone = " (already consumed and retired)" if sid in part.retired else ""
                raise DataError(f"partition {part.name!r}: unknown sample id {sid!r}{gone}; new rows need "
                                "group_ids and versions")
        return [False] * len(ids)

    def _check_groups(self, part: _Partition, group_ids: list[str], versions: list[int]) -> None:
        """A partition with ``group_size`` holds each group as at most ``group_size`` live rows of one
        policy version: a surplus row could never be handed out by the group sampler, and a group
        of mixed versions has no single version to train on."""
        live = {gid: part.groups[gid] for gid in group_ids if gid in part.groups}
        for gid, version in zip(group_ids, versions, strict=True):
            have, count = live.get(gid, (version, 0))
            if have != version:
                raise DataError(f"partition {part.name!r}: group {gid!r} holds rows of policy version {have}; "
                                f"a row of version {version} cannot join it (one group, one version)")
            if count == part.group_size:
                raise DataError(f"partition {part.name!r}: group {gid!r} already has group_size={part.group_size} "
                                "rows; a surplus row would never be handed out by the group sampler")
            live[gid] = (version, count + 1)

    def _chunk(self, part: _Partition, name: str, values: Any, ids: list[str]) -> tuple[Stored, FieldSpec, list[int]]:
        spec = part.schema.get(name)
        if spec is None and part.fixed_schema:
            raise DataError(f"partition {part.name!r}: unknown field {name!r}; the schema has {sorted(part.schema)}")
        if isinstance(values, RefField):
            spec, lengths = _check_ref(part.name, name, values, ids, spec)
            return Stored(values.ref, is_ref=True), spec, lengths
        chunk = make_chunk(name, values, ids, spec)
        return Stored(chunk.values), chunk.spec, chunk.lengths

    def commit_put(self, plan: _PutPlan) -> None:
        """Apply a plan from :meth:`plan_put` (the caller made sure the new rows fit)."""
        part = plan.partition
        assert part.capacity_rows - len(part.rows) >= plan.new_rows
        for name, (_, spec, _) in plan.chunks.items():
            part.schema.setdefault(name, spec)
        for i, (sid, is_new) in enumerate(zip(plan.sample_ids, plan.new, strict=True)):
            if is_new:
                assert plan.group_ids is not None and plan.versions is not None  # _check_ids requires both for new rows
                row = _Row(len(part.order), str(plan.group_ids[i]), int(plan.versions[i]))
                part.rows[sid] = row
                part.groups[row.group_id] = (row.version, part.groups.get(row.group_id, (0, 0))[1] + 1)
                part.order.append(sid)
            row = part.rows[sid]
            for name, (stored, _, lengths) in plan.chunks.items():
                row.values[name] = (stored, i)
                row.lengths[name] = lengths[i]
        part.put_rows += plan.new_rows

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
            {name: _segments(rows, name) for name in fields}, {name: part.schema[name] for name in fields},
        )

    def _ready(self, part: _Partition, cons: _Consumer, fields: Sequence[str]) -> Iterator[RowMeta]:
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
                     {name: _segments(rows, name) for name in fields}, {name: part.schema[name] for name in fields})

    # -- leases -------------------------------------------------------------------------------

    def ack(self, lease_id: str) -> bool:
        """Mark a lease's rows consumed by its consumer. True the first time, False on a repeat
        ack (or after ``clear``); an expired lease is accepted while none of its rows was handed
        out again.

        Raises:
            LeaseError: unknown lease, nacked lease, or expired with rows re-delivered.
        """
        lease = self._leases.get(lease_id)
        if lease is None:
            state, lease = self._finished_state(lease_id)
            if state in ("acked", "cleared"):
                return False
            if state == "nacked" or not self._still_free(lease):
                raise LeaseError(f"lease {lease_id!r} was {state} and its rows were handed out again")
        else:
            self._release(lease)
        part = self._partitions[lease.partition]
        cons = part.consumer(lease.consumer)
        cons.acked.update(lease.sample_ids)
        self._retire(part, lease.sample_ids)
        self._finish(lease, "acked")
        return True

    def nack(self, lease_id: str) -> bool:
        """Give a lease's rows back for re-delivery now. True if it was active; False if it had
        already ended (expired, nacked, cleared).

        Raises:
            LeaseError: unknown lease, or one already acked.
        """
        lease = self._leases.get(lease_id)
        if lease is None:
            state, _ = self._finished_state(lease_id)
            if state == "acked":
                raise LeaseError(f"lease {lease_id!r} was already acked; its rows cannot be given back")
            return False
        self._release(lease)
        self._partitions[lease.partition].redelivered_rows += len(lease.sample_ids)
        self._finish(lease, "nacked")
        return True

    def expire(self, now: float) -> int:
        """End every lease past its deadline (its rows become ready again); returns how many."""
        expired = [lease for lease in self._leases.values() if lease.deadline <= now]
        for lease in expired:
            self._release(lease)
            self._partitions[lease.partition].redelivered_rows += len(lease.sample_ids)
            self._finish(lease, "expired")
        return len(expired)

    def next_deadline(self) -> float | None:
        """The earliest lease deadline (``time.monotonic()`` seconds), or None without a lease."""
        return min((lease.deadline for lease in self._leases.values()), default=None)

    def _finished_state(self, lease_id: str) -> tuple[str, Lease]:
        try:
            return self._finished[lease_id]
        except KeyError:
            raise LeaseError(f"unknown lease {lease_id!r}") from None

    def _still_free(self, lease: Lease) -> bool:
        part = self._partitions.get(lease.partition)
        if part is None:
            return False
        cons = part.consumer(lease.consumer)
        return all(sid in part.rows and sid not in cons.leased and sid not in cons.acked for sid in lease.sample_ids)

    def _release(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        cons = self._partitions[lease.partition].consumer(lease.consumer)
        for sid in lease.sample_ids:
            if cons.leased.get(sid) == lease.lease_id:
                del cons.leased[sid]

    def _finish(self, lease: Lease, state: str) -> None:
        self._leases.pop(lease.lease_id, None)
        self._finished[lease.lease_id] = (state, lease)
        self._trim_finished()

    def _trim_finished(self) -> None:
        while len(self._finished) > _FINISHED_LEASES_KEPT:
            self._finished.popitem(last=False)

    def _retire(self, part: _Partition, sample_ids: Sequence[str]) -> None:
        if not part.retire_after:
            return
        done = [part.consumer(c).acked for c in part.retire_after]
        for sid in sample_ids:
            if sid in part.rows and all(sid in acked for acked in done):
                self._remove(part, sid)
                part.retired.add(sid)
        self._compact(part)

    def _remove(self, part: _Partition, sid: str) -> None:
        row = part.rows.pop(sid)
        part.order[row.seq] = None
        version, count = part.groups.pop(row.group_id)
        if count > 1:
            part.groups[row.group_id] = (version, count - 1)
        for cons in part.consumers.values():
            cons.acked.discard(sid)
            cons.leased.pop(sid, None)

    def drop_dead(self, lease_id: str, sample_ids: Sequence[str]) -> list[str]:
        """A reader of lease ``lease_id`` found values of rows ``sample_ids`` lost (their producer
        died and the object store freed them): drop those rows for good (and, in a partition with
        ``group_size``, the live rows of their groups, which can never be whole again), give the
        lease's other rows back at once, and count the dropped ones (``dead_rows`` in ``stats``).
        Returns the dropped ids.

        Raises:
            LeaseError: unknown lease, or one that already ended.
        """
        lease = self._leases.get(lease_id)
        if lease is None:
            state, _ = self._finished_state(lease_id)
            raise LeaseError(f"lease {lease_id!r} was {state}; its rows cannot be dropped through it")
        part = self._partitions[lease.partition]
        self._release(lease)
        self._finish(lease, "nacked")
        dead_groups = {part.rows[sid].group_id for sid in sample_ids if sid in part.rows}
        drop = [sid for sid, row in part.rows.items()
                if sid in sample_ids or (part.group_size is not None and row.group_id in dead_groups)]
        for sid in drop:
            self._remove(part, sid)
            part.dead.add(sid)
        self._compact(part)
        return drop

    def _compact(self, part: _Partition) -> None:
        """Drop retired rows' slots from the order once they are most of it."""
        holes = len(part.order) - len(part.rows)
        if holes < 1024 or holes * 2 < len(part.order):
            return
        live_before = list(itertools.accumulate((sid is not None for sid in part.order), initial=0))
        for cons in part.consumers.values():
            cons.start = live_before[cons.start]
        live = [sid for sid in part.order if sid is not None]
        part.order = list(live)
        for seq, sid in enumerate(live):
            part.rows[sid].seq = seq

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


def _segments(rows: Sequence[_Row], name: str) -> list[tuple[Stored, int, int]]:
    out: list[tuple[Stored, int, int]] = []
    for row in rows:
        stored, i = row.values[name]
        if out and out[-1][0] is stored and out[-1][2] == i:
            out[-1] = (stored, out[-1][1], i + 1)
        else:
            out.append((stored, i, i + 1))
    return out


def _check_ref(partition: str, name: str, ref: RefField, ids: list[str],
               spec: FieldSpec | None) -> tuple[FieldSpec, list[int]]:
    if len(ref.row_shapes) != len(ids):
        raise DataError(f"field {name!r}: {len(ref.row_shapes)} values for {len(ids)} sample ids")
    first = tuple(ref.row_shapes[0])
    if spec is None:
        spec = FieldSpec(ref.dtype) if ref.dtype == "object" or not first else FieldSpec(ref.dtype, first[1:], True)
    if ref.dtype != spec.dtype:
        raise DataError(f"partition {partition!r}: field {name!r} of sample {ids[0]!r}: dtype {ref.dtype} does not "
                        f"match the partition's {spec}")
    if not spec.numeric:
        return spec, [1] * len(ids)
    for sid, shape in zip(ids, ref.row_shapes, strict=True):
        if not spec.row_shape_ok(tuple(shape)):
            raise DataError(f"partition {partition!r}: field {name!r} of sample {sid!r}: shape {list(shape)} does "
                            f"not match the partition's {spec}")
    return spec, [int(s[0]) if spec.ragged else 1 for s in ref.row_shapes]

