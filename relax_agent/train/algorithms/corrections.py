"""The gap between the trainer's and the rollout engine's log-probs: its metrics, and the
per-token weights that correct the policy loss for it (TIS, sequence TIS, IcePop, rejection masks).

Sources: TIS, Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (2025 blog post, fengyao.notion.site/off-policy-rl); IcePop, Ring-1T arXiv 2510.18855.
"""

from __future__ import annotations

import math

import torch

from relax_agent.errors import ConfigError, DataError
from relax_agent.train.algorithms.kl import K3_MAX_DELTA, k3_kl
from relax_agent.train.algorithms.losses import masked_mean
from relax_agent.train.algorithms.names import (
    CORR_CLIPPED_TOKEN_FRAC,
    CORR_MASKED_SEQ_FRAC,
    CORR_MASKED_TOKEN_FRAC,
    CORR_SEQ_LOG_RATIO_MEAN,
    CORR_WEIGHT_MEAN,
    IW_CLIPPED_FRAC,
    IW_MAX,
    IW_MEAN,
    MISMATCH_ABS_DIFF_MAX,
    MISMATCH_ABS_DIFF_MEAN,
    MISMATCH_FRAC_GT_LN2,
    MISMATCH_FRAC_GT_LN5,
    MISMATCH_K3_KL,
    MISMATCH_MODES,
)


def mismatch_metrics(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the trainer's log-probs are from the rollout engine's for the same tokens.

    Trainer and inference engine compute the same policy with different kernels, dtypes
    and (for MoE) possibly different expert routes; these numbers track that gap (as used
    for R3, arXiv 2510.11370, and in the Relax paper). With ``Δ = train - rollout`` over
    the masked tokens:

    - :data:`MISMATCH_K3_KL`: mean k3 estimate of KL(rollout || train) (the tokens were
      sampled from the rollout policy), ``exp(Δ) - 1 - Δ``;
    - :data:`MISMATCH_ABS_DIFF_MEAN` / :data:`MISMATCH_ABS_DIFF_MAX`: mean and max ``|Δ|``;
    - :data:`MISMATCH_FRAC_GT_LN2` / :data:`MISMATCH_FRAC_GT_LN5`: fraction of tokens whose
      probability differs by more than a factor 2 / 5 (``|Δ| > ln 2``, ``> ln 5``).

    Args:
        train_logprobs, rollout_logprobs, mask: same shape (e.g. [B, T], or flat [N]).

    Returns:
        Python floats; all 0.0 when the mask is empty.
    """
    if train_logprobs.shape != rollout_logprobs.shape or train_logprobs.shape != mask.shape:
        raise DataError(
            f"train_logprobs, rollout_logprobs and mask must share one shape; got "
            f"{tuple(train_logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(mask.shape)}"
        )
    m = mask.bool()
    train = train_logprobs.detach().double()[m]
    rollout = rollout_logprobs.detach().double()[m]
    if train.numel() == 0:
        return dict.fromkeys(
            (MISMATCH_K3_KL, MISMATCH_ABS_DIFF_MEAN, MISMATCH_ABS_DIFF_MAX, MISMATCH_FRAC_GT_LN2, MISMATCH_FRAC_GT_LN5),
            0.0,
        )
    abs_diff = (train - rollout).abs()
    ones = torch.ones_like(train, dtype=torch.bool)
    return {
        MISMATCH_K3_KL: float(k3_kl(rollout, train, ones).mean()),
        MISMATCH_ABS_DIFF_MEAN: float(abs_diff.mean()),
        MISMATCH_ABS_DIFF_MAX: float(abs_diff.max()),
        MISMATCH_FRAC_GT_LN2: float((abs_diff > math.log(2.0)).double().mean()),
        MISMATCH_FRAC_GT_LN5: float((abs_diff > math.log(5.0)).double().mean()),
    }


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(pi_old / pi_rollout, cap)`` per token, without gradient.

    The rollout engine samples from ``pi_rollout`` (an older policy version in async mode,
    and other kernels / dtypes even when on-policy); the PPO ratio is then taken against
    ``pi_old``, the trainer's own log-probs of the same tokens before the update, and each
    token's loss is weighted by this truncated ratio (TIS, Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"). Truncation at
    ``cap`` bounds the variance; it biases towards ``pi_rollout`` only on the truncated tokens.

    Args:
        old_logprobs: [B, T] trainer log-probs before the update (detached).
        rollout_logprobs: [B, T] log-probs the rollout engine reported for the same tokens.
        cap: truncation C >= 1.

    Returns:
        [B, T] weights in (0, cap], float32 at least; positions off the loss mask carry
        meaningless values (mask them).

    Raises:
        DataError: shapes disagree or ``cap`` < 1.
    """
    if old_logprobs.shape != rollout_logprobs.shape:
        raise DataError(f"old_logprobs and rollout_logprobs must share one shape; got "
                        f"{tuple(old_logprobs.shape)} and {tuple(rollout_logprobs.shape)}")
    if not cap >= 1.0:
        raise DataError(f"the TIS cap must be >= 1; got {cap}")
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    log_w = old_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype)
    return torch.exp(log_w.clamp(max=math.log(cap)))


