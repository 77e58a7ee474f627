"""The k3 estimator of the KL divergence between two policies from sampled tokens.

Source: J. Schulman, "Approximating KL Divergence" (2020 blog note); the form GRPO uses for
its KL term (DeepSeekMath, arXiv 2402.03300, eq. 4).
"""

from __future__ import annotations

import torch

from relax_agent.errors import DataError

K3_MAX_DELTA = 20.0
"""Log-ratios above this are clamped in :func:`k3_kl` so exp() stays finite (exp(20) ≈ 4.9e8)."""


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(p || ref) from tokens sampled from p.

    ``k3 = exp(Δ) - 1 - Δ`` with ``Δ = ref_logprobs - logprobs`` (Schulman's k3: unbiased,
    never negative, low variance; the form GRPO uses for its KL term, DeepSeekMath eq. 4).
    Δ is clamped to at most 20 so a token the reference finds far likelier cannot overflow
    exp() and poison the gradient.

    Args:
        logprobs: [B, T] (or any shape) log-probs under p (may carry a gradient).
        ref_logprobs: same shape, log-probs of the same tokens under the reference.
        mask: same shape, 1/True where the estimate is wanted.

    Returns:
        Same shape as ``logprobs``: k3 per token, 0 where ``mask`` is 0. Reduce it with
        :func:`masked_aggregate` (as a loss) or a masked mean (as a metric).

    Raises:
        DataError: shapes disagree.
    """
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != mask.shape:
        raise DataError(
            f"logprobs, ref_logprobs and mask must share one shape; got {tuple(logprobs.shape)}, "
            f"{tuple(ref_logprobs.shape)}, {tuple(mask.shape)}"
        )
    m = mask.bool()
    delta = torch.where(m, ref_logprobs.to(logprobs.dtype) - logprobs, torch.zeros_like(logprobs))
    delta = delta.clamp(max=K3_MAX_DELTA)
    return torch.expm1(delta) - delta
