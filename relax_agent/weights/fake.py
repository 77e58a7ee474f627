"""A weights-only engine for weight-sync tests: named tensors, ``load_weights``, ``weight_layout``."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from relax_agent.errors import WeightSyncError
from relax_agent.weights.digest import Expected, tensor_digest, verify_held


@dataclass
class TensorEngineStats:
    """``weight_loads`` applied and ``weight_load_s`` spent copying them (the engine's pause)."""

    weight_loads: int = 0
    weight_load_s: float = 0.0
    weight_verify_s: float = 0.0


class TensorEngine:
    """Holds a copy of ``state_dict`` (cast to ``dtype`` for floating tensors) and applies versions atomically.

    Args:
        state_dict: the initial weights (version ``version``).
        dtype: floating-point dtype the engine keeps (None: as given).
        version: initial ``policy_version``.
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
                 version: int = 0) -> None:
        self.tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).clone()
                        for k, v in state_dict.items()}
        self._version = version
        self._lock = threading.Lock()
        self.stats = TensorEngineStats()

    @property
    def policy_version(self) -> int:
        """The version of the last applied update (0 before any)."""
        return self._version

    def weight_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every tensor the engine holds."""
        return {k: (tuple(v.shape), v.dtype) for k, v in self.tensors.items()}

    def load_weights(self, state_dict: Mapping[str, Any], version: int,
                     expected_digests: Expected | None = None) -> None:
        """Copy (and cast) ``state_dict`` in under the lock; with ``expected_digests`` (``weights.verify``)
        compare a digest of what it then holds and, on a mismatch, put the previous values back.

        Raises:
            WeightSyncError: an unknown key (nothing is copied then); a digest mismatch (names the
                version and tensor; the previous version stays).
        """
        unknown = [k for k in state_dict if k not in self.tensors]
        if unknown:
            raise WeightSyncError(f"load_weights: unknown keys {unknown[:3]}")
        with self._lock, torch.no_grad():
            start = time.perf_counter()
            verify = expected_digests is not None
            backup = {name: self.tensors[name].clone() for name in state_dict} if verify else {}
            self._copy(state_dict)
            if expected_digests is not None:
                verify_start = time.perf_counter()
                diff = verify_held(expected_digests, lambda want: {
                    n: tensor_digest(self.tensors[n], samples=d.samples) if n in self.tensors else None
                    for n, d in want.items()})
                self.stats.weight_verify_s += time.perf_counter() - verify_start
                if diff:
                    for name, value in backup.items():
                        self.tensors[name].copy_(value)
                    raise WeightSyncError(f"load_weights: version {int(version)} differs after the load from what "
                                          f"was sent; not applied: {'; '.join(diff)}")
            self._version = int(version)
            self.stats.weight_loads += 1
            self.stats.weight_load_s += time.perf_counter() - start

    def _copy(self, state_dict: Mapping[str, Any]) -> None:
        for name, value in state_dict.items():
            self.tensors[name].copy_(value)

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, copy of the tensors), read atomically."""
        with self._lock:
            return self._version, {k: v.clone() for k, v in self.tensors.items()}

    def close(self) -> None:
        """Nothing to release."""
        pass