def importance_weight_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> dict[str, float]:
    """Stats of the per-token importance weights ``pi_old / pi_rollout`` (before truncation).

    Args:
        old_logprobs, rollout_logprobs: [N] log-probs of the N policy tokens of a step.
        cap: the TIS truncation C.

    Returns:
        :data:`IW_MEAN` and :data:`IW_MAX` of the untruncated weights, and
        :data:`IW_CLIPPED_FRAC`, the fraction of tokens whose weight exceeds ``cap``. All
        0.0 when N is 0.
    """
    if old_logprobs.numel() == 0:
        return {IW_MEAN: 0.0, IW_MAX: 0.0, IW_CLIPPED_FRAC: 0.0}
    log_w = old_logprobs.detach().double() - rollout_logprobs.detach().double()
    w = torch.exp(log_w.clamp(max=K3_MAX_DELTA))
    return {IW_MEAN: float(w.mean()), IW_MAX: float(w.max()),
            IW_CLIPPED_FRAC: float((log_w > math.log(cap)).double().mean())}


def check_mismatch_bounds(mode: str, low: float, high: float) -> None:
    """Refuse a mismatch correction the trainer cannot apply.

    Raises:
        ConfigError: unknown ``mode``, or bounds outside ``0 < low <= 1 <= high``.
    """
    if mode not in MISMATCH_MODES:
        raise ConfigError(f"trainer.mismatch.mode={mode!r} is unknown; expected one of {list(MISMATCH_MODES)}")
    if not (0.0 < low <= 1.0 <= high and math.isfinite(high)):
        raise ConfigError(f"trainer.mismatch bounds must satisfy 0 < low <= 1 <= high (an on-policy token, ratio 1, "
                          f"is kept); got low={low}, high={high}")


TOKEN_WEIGHTED_CORRECTION_METRICS = (CORR_WEIGHT_MEAN, CORR_MASKED_TOKEN_FRAC, CORR_CLIPPED_TOKEN_FRAC)
"""Metrics of :func:`mismatch_correction` that are means over policy tokens."""
SEQ_WEIGHTED_CORRECTION_METRICS = (CORR_MASKED_SEQ_FRAC, CORR_SEQ_LOG_RATIO_MEAN)
"""Metrics of :func:`mismatch_correction` that are means over sequences with policy tokens."""


