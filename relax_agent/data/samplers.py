"""Samplers: which ready rows a ``get`` hands out.

A sampler sees the rows that are ready for one consumer (all requested fields written, not
acked or leased by that consumer), oldest first, as :class:`RowMeta`, and either picks a batch
or says "not yet" (``None``), in which case ``get`` keeps waiting for more rows.

- :class:`FifoSampler` (``"fifo"``): the oldest ``batch_size`` rows.
- :class:`GroupSampler` (``"group"``): whole GRPO groups only, ``batch_size`` rows in all; a
  group is whole when ``group_size`` of its rows (one group id, one policy version) are ready.
  Groups are never split or mixed.
- :class:`IdsSampler`: exactly the rows named (a consumer that knows which rows it retires).
- :class:`TokenBudgetSampler`: oldest rows up to ``batch_size`` rows or ``max_tokens`` tokens
  (micro-batches of similar cost for the trainer, as in slime's dynamic batch size).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from relax_agent.errors import DataError


@dataclass(frozen=True)
class RowMeta:
    """What a sampler knows about a ready row.

    Attributes:
        sample_id, group_id: the row's keys.
        version: policy version that produced the sample.
        lengths: per written field, its length along the ragged dimension (tokens for token
            fields; 1 for non-ragged fields).
    """

    sample_id: str
    group_id: str
    version: int
    lengths: Mapping[str, int]


@runtime_checkable
class Sampler(Protocol):
    """Picks a batch from ready rows (oldest first), or returns ``None`` to wait for more."""

    def select(self, rows: Iterable[RowMeta], batch_size: int) -> list[str] | None:
        """Sample ids of the batch to lease from ``rows`` (ready, oldest first), or None to wait for more."""


class FifoSampler:
    """The oldest ``batch_size`` ready rows."""

    def select(self, rows: Iterable[RowMeta], batch_size: int) -> list[str] | None:
        """The first ``batch_size`` rows, or None while fewer are ready."""
        out = []
        for row in rows:
            out.append(row.sample_id)
            if len(out) == batch_size:
                return out
        return None


@dataclass(frozen=True)
class GroupSampler:
    """Whole groups of ``group_size`` ready rows, ``batch_size`` rows in all, groups in the
    order they became whole. A group is its rows with one group id *and* one policy version
    (never a mix of versions); rows beyond ``group_size`` of one group id form the next group.

    Raises:
        DataError: ``batch_size`` is not a multiple of ``group_size``.
    """

    group_size: int

    def select(self, rows: Iterable[RowMeta], batch_size: int) -> list[str] | None:
        """The first complete groups (same group id and version) up to ``batch_size`` rows, or None while
        too few are complete.

        Raises:
            DataError: ``batch_size`` is not a multiple of ``group_size``.
        """
        if batch_size % self.group_size:
            raise DataError(f"batch_size={batch_size} is not a multiple of group_size={self.group_size}: "
                            "the group sampler never splits a group")
        members: dict[tuple[str, int], list[str]] = {}
        out: list[str] = []
        for row in rows:
            key = (row.group_id, row.version)  # rows of one group id but another version are another group
            ids = members.setdefault(key, [])
            ids.append(row.sample_id)
            if len(ids) == self.group_size:
                out.extend(ids)
                del members[key]  # a surplus row of this group id starts the next group
                if len(out) == batch_size:
                    return out
        return None


@dataclass(frozen=True)
class TokenBudgetSampler:
    """Oldest ready rows until ``batch_size`` rows or ``max_tokens`` tokens of ``length_field``.

    The batch is handed out once the next ready row would overflow the budget (a single row
    longer than the budget goes alone) or ``batch_size`` rows are picked.
    """

    max_tokens: int
    length_field: str = "response_ids"

    def select(self, rows: Iterable[RowMeta], batch_size: int) -> list[str] | None:
        """The oldest rows until ``batch_size`` rows or ``max_tokens`` tokens (the first row always fits), or
        None while neither bound is reached."""
        out: list[str] = []
        tokens = 0
        for row in rows:
            n = row.lengths.get(self.length_field, 1)
            if out and tokens + n > self.max_tokens:
                return out
            out.append(row.sample_id)
            tokens += n
            if len(out) == batch_size or tokens >= self.max_tokens:
                return out
        return None


@dataclass(frozen=True)
class IdsSampler:
    """Exactly the rows ``sample_ids`` once all are ready (``batch_size`` must be their number).

    Raises:
        DataError: ``batch_size`` differs from the number of ids.
    """

    sample_ids: tuple[str, ...]

    def select(self, rows: Iterable[RowMeta], batch_size: int) -> list[str] | None:
        """``sample_ids`` once every one of them is ready, else None.

        Raises:
            DataError: ``batch_size`` differs from the number of ``sample_ids``.
        """
        if batch_size != len(self.sample_ids):
            raise DataError(f"IdsSampler names {len(self.sample_ids)} rows but batch_size={batch_size}")
        wanted = set(self.sample_ids)
        ready = {row.sample_id for row in rows if row.sample_id in wanted}
        return list(self.sample_ids) if ready == wanted else None


def resolve_sampler(sampler: str | Sampler, group_size: int | None, partition: str) -> Sampler:
    """A sampler object from ``"fifo"``, ``"group"`` (the partition's ``group_size``) or itself.

    Raises:
        DataError: unknown name, or ``"group"`` on a partition created without ``group_size``.
    """
    if not isinstance(sampler, str):
        return sampler
    if sampler == "fifo":
        return FifoSampler()
    if sampler == "group":
        if group_size is None:
            raise DataError(f"sampler 'group' needs group_size: pass create_partition({partition!r}, ..., "
                            "group_size=G) or a GroupSampler(G)")
        return GroupSampler(group_size)
    raise DataError(f"unknown sampler {sampler!r}; expected 'fifo', 'group' or a Sampler object")
