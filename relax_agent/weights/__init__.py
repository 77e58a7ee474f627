"""relax_agent.weights: versioned weight sync (DCS) from the trainer to the rollout engines.

Publisher side::

    from relax_agent.weights import WeightSyncConfig, build_weight_sync
    sync = build_weight_sync(WeightSyncConfig(transport="tcp"), engines)
    stats = sync.publish(trainer.policy_state_dict(), version)   # SyncStats: bytes, seconds, GB/s, pause
    sync.close()

A coordinator (:class:`Coordinator`, or over HTTP with :func:`serve_coordinator` /
:class:`HttpCoordinator`) holds each version's metadata; transports move the bytes, one per
file: ``inproc`` (colocate), ``tcp`` (bucketed raw bytes, resumable), ``nccl``
(``torch.distributed`` broadcast). :class:`EngineSubscriber` applies a version to an engine
atomically between decode batches.

Only :class:`WeightSyncConfig` loads eagerly; the rest (torch) loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from relax_agent.weights.config import WeightSyncConfig

_LAZY = {
    "SyncStats": "sync", "WeightSync": "sync", "build_weight_sync": "sync",
    "ApplyReport": "coordinator", "Coordinator": "coordinator",
    "EngineSubscriber": "subscriber", "map_names": "subscriber",
    "TensorMeta": "meta", "VersionMeta": "meta", "layout_diff": "meta",
    "HttpCoordinator": "service", "serve_coordinator": "service",
    "connect_subscriber": "remote",
    "TensorEngine": "fake",
}

__all__ = ["WeightSyncConfig", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"relax_agent.weights.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'relax_agent.weights' has no attribute {name!r}")
