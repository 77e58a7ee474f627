"""Data-bus config and the one place a backend is picked.

YAML::

    data:
      backend: ray          # or local (in-process, the default); mode: async only
      ray_num_cpus: 2       # a run starts a local Ray with this many CPUs unless one runs
      lease_timeout_s: 120
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relax_agent.configbase import Section
from relax_agent.data.protocol import TransferQueue
from relax_agent.errors import ConfigError


class DataConfig(Section):
    """The TransferQueue data bus."""

    backend: Literal["local", "ray"] = "local"
    """"local": in-process (threads of one process); "ray": a metadata actor plus the Ray
    object store, shared by every process of the Ray cluster. Used by ``mode: async`` only;
    a run that finds no Ray running starts one (``ray_address``, ``ray_num_cpus``)."""
    ray_address: str | None = None
    """backend ray, Ray not yet running: connect to this cluster (``ray.init(address=...)``,
    e.g. "auto" or "127.0.0.1:6379"); None starts a local Ray for the run."""
    ray_num_cpus: int = Field(default=2, ge=1)
    """backend ray: CPUs of the local Ray a run starts (its actors need none: the bus's
    metadata actor takes 0)."""
    lease_timeout_s: float = Field(default=300.0, gt=0.0)
    """Seconds a consumer may hold rows without acking before they are handed out again;
    set it above the longest step that consumes one batch."""
    ray_actor_name: str = "relax_transfer_queue"
    """Name of the metadata actor; processes that build the bus with the same name and
    ``ray_namespace`` share it."""
    ray_namespace: str = Field(default="relax_agent", min_length=1)
    """Ray namespace of the metadata actor. Explicit, so that every driver of the cluster finds the
    same bus whatever namespace it was started in (a driver's default namespace is anonymous)."""
    ray_direct_channel: bool = True
    """Processes on the metadata actor's node send calls that carry no object references over
    an authenticated Unix socket instead of Ray tasks (much lower per-call cost)."""
    ray_adopt_values: bool = False
    """False: object-store values live as long as the process that put them (Ray's ownership);
    after the producer dies Ray may free them, and a get that meets one raises DataError.
    True: the metadata actor re-puts and so owns them; they outlive their producer, at one more
    copy per put (roughly half the batch put throughput, see benchmarks/transferqueue.py)."""
    ray_inline_max_bytes: int = Field(default=64 * 1024, ge=0)
    """Field values up to this size travel inside the actor's messages; larger ones go
    through the Ray object store once (zero-copy numpy on get)."""


def queue_capacity(rollout_batch: int, max_staleness: int, group_size: int) -> int:
    """Rows a rollout queue must hold: ``rollout_batch x (max_staleness + 1) x group_size``.

    ``rollout_batch`` counts groups (tasks) per training step; with ``max_staleness=k`` the
    rollout may run up to ``k`` steps ahead of the trainer, so ``k + 1`` steps of samples can
    be in flight (Relax, arXiv 2604.11554, sec. on the staleness knob).

    Raises:
        ConfigError: a negative staleness or a non-positive batch or group size.
    """
    if rollout_batch < 1 or group_size < 1 or max_staleness < 0:
        raise ConfigError(f"queue_capacity needs rollout_batch>=1, group_size>=1, max_staleness>=0; got "
                         f"{rollout_batch}, {group_size}, {max_staleness}")
    return rollout_batch * (max_staleness + 1) * group_size


def build_transfer_queue(cfg: DataConfig | None = None) -> TransferQueue:
    """The data bus ``cfg.backend`` names (the Ray backend imports ray only here)."""
    cfg = cfg or DataConfig()
    if cfg.backend == "ray":
        from relax_agent.data.ray import RayTransferQueue

        return RayTransferQueue(cfg)
    from relax_agent.data.local import LocalTransferQueue

    return LocalTransferQueue(cfg)
