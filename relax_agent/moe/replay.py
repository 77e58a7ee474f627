"""Forcing a trainer's routers to the rollout's experts (the "replay" half of R3).

R3 (Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers", arXiv 2510.11370): the trainer uses the experts the rollout engine chose for each
token, while the gate weights of those experts come from the trainer's own router logits,
so the router still receives a gradient. Per replayed position, with the recorded experts
``S`` (k of them) and ``p = softmax(logits)`` (fp32):

    weights = p[S]                      (Qwen3-MoE / OLMoE with norm_topk_prob=False)
    weights = p[S] / sum(p[S])          (Mixtral; Qwen3-MoE / OLMoE with norm_topk_prob=True)

i.e. each family's own top-k normalisation applied to the replayed set (the second form is
the softmax of the logits restricted to ``S``). When ``S`` is the router's own top-k this
is exactly the model's computation.

Which positions are replayed: the batch carries ``routed_experts`` [B, T, layers, k] and
``routes_mask`` [B, T], where row ``t`` holds the routes of the forward position ``t - 1``
that scored token ``t`` (see :mod:`relax_agent.moe.record`). Forward position ``q`` is
replayed when token ``q + 1`` has recorded routes. From the text engine those are the policy
tokens only; prompt and observation positions are routed by the trainer itself (they feed the
replayed ones only through attention, and recording skips the engine's prefill to keep the
trajectory small). The HF engine serving a multimodal policy also records its prefill (``Turn.context_routed_experts``),
so there every position before the last sampled token is replayed, media tokens included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from relax_agent.errors import DataError
from relax_agent.moe.routers import Router, replay_routers

ROUTE_FLIP_FRAC = "moe/route_flip_frac"
"""Fraction of replayed (position, layer) pairs where the trainer's own top-k set differs
from the rollout's: how often routing replay changed the computation."""
REPLAYED_TOKENS = "moe/replayed_tokens"
"""Forward positions whose routes were replayed in the step."""


@dataclass
class _Routes:
    """Per-forward-position routes of the batch being forwarded: flattened over [B, T]."""

    experts: torch.Tensor
    """[B*T, layers, k] int64 expert indices."""
    mask: torch.Tensor
    """[B*T] bool, True where the position is replayed."""
    counted: set[int] = field(default_factory=set)
    """Layers already counted in the metrics (a recomputed forward must not count twice)."""


