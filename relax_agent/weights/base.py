"""The transport protocol: one implementation per file (inproc, tcp, nccl).

A version goes through three calls:

1. ``Sender.stage(state_dict, version)`` on the publisher: make the bytes fetchable (or
   ready to send) and return the :class:`VersionMeta` (layout, checksums, address);
2. the coordinator commits that meta; ``Sender.send(meta)`` then pushes it where the
   transport pushes (nccl broadcasts; tcp and inproc serve on demand);
3. ``Receiver.receive(meta)`` on each subscriber returns name -> tensor for the version,
   without touching the engine (applying is :class:`~relax_agent.weights.subscriber.EngineSubscriber`'s job).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from relax_agent.weights.meta import VersionMeta


class Sender(Protocol):
    """Publisher side of a transport."""

    @property
    def address(self) -> str | None:
        """Where subscribers fetch bytes ("host:port"), or None when nothing is served."""
        ...

    @property
    def secret(self) -> str | None:
        """The run's subscriber secret that a receiver answers the sender's challenge with (tcp);
        None for a transport that serves no bytes over a socket (inproc, nccl)."""
        ...

    def stage(self, state_dict: Mapping[str, torch.Tensor], version: int) -> VersionMeta:
        """Make ``version`` fetchable; returns its metadata. Raises ``WeightSyncError``."""
        ...

    def send(self, meta: VersionMeta) -> None:
        """Push a committed version (no-op for pull transports)."""
        ...

    def retract(self, version: int) -> None:
        """``version`` was refused: serve the version staged before it again (pull transports)."""
        ...

    def close(self) -> None:
        """Release the transport's buffers, sockets and process group."""


class Receiver(Protocol):
    """Subscriber side of a transport."""

    def receive(self, meta: VersionMeta) -> tuple[Mapping[str, torch.Tensor], dict[str, float]]:
        """Fetch ``meta.version``: publisher name -> tensor (valid until the next call), and
        stats (``receive_s``, ``bytes``, ``resumes``). Raises ``WeightSyncError``."""
        ...

    def skip(self, meta: VersionMeta) -> None:
        """The engine refused ``meta``: do what the transport needs without keeping the bytes
        (a collective transport still takes part in the broadcast)."""
        ...

    def close(self) -> None:
        """Release the transport's buffers, sockets and process group."""
