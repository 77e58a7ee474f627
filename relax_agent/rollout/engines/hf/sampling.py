"""Per-row token sampling for the HF engine: temperature, top-p, and each row's own random stream.

Pure tensor functions, no engine state: :func:`sample_tokens` draws one token per row (and its
log-prob under the full temperature-scaled distribution); :func:`top_p_filter` cuts a row's tail
outside its nucleus.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
                  generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row with its own temperature, top-p and random stream.

    Inverse-CDF sampling: one uniform draw per row from that row's (CPU) generator, located
    in the cumulative sum of the row's top-p-truncated probabilities. A row's sample thus
    depends only on its own logits and generator, never on the other rows of the batch.

    Args:
        logits: [rows, vocab] next-token logits (any float dtype).
        temperatures: [rows] > 0.
        top_ps: [rows] in (0, 1].
        generators: one ``torch.Generator`` per row.

    Returns:
        ``(tokens, logprobs)``: [rows] long token ids, and [rows] float32
        ``log_softmax(logits / T)`` at those tokens (the full distribution, before top-p).
    """
    logp = torch.log_softmax(logits.float() / temperatures[:, None], dim=-1)
    probs = logp.exp()
    if bool((top_ps < 1).any()):
        probs = top_p_filter(probs, top_ps)
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).to(logits.device)
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).clamp_min(torch.finfo(torch.float32).tiny)
    tokens = torch.searchsorted(cdf, target[:, None]).squeeze(1).clamp_max(probs.shape[-1] - 1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail of each row outside its nucleus (Holtzman et al. 2020, arXiv 1904.09751).

    Args:
        probs: [rows, vocab] probabilities.
        top_p: [rows] nucleus mass in (0, 1]; a row keeps the smallest set of most likely
            tokens whose mass reaches ``top_p`` (always at least one token).

    Returns:
        [rows, vocab] unnormalised probabilities with the tail set to 0.
    """
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)
