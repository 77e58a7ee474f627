"""Routing replay's record half on the client side: the routes layout the model's routers give
(what the server must report), and the server's packed routes decoded into an array."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from relax_agent.errors import EngineError


def route_layout(model: Any) -> tuple[tuple[int, int], str] | None:
    """``((moe_layers, top_k), dtype name)`` of ``model``'s routers, as the HF engine records them;
    None (with a warning) for a dense model.

    Raises:
        ConfigError: an MoE family without a router adapter.
    """
    from relax_agent.moe.routers import replay_routers, route_dtype

    routers = replay_routers(model)
    if not routers:
        return None
    return (len(routers), routers[0].top_k), route_dtype(max(r.num_experts for r in routers)).name


def decode_routes(reply: dict[str, Any], request_id: str, layout: tuple[tuple[int, int], str]) -> np.ndarray:
    """The reply's routes as [n, moe_layers, top_k] in the dtype of ``layout`` (:func:`route_layout`).

    Raises:
        EngineError: the reply has no routes, or not one row of the layout per token.
    """
    (layers, top_k), dtype = layout
    expected = (len(reply["token_ids"]), layers, top_k)
    packed = reply.get("routes")
    shape = tuple(packed["shape"]) if packed else None
    if not packed or shape != expected:
        raise EngineError(f"the vLLM server returned routes of shape {shape} for request {request_id}; "
                          f"expected {expected} (tokens, MoE layers, top_k)")
    raw = np.frombuffer(base64.b64decode(packed["data"]), dtype=np.dtype(packed["dtype"]))
    return raw.reshape(shape).astype(dtype)
