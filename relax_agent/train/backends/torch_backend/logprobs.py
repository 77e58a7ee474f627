"""Per-token log-probs and entropies of a causal LM, the log-softmax chunked over rows so its
fp32 copy of the logits never exists in full."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from relax_agent.errors import ConfigError, DataError

_CHUNK_ELEMENTS = 1 << 24
"""Logit elements (64 MiB in fp32) processed at once by :func:`token_logprobs`."""


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32, or the logits' own dtype when it is wider (fp64)."""
    return torch.promote_types(logits.dtype, torch.float32)


class _TokenLogprob(torch.autograd.Function):
    """``log_softmax(logits / temperature)[target]`` in fp32 (at least), chunked over rows.

    Forward keeps only the logits (already alive) and one fp32 log-normaliser per row;
    backward rebuilds the softmax chunk by chunk. Peak extra memory is one fp32 chunk,
    instead of the full [N, V] fp32 log-softmax a plain ``log_softmax`` + ``gather`` saves.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk_rows: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n, dtype = logits.shape[0], _compute_dtype(logits)
        logp = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=dtype, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for s in range(0, n, chunk_rows):
                z = logits[s:s + chunk_rows].to(dtype) / temperature
                lse_c = torch.logsumexp(z, dim=-1)
                lse[s:s + chunk_rows] = lse_c
                logp[s:s + chunk_rows] = z.gather(-1, targets[s:s + chunk_rows, None]).squeeze(-1) - lse_c
                if with_entropy:
                    p = torch.exp(z - lse_c[:, None])
                    entropy[s:s + chunk_rows] = lse_c - (p * z).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor) -> tuple:
        logits, targets, lse = ctx.saved_tensors
        temperature, rows, dtype = ctx.temperature, ctx.chunk_rows, _compute_dtype(logits)
        grad = torch.empty_like(logits)
        with torch.autocast(logits.device.type, enabled=False):
            for s in range(0, logits.shape[0], rows):
                z = logits[s:s + rows].to(dtype) / temperature
                g_out = grad_logp[s:s + rows].to(dtype)[:, None]
                g = torch.exp(z - lse[s:s + rows, None]).mul_(-g_out)
                g.scatter_add_(-1, targets[s:s + rows, None], g_out)
                grad[s:s + rows] = g.div_(temperature)
        return grad, None, None, None, None


def token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_tokens: int | None = None,
    media: Any = None,
    first_position: int = 1,
    prefix_len: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (with gradient) and entropies (without) of a causal LM.

    Args:
        model: a causal LM whose forward takes ``input_ids``, ``attention_mask`` and
            ``use_cache`` and returns ``.logits`` [B, T, V] (any Hugging Face ``*ForCausalLM``).
        input_ids: [B, T] right-padded token ids.
        attention_mask: [B, T] 1 on real tokens, 0 on padding.
        temperature: the rollout's sampling temperature; logits are divided by it so the
            log-probs are those of the distribution the tokens were sampled from.
        with_entropy: also return the entropy of each position's distribution.
        chunk_tokens: positions per chunk of the log-softmax (default: 16M logits / V).
        media: multimodal policies: [B] each row's :class:`~relax_agent.records.MediaInputs` (or
            None); their arrays are fed to the forward so the log-probs see the media (see
            :func:`relax_agent.multimodal.batch.checked_media_kwargs`).
        first_position: the first position whose log-prob is wanted (see
            :func:`first_scored_position`); the logits are computed from the position before it on
            only (the model's ``logits_to_keep`` when its forward takes it), which spares the
            vocabulary projection and log-softmax of a long prompt.
        prefix_len: > 0: the rows share their first ``prefix_len`` tokens, which are forwarded once
            (:func:`~relax_agent.train.backends.torch_backend.shared_prefix.shared_prefix_forward`;
            text rows only, and ``first_position`` > ``prefix_len``); the result is the same.

    Returns:
        ``(logprobs, entropy)``, both [B, T] float32 (float64 for a float64 model): position ``t`` holds
        ``log p(token t | tokens < t)`` and the entropy (nats) of that distribution;
        position 0, positions before ``first_position`` and padding hold 0. ``entropy`` is None
        when ``with_entropy`` is False.

    Raises:
        ConfigError: ``temperature`` <= 0.
        DataError: ``input_ids`` and ``attention_mask`` are not the same [B, T] shape; with
            ``prefix_len``, media given, or the rows do not share the prefix.
    """
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0; got {temperature}")
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise DataError(
            f"input_ids and attention_mask must share one [B, T] shape; got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    extra: dict[str, Any] = {}
    if media is not None:
        from relax_agent.multimodal.batch import checked_media_kwargs

        extra = checked_media_kwargs(model, input_ids, attention_mask, media)
    b, t = input_ids.shape
    start = min(max(first_position, 1), t) - 1  # logits from here on: position p predicts token p + 1
    if prefix_len:
        if media is not None:
            raise DataError("prefix_len applies to text rows only; got media")
        from relax_agent.train.backends.torch_backend.shared_prefix import shared_prefix_forward

        logits = shared_prefix_forward(model, input_ids, attention_mask, prefix_len, start)
    else:
        if start and takes_logits_to_keep(model):
            extra["logits_to_keep"] = t - start
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra).logits
        if logits.shape[1] != t - start:
            logits = logits[:, start:]
    k, v = logits.shape[1], logits.shape[2]
    # Row (b, p) of the flat logits predicts token start + p + 1; the last row of each sequence
    # predicts nothing and is dropped after the fact (cheaper than copying a shifted view).
    targets = torch.cat([input_ids[:, start + 1:], input_ids.new_zeros(b, 1)], dim=1).reshape(-1)
    rows = chunk_tokens or max(1, _CHUNK_ELEMENTS // v)
    logp, entropy = _TokenLogprob.apply(logits.reshape(b * k, v), targets, float(temperature), rows, with_entropy)
    real = attention_mask.bool()
    logp = _shift_right(_left_pad(logp.view(b, k), start), real)
    entropy = _shift_right(_left_pad(entropy.view(b, k), start), real) if with_entropy else None
    return logp, entropy


def first_scored_position(loss_mask: torch.Tensor) -> int:
    """The first position (over all rows) under ``loss_mask`` [B, T]; 1 when none is: the
    ``first_position`` of :func:`token_logprobs_and_entropy` that keeps every log-prob the loss reads."""
    cols = loss_mask.bool().any(dim=0).nonzero()
    return int(cols[0]) if len(cols) else 1


def takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model.forward`` accepts ``logits_to_keep`` (computes the logits of the last
    positions only; Hugging Face causal LMs do)."""
    import inspect

    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _left_pad(values: torch.Tensor, n: int) -> torch.Tensor:
    """[B, K] -> [B, n + K] with zeros in front."""
    return torch.cat([values.new_zeros(values.shape[0], n), values], dim=1) if n else values


def _shift_right(values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[B, T] predictions for token t+1 -> values for token t; 0 at t = 0 and on padding."""
    shifted = torch.cat([values.new_zeros(values.shape[0], 1), values[:, :-1]], dim=1)
    return torch.where(real, shifted, torch.zeros_like(shifted))


def token_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
    media: Any = None, first_position: int = 1, prefix_len: int = 0,
) -> torch.Tensor:
    """[B, T] float32 (at least) ``log p(token t | tokens < t)`` of ``softmax(logits / temperature)``.

    Position 0, positions before ``first_position`` and padding hold 0. Differentiable; see
    :func:`token_logprobs_and_entropy`.
    """
    return token_logprobs_and_entropy(model, input_ids, attention_mask, temperature, with_entropy=False,
                                      media=media, first_position=first_position, prefix_len=prefix_len)[0]
