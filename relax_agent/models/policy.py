"""Loading the policy model and its tokenizer, ready for batching (left padding, a pad token
that does not occur in chat text, the model's pad id aligned with the tokenizer's).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from relax_agent.config import ModelConfig
from relax_agent.errors import ConfigError
from relax_agent.models.embedded import discard_cache, embedded_cache_dir, load_embedded_model, write_atomically
from relax_agent.models.pretrained import from_pretrained_model, from_pretrained_tokenizer
from relax_agent.models.source import resolve

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Tried in order when a tokenizer's pad token is missing or occurs in chat text.
_PAD_CANDIDATES = ("<|endoftext|>", "<|finetune_right_pad_id|>", "<|pad|>", "<pad>", "[PAD]")


def torch_dtype(dtype: str) -> torch.dtype:
    """Map "fp32" / "bf16" / "fp16" to the torch dtype.

    Raises:
        ConfigError: ``dtype`` is not one of those names.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_tokenizer(cfg: ModelConfig) -> Any:
    """Load the tokenizer of ``cfg.path`` and prepare it for batching (:func:`prepare_tokenizer`).

    Raises:
        ModelLoadError: the path does not exist, the embedded package is missing, or loading failed.
    """
    src = resolve(cfg)
    if src.embedded is not None:
        folder = embedded_cache_dir(src) / "tokenizer"
        if folder.is_dir():
            try:
                return prepare_tokenizer(from_pretrained_tokenizer(str(folder), None, cfg))
            except Exception as exc:  # a damaged cache entry is rebuilt, never fatal
                discard_cache(folder, exc)
        tokenizer = from_pretrained_tokenizer(src.location, src.gguf_file, cfg)
        write_atomically(folder, tokenizer.save_pretrained)
        return prepare_tokenizer(tokenizer)
    return prepare_tokenizer(from_pretrained_tokenizer(src.location, src.gguf_file, cfg))


def load_policy(cfg: ModelConfig, dtype: str = "fp32", device: str = "cpu") -> tuple[Any, Any]:
    """Load the policy model and its tokenizer.

    Args:
        cfg: which model (see :mod:`relax_agent.models` for the accepted ``path`` forms).
        dtype: parameter dtype, "fp32", "bf16" or "fp16".
        device: torch device string ("cpu", "cuda", "cuda:1").

    Returns:
        ``(model, tokenizer)``: a ``*ForCausalLM`` in eval mode on ``device`` whose
        ``config.pad_token_id`` matches the tokenizer's, and the tokenizer from
        :func:`load_tokenizer`.

    Raises:
        ConfigError: unknown ``dtype``.
        ModelLoadError: the path does not exist, the embedded package is missing, or loading failed.
    """
    tdtype = torch_dtype(dtype)
    src = resolve(cfg)
    tokenizer = load_tokenizer(cfg)
    if src.embedded is not None:
        model = load_embedded_model(src, tdtype, cfg, tokenizer)
    else:
        model = from_pretrained_model(src.location, src.gguf_file, tdtype, cfg)
    align_pad_token(model, tokenizer)
    if cfg.gradient_checkpointing:  # transformers >= 5.24 renamed it activation checkpointing
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    return model.to(device).eval(), tokenizer


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Pad on the left and make sure a pad token exists that does not occur in chat text.

    Pad choice: keep the tokenizer's pad token unless it is missing, or is the EOS/BOS
    token, or occurs in a rendered chat (SmolLM2 ships ``pad = <|im_end|>``, the end of every
    turn). Then take the first of ``<|endoftext|>``, ``<|finetune_right_pad_id|>``,
    ``<|pad|>``, ``<pad>``, ``[PAD]``, the unk token that exists in the vocabulary and does
    not occur in chat text; failing all, fall back to EOS (with a warning). A pad id that
    never occurs in real sequences keeps ``ids != pad_id`` masks right, and keeps
    ``nn.Embedding(padding_idx=pad_id)`` from freezing the embedding of a real token.
    No token is ever added, so the vocabulary size is unchanged.
    """
    tokenizer.padding_side = "left"
    in_text = _ids_in_chat_text(tokenizer)
    if tokenizer.pad_token is not None and tokenizer.pad_token_id not in in_text:
        return tokenizer
    vocab = tokenizer.get_vocab()
    for cand in (*_PAD_CANDIDATES, tokenizer.unk_token):
        if cand is not None and cand in vocab and vocab[cand] not in in_text:
            tokenizer.pad_token = cand
            return tokenizer
    if tokenizer.pad_token is None:
        warnings.warn(f"tokenizer {tokenizer.name_or_path!r} has no spare token to pad with; padding with EOS "
                      f"{tokenizer.eos_token!r} (mask by attention_mask, never by token id)", stacklevel=2)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _ids_in_chat_text(tokenizer: Any) -> set[int]:
    """Token ids of BOS/EOS and of a short rendered chat (the template's special tokens)."""
    ids = {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None}
    if not getattr(tokenizer, "chat_template", None):
        return ids
    chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    for messages in ([{"role": "system", "content": "s"}, *chat], chat):
        try:  # some templates refuse a system turn
            ids.update(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
            break
        except Exception:
            continue
    return ids


def align_pad_token(model: Any, tokenizer: Any) -> None:
    """Make the model's pad id the tokenizer's: config, generation config, embedding ``padding_idx``."""
    pad_id = tokenizer.pad_token_id
    model.config.pad_token_id = pad_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = pad_id
    emb = model.get_input_embeddings()
    if getattr(emb, "padding_idx", None) is not None:
        emb.padding_idx = pad_id