def mismatch_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Per-token weights correcting for the rollout engine's log-probs differing from the trainer's.

    With ``r_t = pi_old(y_t) / pi_rollout(y_t)`` on the policy tokens of each sequence (pi_old:
    the trainer's pre-update policy, on which the policy loss's ratio is then taken):

    - ``"tis"``: ``w_t = min(r_t, high)`` (token-level truncated IS, Yao et al. 2025; the same
      numbers as :func:`tis_weights`);
    - ``"seq_tis"``: ``w_t = min(prod_t r_t, high)`` for every token of the sequence
      (sequence-level truncated IS; verl's ``rollout_is: sequence``);
    - ``"icepop"``: ``w_t = r_t`` when ``low <= r_t <= high``, else 0 (masked importance sampling,
      IcePop, Ring-1T arXiv 2510.18855: tokens whose ratio leaves the band get no gradient);
    - ``"geo_mask"``: ``w_t = 1`` when the sequence's geometric-mean ratio
      ``exp(mean_t log r_t)`` is in [low, high], else 0 for the whole sequence (verl's
      geometric rejection mask);
    - ``"seq_reject"``: ``w_t = 1`` unless some policy token of the sequence has ``r_t``
      outside [low, high], then 0 for the whole sequence;
    - ``"none"``: no correction (returns ``(None, {})``).

    Masked tokens stay in the loss normaliser (:func:`loss_normalizer` is taken on the step's
    loss mask): a masked token contributes 0, it does not raise the weight of the others.

    Args:
        old_logprobs: [B, T] trainer log-probs before the update (treated as constants).
        rollout_logprobs: [B, T] the rollout engine's log-probs of the same tokens.
        loss_mask: [B, T] 1/True on policy tokens.
        mode: one of :data:`MISMATCH_MODES`.
        low, high: the band ``0 < low <= 1 <= high`` (``tis``/``seq_tis`` use only ``high``).

    Returns:
        ``(weights, metrics)``: weights [B, T] without gradient, float32 at least, 0 off the
        mask; metrics, detached 0-dim tensors: :data:`CORR_WEIGHT_MEAN`,
        :data:`CORR_MASKED_TOKEN_FRAC` (policy tokens with weight 0),
        :data:`CORR_CLIPPED_TOKEN_FRAC` (policy tokens whose weight was truncated at ``high``),
        as means over policy tokens; :data:`CORR_MASKED_SEQ_FRAC` (sequences all of whose policy
        tokens are masked) and :data:`CORR_SEQ_LOG_RATIO_MEAN` (mean over sequences of
        ``mean_t log r_t``), as means over sequences with policy tokens.

    Raises:
        ConfigError: unknown mode or bad bounds (:func:`check_mismatch_bounds`).
        DataError: shapes disagree.
    """
    check_mismatch_bounds(mode, low, high)
    if mode == "none":
        return None, {}
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != loss_mask.shape or old_logprobs.dim() != 2:
        raise DataError(f"old_logprobs, rollout_logprobs and loss_mask must share one [B, T] shape; got "
                        f"{tuple(old_logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(loss_mask.shape)}")
    mask = loss_mask.bool()
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
    log_r = torch.where(mask, old_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype), zero)
    n_tokens = mask.sum(dim=-1)
    has_tokens = n_tokens > 0
    seq_log_r = log_r.sum(dim=-1)
    clipped = torch.zeros_like(mask)
    if mode == "tis":
        weights = tis_weights(old_logprobs, rollout_logprobs, high).to(dtype)
        clipped = mask & (log_r > math.log(high))
    elif mode == "seq_tis":
        weights = torch.exp(seq_log_r.clamp(max=math.log(high)))[:, None].expand_as(log_r)
        clipped = mask & (seq_log_r > math.log(high))[:, None]
    elif mode == "icepop":
        ratio = torch.exp(log_r)
        weights = torch.where((ratio >= low) & (ratio <= high), ratio, zero)
    elif mode == "geo_mask":
        geo = torch.exp(seq_log_r / n_tokens.clamp(min=1).to(dtype))
        weights = ((geo >= low) & (geo <= high)).to(dtype)[:, None].expand_as(log_r)
    else:  # seq_reject
        ratio = torch.exp(log_r)
        outside = mask & ((ratio < low) | (ratio > high))
        weights = (~outside.any(dim=-1)).to(dtype)[:, None].expand_as(log_r)
    weights = torch.where(mask, weights, zero)
    masked = mask & (weights == 0)
    seq_all_masked = (masked.sum(dim=-1) == n_tokens) & has_tokens
    seqs = has_tokens.to(dtype)
    n_seqs = seqs.sum().clamp(min=1.0)
    metrics = {
        CORR_WEIGHT_MEAN: masked_mean(weights, mask),
        CORR_MASKED_TOKEN_FRAC: masked_mean(masked.to(dtype), mask),
        CORR_CLIPPED_TOKEN_FRAC: masked_mean(clipped.to(dtype), mask),
        CORR_MASKED_SEQ_FRAC: (seq_all_masked.to(dtype) * seqs).sum() / n_seqs,
        CORR_SEQ_LOG_RATIO_MEAN: (seq_log_r / n_tokens.clamp(min=1).to(dtype) * seqs).sum() / n_seqs,
    }
    return weights, metrics
