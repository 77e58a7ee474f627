"""Leases after a take: ack (rows consumed, retired once every ``retire_after`` consumer has them),
nack and expiry (rows handed out again), and rows dropped for good when their values were lost."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from relax_agent.data.store.state import Lease, Partition, StoreState
from relax_agent.errors import LeaseError

_FINISHED_LEASES_KEPT = 100_000


class Leases(StoreState):
    """:class:`~relax_agent.data.store.Store`'s lease endings and row removal."""

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
        """The earliest deadline of a live lease; None when there is none."""
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

    def _retire(self, part: Partition, sample_ids: Sequence[str]) -> None:
        if not part.retire_after:
            return
        done = [part.consumer(c).acked for c in part.retire_after]
        for sid in sample_ids:
            if sid in part.rows and all(sid in acked for acked in done):
                self._remove(part, sid)
                part.retired.add(sid)
        self._compact(part)

    def _remove(self, part: Partition, sid: str) -> None:
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

    def _compact(self, part: Partition) -> None:
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