def forward_position_routes(routed_experts: torch.Tensor, routes_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned routes -> forward-position routes.

    Args:
        routed_experts: [B, T, layers, k] integer; row ``t`` scored token ``t`` (at position ``t - 1``).
        routes_mask: [B, T] bool, True where row ``t`` holds recorded routes.

    Returns:
        ``(experts, mask)``: [B, T, layers, k] int64 and [B, T] bool, where position ``q``
        holds row ``q + 1``; the last position is never replayed.
    """
    experts = torch.cat([routed_experts[:, 1:], torch.zeros_like(routed_experts[:, :1])], dim=1).long()
    mask = torch.cat([routes_mask[:, 1:].bool(), torch.zeros_like(routes_mask[:, :1], dtype=torch.bool)], dim=1)
    return experts, mask


class RoutingReplay:
    """Forward hooks that replace each router's choice by the replayed experts.

    Outside :meth:`replaying` the hooks do nothing. Inside, every forward pass of the model
    must be over the batch given to :meth:`replaying` (``N = B * T`` router rows); with
    activation checkpointing keep the backward pass inside the block too, since the
    recomputed forward replays again.

    Args:
        routers: the trainer model's MoE routers, in layer order.
    """

    def __init__(self, routers: Sequence[Router]) -> None:
        assert routers, "RoutingReplay needs at least one router"
        self.routers = list(routers)
        self._routes: _Routes | None = None
        self._replayed: torch.Tensor | float = 0.0  # device tensors once counted: no host sync per layer
        self._flipped: torch.Tensor | float = 0.0
        self._handles = [r.module.register_forward_hook(self._hook(i, r)) for i, r in enumerate(self.routers)]

    @contextlib.contextmanager
    def replaying(self, routed_experts: torch.Tensor, routes_mask: torch.Tensor) -> Iterator[None]:
        """Replay these routes in the forward (and recomputed) passes run inside the block.

        Args:
            routed_experts: [B, T, layers, k] token-aligned routes (see the module docstring).
            routes_mask: [B, T] bool.

        Raises:
            DataError: the routes do not fit the model (layers, k, expert ids out of range).
        """
        self._check(routed_experts)
        experts, mask = forward_position_routes(routed_experts, routes_mask)
        b, t = mask.shape
        self._routes = _Routes(experts.reshape(b * t, *experts.shape[2:]), mask.reshape(b * t))
        try:
            yield
        finally:
            self._routes = None

    def _check(self, routed_experts: torch.Tensor) -> None:
        layers, k = len(self.routers), self.routers[0].top_k
        if routed_experts.dim() != 4 or tuple(routed_experts.shape[2:]) != (layers, k):
            raise DataError(f"routed_experts must be [B, T, layers={layers}, top_k={k}] for this model; "
                            f"got shape {tuple(routed_experts.shape)}")
        top = int(routed_experts.max()) if routed_experts.numel() else 0
        if top >= min(r.num_experts for r in self.routers):
            raise DataError(f"routed_experts holds expert id {top}; this model has "
                            f"{min(r.num_experts for r in self.routers)} experts per layer")

    def _hook(self, layer: int, router: Router) -> Any:
        def replay(_module: nn.Module, _args: Any, output: tuple[torch.Tensor, ...]) -> Any:
            routes = self._routes
            if routes is None:
                return None
            logits, weights, indices = output
            if logits.shape[0] != routes.mask.shape[0]:
                raise DataError(f"router {router.name} saw {logits.shape[0]} tokens but the replayed batch "
                                f"has {routes.mask.shape[0]} positions; forward only that batch inside replaying()")
            forced = routes.experts[:, layer].to(indices.device)
            mask = routes.mask.to(indices.device)[:, None]
            if layer not in routes.counted:
                routes.counted.add(layer)
                self._count(indices, forced, mask)
            return logits, torch.where(mask, replay_weights(logits, forced, router).to(weights.dtype), weights), \
                torch.where(mask, forced, indices)

        return replay

    def _count(self, own: torch.Tensor, forced: torch.Tensor, mask: torch.Tensor) -> None:
        with torch.no_grad():
            differs = (own.sort(dim=-1).values != forced.sort(dim=-1).values).any(dim=-1)
            self._flipped = self._flipped + (differs & mask[:, 0]).sum()
            self._replayed = self._replayed + mask.sum()

    def pop_metrics(self) -> dict[str, float]:
        """:data:`ROUTE_FLIP_FRAC` and :data:`REPLAYED_TOKENS` since the last call; then reset."""
        layers = len(self.routers)
        replayed = float(self._replayed)
        out = {REPLAYED_TOKENS: replayed / layers, ROUTE_FLIP_FRAC: float(self._flipped) / max(replayed, 1.0)}
        self._replayed, self._flipped = 0.0, 0.0
        return out

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def replay_weights(logits: torch.Tensor, experts: torch.Tensor, router: Router) -> torch.Tensor:
    """Gate weights of the given experts from the router's own logits (differentiable).

    Args:
        logits: [N, E] router logits.
        experts: [N, k] int64 expert indices.
        router: gives the family's normalisation and weight dtype.

    Returns:
        [N, k] ``softmax(logits)[experts]`` (fp32 softmax), renormalised to sum 1 when the
        family does so, in the logits' dtype or fp32 like the family's own router.
    """
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    if router.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype) if router.weights_in_logits_dtype else weights


def build_routing_replay(model: nn.Module, enabled: bool) -> RoutingReplay | None:
    """Routing replay hooks on ``model``, or None when ``enabled`` is False or the model is dense (warned).

    Raises:
        ConfigError: an MoE family without a router adapter.
    """
    if not enabled:
        return None
    routers = replay_routers(model)
    return RoutingReplay(routers) if routers else None


def replaying(replay: RoutingReplay | None, batch: Any) -> contextlib.AbstractContextManager:
    """The replay block for one (micro-)batch with ``routed_experts`` / ``routes_mask``; a no-op without replay.

    Raises:
        DataError: replay is on but the batch carries no routes (the rollout did not record them).
    """
    if replay is None:
        return contextlib.nullcontext()
    if batch.routed_experts is None:
        raise DataError("moe.routing_replay=rollout but the batch has no routed_experts: the rollout engine "
                        "did not record routes (build it with record_routes=True)")
    return replay.replaying(batch.routed_experts, batch.routes_mask)
