"""The store's records: stored chunks, partitions with their rows and consumer cursors, leases, a
taken batch and a validated put; and :class:`StoreState`, the state every part of the store reads."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_agent.data.schema import FieldSpec
from relax_agent.errors import DataError


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
class Row:
    """A stored row: its put order, group, policy version and, per field, its chunk and index in it."""

    seq: int
    group_id: str
    version: int
    values: dict[str, tuple[Stored, int]] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)


@dataclass
class Consumer:
    """One consumer's cursor on a partition: the rows it acked and those leased to it."""

    acked: set[str] = field(default_factory=set)
    leased: dict[str, str] = field(default_factory=dict)
    start: int = 0
    """Index into the partition's order before which every row is acked by this consumer."""


@dataclass
class Partition:
    """A partition: its schema, its rows in put order and its consumers' cursors."""

    name: str
    capacity_rows: int
    schema: dict[str, FieldSpec]
    fixed_schema: bool
    group_size: int | None
    retire_after: tuple[str, ...]
    rows: dict[str, Row] = field(default_factory=dict)
    order: list[str | None] = field(default_factory=list)
    retired: set[str] = field(default_factory=set)
    consumers: dict[str, Consumer] = field(default_factory=dict)
    groups: dict[str, tuple[int, int]] = field(default_factory=dict)
    """group id -> (policy version, live rows) of the groups with live rows."""
    put_rows: int = 0
    redelivered_rows: int = 0
    cleared: set[str] = field(default_factory=set)
    """Ids of rows dropped by ``clear``: never stored again (a reader that held one keeps it unique)."""
    dead: set[str] = field(default_factory=set)
    """Ids of rows dropped because a value of theirs was lost (see :meth:`Store.drop_dead`)."""

    def consumer(self, name: str) -> Consumer:
        """Consumer ``name``'s cursor, created on first use."""
        return self.consumers.setdefault(name, Consumer())


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
class PutPlan:
    """A put checked by :meth:`Puts.plan_put`, to be applied by :meth:`Puts.commit_put`."""

    partition: Partition
    sample_ids: list[str]
    new: list[bool]
    chunks: dict[str, tuple[Stored, FieldSpec, list[int]]]
    group_ids: Sequence[str] | None
    versions: Sequence[int] | None

    @property
    def new_rows(self) -> int:
        """How many of the put's rows are new to the partition."""
        return sum(self.new)


class StoreState:
    """The state of a :class:`~relax_agent.data.store.Store` (set by its ``__init__``)."""

    lease_timeout_s: float
    _partitions: dict[str, Partition]
    _leases: dict[str, Lease]
    _finished: OrderedDict[str, tuple[str, Lease]]

    def _partition(self, partition: str) -> Partition:
        try:
            return self._partitions[partition]
        except KeyError:
            raise DataError(f"partition {partition!r} does not exist; call create_partition first "
                            f"(existing: {sorted(self._partitions)})") from None


def segments(rows: Sequence[Row], name: str) -> list[tuple[Stored, int, int]]:
    """Field ``name`` of ``rows`` as (chunk, start, stop) runs, consecutive indices of one chunk merged."""
    out: list[tuple[Stored, int, int]] = []
    for row in rows:
        stored, i = row.values[name]
        if out and out[-1][0] is stored and out[-1][2] == i:
            out[-1] = (stored, out[-1][1], i + 1)
        else:
            out.append((stored, i, i + 1))
    return out
