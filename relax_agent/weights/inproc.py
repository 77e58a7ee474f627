"""In-process transport (colocate): engines copy straight from the trainer's tensors.

No serialization and no staging copy: the receiver hands the publisher's own tensors to the
engine, whose ``load_weights`` copies (and casts) them into its parameters between decode
batches. The tensors are the trainer's live ones, so a receive must happen before the next
train step changes them (``WeightSync.publish`` applies to every engine before it returns).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from relax_agent.errors import WeightSyncError
from relax_agent.weights.meta import VersionMeta, plan_layout


class InprocSender:
    """Holds references to the latest published state dict."""

    def __init__(self, bucket_bytes: int) -> None:
        self._bucket_bytes = bucket_bytes
        self._state: Mapping[str, torch.Tensor] | None = None
        self._version: int | None = None
        self._previous: tuple[Mapping[str, torch.Tensor] | None, int | None] = (None, None)

    @property
    def address(self) -> str | None:
        """None: in-process receivers read the sender directly."""
        return None

    @property
    def secret(self) -> str | None:
        """None: this transport serves no bytes over a socket."""
        return None

    def stage(self, state_dict: Mapping[str, torch.Tensor], version: int) -> VersionMeta:
        """Keep references to ``state_dict`` as ``version`` (and the previous version for a retract);
        returns its metadata (no bytes are copied)."""
        tensors, total = plan_layout(state_dict)
        self._previous = (self._state, self._version)
        self._state, self._version = state_dict, version
        return VersionMeta(version, tensors, total, self._bucket_bytes, "none", (), "inproc", None)

    def send(self, meta: VersionMeta) -> None:
        """Nothing to push: receivers read the held tensors."""

    def retract(self, version: int) -> None:
        """Hold the state dict staged before ``version`` again (``version`` was refused)."""
        if self._version == version:
            (self._state, self._version), self._previous = self._previous, (None, None)

    def tensors(self, version: int) -> Mapping[str, torch.Tensor]:
        """The held state dict of ``version``.

        Raises:
            WeightSyncError: a newer version replaced it (or none was published).
        """
        if self._state is None or self._version != version:
            raise WeightSyncError(f"in-process sender holds version {self._version}, not {version}")
        return self._state

    def close(self) -> None:
        """Drop the references to the staged versions."""
        self._state, self._previous = None, (None, None)


class InprocReceiver:
    """Reads the tensors an :class:`InprocSender` in the same process holds."""

    def __init__(self, sender: InprocSender) -> None:
        self._sender = sender

    def receive(self, meta: VersionMeta) -> tuple[Mapping[str, torch.Tensor], dict[str, float]]:
        """The sender's tensors of ``meta.version`` (no copy) and stats (``bytes`` 0)."""
        start = time.perf_counter()
        tensors = self._sender.tensors(meta.version)
        return tensors, {"receive_s": time.perf_counter() - start, "bytes": 0.0, "resumes": 0.0}

    def skip(self, meta: VersionMeta) -> None:
        """Nothing to do: no bytes move."""

    def close(self) -> None:
        """Nothing to release."""
        pass
