"""Finding the top-k routers of a Hugging Face MoE model, one small adapter per family.

In transformers 5 the MoE block of Qwen3-MoE, Mixtral, OLMoE and the text decoder of Qwen3-VL-MoE
calls its router as ``...layers[i].mlp.gate(hidden [N, H]) -> (logits [N, E], weights [N, k],
indices [N, k])`` and hands ``indices`` and ``weights`` to ``mlp.experts`` (Qwen3-VL-MoE:
``model.language_model.layers[i].mlp.gate``; its vision tower has no experts). The families
differ only in how the top-k weights are formed from ``p = softmax(logits)`` (computed in fp32):

- Qwen3-MoE, OLMoE: ``p`` at the top-k experts, divided by their sum when the config's
  ``norm_topk_prob`` is true; the weights are cast back to the logits' dtype.
- Qwen3-VL-MoE (text config ``qwen3_vl_moe_text``): always renormalised over the top-k experts
  (its router has no ``norm_topk_prob``); the weights are cast back to the logits' dtype.
- Mixtral: always renormalised over the top-k experts; the weights stay fp32.

Routing replay (:mod:`relax_agent.moe.replay`) recomputes the weights the same way at the
replayed experts, so a replayed forward equals the model's own forward whenever the
replayed experts are the ones the router would have chosen.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch import nn

from relax_agent.errors import ConfigError


@dataclass(frozen=True)
class RouterFamily:
    """How one model family turns router logits into top-k gate weights.

    Attributes:
        renormalize: router module -> whether the top-k probabilities are divided by their sum.
        weights_in_logits_dtype: the gate weights are cast to the logits' dtype (else fp32).
    """

    renormalize: Callable[[nn.Module], bool]
    weights_in_logits_dtype: bool


def _norm_topk_prob(router: nn.Module) -> bool:
    return bool(router.norm_topk_prob)


FAMILIES: dict[str, RouterFamily] = {
    "qwen3_moe": RouterFamily(renormalize=_norm_topk_prob, weights_in_logits_dtype=True),
    "olmoe": RouterFamily(renormalize=_norm_topk_prob, weights_in_logits_dtype=True),
    "mixtral": RouterFamily(renormalize=lambda _router: True, weights_in_logits_dtype=False),
    "qwen3_vl_moe_text": RouterFamily(renormalize=lambda _router: True, weights_in_logits_dtype=True),
}
"""The (text) config's ``model_type`` -> its router family (transformers >= 5 module layout)."""


@dataclass(frozen=True)
class Router:
    """One MoE layer's router.

    Attributes:
        name: module path, e.g. ``model.layers.3.mlp.gate``.
        module: the router; its forward returns ``(logits, weights, indices)``.
        num_experts: E, experts the router chooses from.
        top_k: k, experts per token.
        renormalize: top-k weights sum to 1 (see :class:`RouterFamily`).
        weights_in_logits_dtype: weights are cast to the logits' dtype (else fp32).
    """

    name: str
    module: nn.Module
    num_experts: int
    top_k: int
    renormalize: bool
    weights_in_logits_dtype: bool


def model_type(model: nn.Module) -> str:
    """The ``model_type`` of a Hugging Face model's (text) config; "" when it has none."""
    config = getattr(model, "config", None)
    if config is None:
        return ""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return str(getattr(text, "model_type", ""))


def is_moe(model: nn.Module) -> bool:
    """True when the model's config declares experts (``num_experts`` / ``num_local_experts`` > 0)."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(int(getattr(text, key, 0) or 0) > 0 for key in ("num_experts", "num_local_experts"))


def find_routers(model: nn.Module) -> list[Router]:
    """The model's MoE routers in layer order (dense layers are skipped).

    Returns:
        One :class:`Router` per MoE layer; empty for a dense model.

    Raises:
        ConfigError: the model declares experts but its family has no adapter here, or
            no ``mlp.gate`` router was found in it.
    """
    if not is_moe(model):
        return []
    kind = model_type(model)
    family = FAMILIES.get(kind)
    if family is None:
        raise ConfigError(
            f"routing replay supports the MoE model types {sorted(FAMILIES)}; this model is {kind!r}. "
            "Set moe.routing_replay=off"
        )
    routers = [
        Router(name, module, int(module.num_experts), int(module.top_k), family.renormalize(module),
               family.weights_in_logits_dtype)
        for name, module in model.named_modules()
        if name.endswith("mlp.gate") and hasattr(module, "top_k") and hasattr(module, "num_experts")
    ]
    if not routers:
        raise ConfigError(f"the {kind} model declares experts but has no `...mlp.gate` router modules; "
                          "this transformers version lays MoE blocks out differently. Set moe.routing_replay=off")
    return routers


def replay_routers(model: nn.Module) -> list[Router]:
    """:func:`find_routers`, warning (and returning []) when the model is dense.

    Raises:
        ConfigError: as :func:`find_routers`.
    """
    routers = find_routers(model)
    if not routers:
        warnings.warn(
            f"moe.routing_replay=rollout is ignored: the {model_type(model) or type(model).__name__} "
            "policy is dense (no experts to replay)",
            stacklevel=3,
        )
    return routers


def route_dtype(num_experts: int) -> np.dtype:
    """Smallest integer dtype for expert indices: uint8 up to 256 experts, int16 up to 32768, else int32."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    return np.dtype(np.int32)

