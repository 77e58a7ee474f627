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
  Unix socket instead of Ray tasks (:mod:`~relax_agent.data.channel`; ``ray_direct_channel``): same state,
  a fraction of the per-call cost.
- Ray's ownership model applies to the large values: they live as long as the producer
  process that put them. Once a producer has died, Ray may free them at any time (when is up
  to Ray: a copy cached on the reading node can stay readable for a while); a ``get`` that
  meets a freed value drops those rows for good (with the rest of their group in a grouped
  partition), logs a warning, counts them (``dead_rows``) and goes on with the rows behind them; a
  ``read`` of one raises :class:`DataError` naming the rows.
  With ``ray_adopt_values`` the actor re-puts (and so owns) them: they outlive the producer.

The package: :mod:`.client` (:class:`RayTransferQueue`, the handle every process holds),
:mod:`.actor` (:class:`MetadataActor`), :mod:`.wire` (how values travel between the actor and a
reader, and how lost ones are told), :mod:`.cluster` (starting or joining Ray).
"""

from relax_agent.data.ray.actor import MetadataActor
from relax_agent.data.ray.client import RayTransferQueue
from relax_agent.data.ray.cluster import LOCAL_RAY_SYSTEM_CONFIG, start_ray
from relax_agent.data.ray.wire import unpickle_rows

__all__ = ["LOCAL_RAY_SYSTEM_CONFIG", "MetadataActor", "RayTransferQueue", "start_ray", "unpickle_rows"]
