"""LoRA for the torch trainer (``trainer.lora``): adapters from `peft`, merged weights for everyone else.

The trainer injects LoRA layers into the policy with peft (Hu et al. 2021, arXiv 2106.09685;
``peft.get_peft_model``) and optimises only the adapters: AdamW keeps state for the adapters
alone. What leaves the trainer is always a plain model of the base architecture:

- weight sync publishes the *merged* weights ``W + (alpha / rank) * B @ A`` under the base
  model's own parameter names (the rollout engine never knows about LoRA);
- a checkpoint's ``model/`` folder holds the merged model (loadable by anything that loads the
  base) and ``model/adapter/`` the adapter in peft's format;
- the trainer state carries the adapter tensors and a fingerprint of the base weights, so a resume
  rebuilds the exact adapter over the same base (the base is read again from ``model.path``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from relax_agent.errors import CheckpointError, ConfigError

ADAPTER = "default"
"""peft's name of the one adapter the trainer uses."""


def apply_lora(model: nn.Module, cfg: Any) -> Any:
    """Inject LoRA layers into ``model`` (in place) and freeze every base parameter.

    Args:
        model: a Hugging Face causal LM with fp32 master weights.
        cfg: :class:`~relax_agent.train.config.LoraConfig` (``rank`` > 0).

    Returns:
        the ``peft.PeftModel`` wrapper; ``wrapper.get_base_model()`` is ``model`` itself with the
        LoRA layers in it (call that one: its ``forward`` keeps the HF signature).

    Raises:
        ConfigError: peft is not installed, or none of ``cfg.target_modules`` names a linear layer of the model.
    """
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as exc:
        raise ConfigError(f"trainer.lora.rank={cfg.rank} needs peft: pip install 'relax-agent[lora]' ({exc})") from exc

    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    wanted = set(cfg.target_modules)
    if not wanted & names:
        raise ConfigError(f"trainer.lora.target_modules={sorted(wanted)} matches no linear layer of the policy; "
                          f"its linear layers are {sorted(names)}")
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=sorted(wanted & names), bias="none")
    with torch.random.fork_rng(devices=[]):  # a seeded A init (B starts at 0); the global RNG is left as it was
        torch.manual_seed(cfg.init_seed)
        return get_peft_model(model, peft_cfg)


def _lora_layers(model: nn.Module) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in, under the base names.

    ``q_proj.base_layer.weight`` becomes ``q_proj.weight`` = base + ``get_delta_weight`` (a new
    tensor); adapter tensors are left out; other entries are the live tensors (no copy).

    Args:
        model: the base model with LoRA layers injected (``PeftModel.get_base_model()``).
    """
    layers = _lora_layers(model)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if ".lora_" in key:
                continue
            if ".base_layer." not in key:
                out[key] = value
                continue
            owner, _, leaf = key.partition(".base_layer.")
            plain = f"{owner}.{leaf}"
            if leaf == "weight" and owner in layers:
                delta = layers[owner].get_delta_weight(ADAPTER)
                out[plain] = value + delta.to(value.dtype)
            else:
                out[plain] = value
    return out


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors (``lora_A`` / ``lora_B`` weights), cloned to CPU, by state-dict key."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if ".lora_" in k}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors saved by :func:`adapter_state` into ``model``.

    Raises:
        CheckpointError: the keys or shapes differ (another rank or other target modules).
    """
    own = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    if set(own) != set(state):
        missing, extra = sorted(set(own) - set(state))[:3], sorted(set(state) - set(own))[:3]
        raise CheckpointError(f"the checkpoint's LoRA adapter does not fit trainer.lora (missing {missing}, "
                              f"unexpected {extra}): resume with the rank and target_modules it was saved with")
    with torch.no_grad():
        for key, value in state.items():
            if own[key].shape != value.shape:
                raise CheckpointError(f"LoRA tensor {key} has shape {tuple(value.shape)} in the checkpoint, "
                                      f"{tuple(own[key].shape)} here (trainer.lora.rank changed?)")
            own[key].copy_(value)


def base_fingerprint(model: nn.Module) -> str:
    """sha256 over the base weights (names, shapes, bytes), adapters excluded; 64 hex characters."""
    digest = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        if ".lora_" in key:
            continue
        digest.update(key.replace(".base_layer.", ".").encode())
        digest.update(str(tuple(value.shape)).encode())
        digest.update(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_lora_model(wrapper: Any, path: Path) -> None:
    """Write the merged model (safetensors, ``save_pretrained``) into ``path`` and the adapter into
    ``path / "adapter"`` (peft format: ``PeftModel.from_pretrained(base, path / "adapter")``)."""
    base = wrapper.get_base_model()
    base.save_pretrained(path, state_dict=merged_state_dict(base), safe_serialization=True)
    wrapper.save_pretrained(path / "adapter", safe_serialization=True)
