"""Readying a policy for training: fp32 master weights, LoRA adapters, frozen input embeddings,
the dropout warning, and the lr warm-up multiplier."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from relax_agent.errors import ConfigError
from relax_agent.train.config import TrainerConfig


def with_lora(model: nn.Module, cfg: TrainerConfig) -> tuple[nn.Module, Any, str]:
    """(base model with adapters injected, the peft wrapper, sha256 of the base weights)."""
    from relax_agent.train.lora import apply_lora, base_fingerprint

    fingerprint = base_fingerprint(model)
    wrapper = apply_lora(model, cfg.lora)
    return wrapper.get_base_model(), wrapper, fingerprint


class LinearWarmup:
    """lr multiplier: (k + 1) / warmup_steps for update k < warmup_steps, then 1."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps

    def __call__(self, k: int) -> float:
        """The lr multiplier of update ``k``."""
        return 1.0 if self.warmup_steps <= 0 else min(1.0, (k + 1) / self.warmup_steps)


def with_master_weights(model: nn.Module) -> nn.Module:
    """The model with fp16/bf16 floating-point weights upcast to fp32 (fp32/fp64 kept)."""
    if any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters()):
        model = model.float()
    return model


def freeze_input_embeddings(model: nn.Module) -> None:
    """requires_grad=False on the input embeddings (also on a tied output head)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else None
    if emb is None:
        raise ConfigError(
            f"trainer.freeze_embeddings is set but {type(model).__name__} has no get_input_embeddings()"
        )
    emb.requires_grad_(False)


def _dropout_modules(model: nn.Module) -> Iterator[str]:
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            yield name


def warn_on_dropout(model: nn.Module) -> None:
    """Warn when ``model`` has dropout: its log-probs would not match the rollout's."""
    config = getattr(model, "config", None)
    attn = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    named = list(_dropout_modules(model))
    if attn > 0 or named:
        warnings.warn(
            f"the policy has dropout (attention_dropout={attn}, modules {named[:3]}): its log-probs "
            "will not match the rollout's; set dropout to 0 in the model config",
            stacklevel=3,
        )
