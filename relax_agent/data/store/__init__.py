"""The data bus's state machine: partitions, rows, consumer cursors and leases.

Never blocks and never reads a clock: the backends (:mod:`~relax_agent.data.local` with a
``threading.Condition``, :mod:`~relax_agent.data.ray` with an asyncio loop in an actor) wrap it, pass ``now``
(``time.monotonic()``) in, and wait when :meth:`Store.free_rows` or :meth:`Store.take` say so.
Every method either raises without changing state or applies its whole change.

Row values are kept as :class:`Stored` chunks (one per field per put) plus a row index, so a
batch put of ``[rows, ...]`` is stored once and a get of consecutive rows is one slice.

The package: :mod:`.store` (:class:`Store`: partitions, takes, reads, stats), :mod:`.puts`
(validating and applying a put), :mod:`.leases` (ack, nack, expiry, retiring and dropping rows),
:mod:`.state` (partitions, rows, cursors, leases as records), :mod:`.checks` (ids, versions,
object-store fields).
"""

from relax_agent.data.store.checks import check_ids, check_versions
from relax_agent.data.store.state import Lease, RefField, Stored, Taken
from relax_agent.data.store.store import Store

__all__ = ["Lease", "RefField", "Store", "Stored", "Taken", "check_ids", "check_versions"]
