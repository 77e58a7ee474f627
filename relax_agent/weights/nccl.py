"""NCCL transport: bucketed ``torch.distributed`` broadcast from the publisher (rank 0) to every rollout rank.

The weight-sync group is its own process group, built from a ``TCPStore`` on
``weights.host:weights.nccl_init_port`` (no global default group, so a trainer that uses
``torch.distributed`` itself is not disturbed): rank 0 is the publisher, ranks
1 .. ``nccl_world_size - 1`` are rollout processes (``connect_subscriber(..., rank=r)``).
The group forms at the first version (every rank must be up by then, within
``publish_timeout_s``). Per version the publisher snapshots the weights into one flat
buffer on its device and broadcasts it bucket by bucket (all buckets in flight, then
waited); receivers broadcast into a reused buffer on theirs. A receiver that refuses a
version still takes part in its broadcasts (``skip``) so the collectives stay in step.

Checksums are not computed (``checksum: none`` in the metadata): the bytes never leave
device memory, and NCCL's transport has its own integrity checks. Late joiners cannot enter
a formed group: use the tcp transport for elastic replicas.

``nccl_backend: gloo`` runs the same code between CPU processes (that is how it is tested
here); the NCCL backend itself has not been run on a GPU in this repository's tests.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from relax_agent.errors import WeightSyncError
from relax_agent.weights.config import WeightSyncConfig
from relax_agent.weights.meta import VersionMeta, flat_views, plan_layout, snapshot_into

_STORE_PREFIX = "relax_agent_weights"


def _device(cfg: WeightSyncConfig) -> torch.device:
    if cfg.nccl_backend == "gloo":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise WeightSyncError("weights.transport=nccl needs CUDA; on CPU set weights.nccl_backend=gloo or use tcp")
    return torch.device("cuda", torch.cuda.current_device())


def make_group(cfg: WeightSyncConfig, rank: int) -> Any:
    """The weight-sync process group for ``rank`` (blocks until every rank has joined).

    Raises:
        WeightSyncError: the rendezvous failed or timed out (``publish_timeout_s``).
    """
    timeout = datetime.timedelta(seconds=cfg.publish_timeout_s)
    try:
        tcp = dist.TCPStore(cfg.host, cfg.nccl_init_port, cfg.nccl_world_size, is_master=rank == 0,
                            timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(_STORE_PREFIX, tcp)
        if cfg.nccl_backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, cfg.nccl_world_size, timeout)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, cfg.nccl_world_size, options)
    except (RuntimeError, OSError) as exc:
        raise WeightSyncError(f"weight-sync group (rank {rank} of {cfg.nccl_world_size}, {cfg.nccl_backend} on "
                              f"{cfg.host}:{cfg.nccl_init_port}) did not form: {exc}") from exc


def broadcast_buckets(group: Any, buffer: torch.Tensor, meta: VersionMeta) -> None:
    """Broadcast ``buffer`` ([total_bytes] uint8) from rank 0, one collective per bucket.

    Raises:
        WeightSyncError: a collective failed or timed out.
    """
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    try:
        works = []
        for b in range(meta.num_buckets):
            start, end = meta.bucket(b)
            works.append(group.broadcast([buffer[start:end]], opts))
        for work in works:
            work.wait()
    except RuntimeError as exc:
        raise WeightSyncError(f"version {meta.version}: bucket broadcast failed: {exc}") from exc


class NcclSender:
    """Rank 0 of the weight-sync group: snapshots a version and broadcasts it."""

    def __init__(self, cfg: WeightSyncConfig) -> None:
        self._cfg = cfg
        self._device = _device(cfg)
        self._group: Any = None
        self._buffer: torch.Tensor | None = None

    @property
    def address(self) -> str:
        """``host:nccl_init_port``: where receivers join the process group."""
        return f"{self._cfg.host}:{self._cfg.nccl_init_port}"

    @property
    def secret(self) -> str | None:
        """None: this transport serves no bytes over a socket."""
        return None

    def stage(self, state_dict: Mapping[str, torch.Tensor], version: int) -> VersionMeta:
        """Copy ``state_dict`` into the flat device buffer (reused while the size stays) as ``version``;
        returns its metadata."""
        tensors, total = plan_layout(state_dict)
        if self._buffer is None or self._buffer.numel() != total:
            self._buffer = torch.empty(total, dtype=torch.uint8, device=self._device)
        snapshot_into(self._buffer, state_dict, tensors)
        return VersionMeta(version, tensors, total, self._cfg.bucket_bytes, "none", (), "nccl", self.address)

    def send(self, meta: VersionMeta) -> None:
        """Broadcast the staged version to every rank (forms the group on the first call)."""
        if self._group is None:
            self._group = make_group(self._cfg, 0)
        assert self._buffer is not None
        broadcast_buckets(self._group, self._buffer, meta)

    def retract(self, version: int) -> None:
        """Nothing to withdraw: a broadcast version is not kept for later receivers."""

    def close(self) -> None:
        """Drop the process group and the buffer."""
        self._group = None
        self._buffer = None


class NcclReceiver:
    """Rank ``rank`` of the weight-sync group: receives each version into a reused device buffer."""

    def __init__(self, cfg: WeightSyncConfig, rank: int) -> None:
        if not 0 < rank < cfg.nccl_world_size:
            raise WeightSyncError(f"nccl rank {rank} must be in 1..{cfg.nccl_world_size - 1} "
                                  f"(weights.nccl_world_size={cfg.nccl_world_size})")
        self._cfg = cfg
        self._rank = rank
        self._device = _device(cfg)
        self._group: Any = None
        self._buffer: torch.Tensor | None = None

    def _join(self, meta: VersionMeta) -> torch.Tensor:
        if self._group is None:
            self._group = make_group(self._cfg, self._rank)
        if self._buffer is None or self._buffer.numel() != meta.total_bytes:
            self._buffer = torch.empty(meta.total_bytes, dtype=torch.uint8, device=self._device)
        broadcast_buckets(self._group, self._buffer, meta)
        return self._buffer

    def receive(self, meta: VersionMeta) -> tuple[Mapping[str, torch.Tensor], dict[str, float]]:
        """Join the broadcast of ``meta.version``; returns views of the received buffer (valid until the
        next call) and stats."""
        start = time.perf_counter()
        buffer = self._join(meta)
        stats = {"receive_s": time.perf_counter() - start, "bytes": float(meta.total_bytes), "resumes": 0.0}
        return flat_views(buffer, meta.tensors), stats

    def skip(self, meta: VersionMeta) -> None:
        """Take part in a refused version's broadcasts without using the bytes."""
        self._join(meta)

    def close(self) -> None:
        """Drop the process group and the buffer."""
        self._group = None
        self._buffer = None
