"""relax_agent.moe: rollout routing replay (R3) for mixture-of-experts policies.

The rollout engine records, per policy token and MoE layer, the top-k experts its router
chose (:class:`RouteRecorder`, turned on by ``moe.routing_replay: rollout``); they travel
with the trajectory (``Turn.routed_experts``, ``TrainBatch.routed_experts``); the trainer
forces its routers to them (:class:`RoutingReplay`). Supported families: Qwen3-MoE,
Mixtral, OLMoE and the text decoder of Qwen3-VL-MoE (:data:`FAMILIES`); a multimodal policy's
engine also records the routes of its prefill, media tokens included (``Turn.context_routed_experts``).

Only :class:`MoEConfig` loads eagerly; the rest (torch) loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from relax_agent.moe.config import MoEConfig

_LAZY = {
    "FAMILIES": "routers", "Router": "routers", "find_routers": "routers", "is_moe": "routers",
    "route_dtype": "routers",
    "RouteRecorder": "record", "build_route_recorder": "record",
    "REPLAYED_TOKENS": "replay", "ROUTE_FLIP_FRAC": "replay", "RoutingReplay": "replay",
    "build_routing_replay": "replay", "replay_weights": "replay", "replaying": "replay",
}

__all__ = ["MoEConfig", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"relax_agent.moe.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'relax_agent.moe' has no attribute {name!r}")
