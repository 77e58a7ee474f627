"""Policy losses (PPO-clip, GSPO, CISPO) and the reduction of per-token values to the step's loss.

Every loss takes the *global* normaliser of the step (:func:`loss_normalizer`), so summing the
losses of micro-batches gives exactly the loss, and the gradient, of the full batch.

Sources: PPO, arXiv 1707.06347; DAPO (clip-higher, token-level mean), arXiv 2503.14476;
GSPO, arXiv 2507.18071; CISPO (MiniMax-M1), arXiv 2506.13585.
"""

from __future__ import annotations

import torch

from relax_agent.errors import ConfigError, DataError
from relax_agent.train.algorithms.names import (
    APPROX_KL,
    CLIP_FRAC,
    POLICY_LOSSES,
    RATIO_MEAN,
    LossAgg,
)


def loss_normalizer(loss_mask: torch.Tensor, agg: LossAgg) -> float:
    """The global denominator for :func:`ppo_clip_loss` / :func:`masked_aggregate` over a full batch.

    Compute it once on the whole step's ``loss_mask`` [B, T] and pass it to the loss of
    every micro-batch: the micro-batch losses then add up to the full-batch loss.

    Returns:
        ``"token_mean"``: the number of policy tokens; ``"seq_mean"``: the number of
        sequences with at least one policy token. At least 1.0 (an all-zero mask gives 0 loss).

    Raises:
        DataError: unknown ``agg``.
    """
    _check_agg(agg)
    mask = loss_mask.bool()
    if agg == "token_mean":
        n = int(mask.sum())
    else:
        n = int(mask.any(dim=-1).sum())
    return float(max(n, 1))


def masked_aggregate(
    values: torch.Tensor, loss_mask: torch.Tensor, agg: LossAgg, normalizer: float | None = None
) -> torch.Tensor:
    """Reduce per-token values [B, T] to a scalar the way the loss is reduced.

    ``"token_mean"`` (DAPO): sum over every policy token of the batch / ``normalizer``
    (default: this batch's policy-token count). ``"seq_mean"`` (GRPO): each sequence's mean
    over its own policy tokens, summed over sequences / ``normalizer`` (default: this
    batch's count of sequences with policy tokens). Sequences without policy tokens add 0.

    Args:
        values: [B, T] per-token values.
        loss_mask: [B, T] 1/True on policy tokens.
        agg: "token_mean" or "seq_mean".
        normalizer: global denominator from :func:`loss_normalizer` when this is one
            micro-batch of a larger step; None uses this batch alone.

    Returns:
        0-dim tensor in ``values.dtype``.
    """
    _check_agg(agg)
    if normalizer is None:
        normalizer = loss_normalizer(loss_mask, agg)
    mask = loss_mask.to(values.dtype)
    masked = values * mask
    if agg == "token_mean":
        return masked.sum() / normalizer
    per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return per_seq.sum() / normalizer


def _check_agg(agg: str) -> None:
    if agg not in ("token_mean", "seq_mean"):
        raise DataError(f"loss aggregation {agg!r} is unknown; expected 'token_mean' or 'seq_mean'")


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    agg: LossAgg = "token_mean",
    normalizer: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip policy loss with asymmetric clipping, per token, aggregated over the batch.

    Per policy token: ``ratio = exp(logprobs - old_logprobs)`` (importance ratio against
    the policy that sampled the rollout) and
    ``loss = -min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A)``
    (PPO, arXiv 1707.06347; the separate upper bound is DAPO's clip-higher, arXiv
    2503.14476). ``A`` is the sequence's advantage, shared by all its tokens (GRPO).
    The tokens are then reduced by :func:`masked_aggregate`.

    Micro-batching: pass ``normalizer = loss_normalizer(full_batch_loss_mask, agg)`` to each
    micro-batch; the sum of the micro-batch losses (and of their gradients) then equals the
    full-batch loss (and gradient).

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the policy being trained
            (carries the gradient).
        old_logprobs: [B, T] log-probs of the same tokens under the rollout policy.
        advantages: [B] one advantage per sequence.
        loss_mask: [B, T] 1/True on policy tokens; other positions are ignored (any value).
        clip_eps_low: ratio lower bound is ``1 - clip_eps_low``.
        clip_eps_high: ratio upper bound is ``1 + clip_eps_high``.
        agg: "token_mean" (DAPO) or "seq_mean" (GRPO).
        normalizer: global denominator (see above); None: this batch is the whole batch.
        token_weights: optional [B, T] constant per-token weights (no gradient) multiplying
            each token's loss, e.g. truncated importance weights from :func:`tis_weights`.

    Returns:
        ``(loss, metrics)``: the 0-dim loss, and detached 0-dim tensors, each a mean over
        this batch's policy tokens: :data:`CLIP_FRAC` (tokens where the clipped branch is
        active, so they get no gradient), :data:`RATIO_MEAN`, :data:`APPROX_KL` (k3 estimate
        of KL(old || new) from ``log ratio``).

    Raises:
        DataError: shapes disagree, or a clip range is negative.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape or logprobs.dim() != 2:
        raise DataError(
            f"logprobs, old_logprobs and loss_mask must share one [B, T] shape; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise DataError(f"advantages must be [B]={logprobs.shape[0]}; got shape {tuple(advantages.shape)}")
    if clip_eps_low < 0 or clip_eps_high < 0:
        raise DataError(f"clip ranges must be >= 0; got clip_eps_low={clip_eps_low}, clip_eps_high={clip_eps_high}")
    mask = loss_mask.bool()
    log_ratio = torch.where(mask, logprobs - old_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype)[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if token_weights is not None:
        if token_weights.shape != logprobs.shape:
            raise DataError(f"token_weights must be [B, T]={tuple(logprobs.shape)}; got {tuple(token_weights.shape)}")
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    loss = masked_aggregate(per_token, mask, agg, normalizer)
    with torch.no_grad():
        metrics = {
            CLIP_FRAC: masked_mean((clipped < unclipped).to(logprobs.dtype), mask),
            RATIO_MEAN: masked_mean(ratio, mask),
            APPROX_KL: masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        }
    return loss, metrics


def _check_loss_inputs(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                       loss_mask: torch.Tensor, clip_eps_low: float, clip_eps_high: float,
                       token_weights: torch.Tensor | None) -> None:
    if logprobs.shape != old_logprobs.shape or logprobs.shape != loss_mask.shape or logprobs.dim() != 2:
        raise DataError(
            f"logprobs, old_logprobs and loss_mask must share one [B, T] shape; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise DataError(f"advantages must be [B]={logprobs.shape[0]}; got shape {tuple(advantages.shape)}")
    if clip_eps_low < 0 or clip_eps_high < 0:
        raise DataError(f"clip ranges must be >= 0; got clip_eps_low={clip_eps_low}, clip_eps_high={clip_eps_high}")
    if token_weights is not None and token_weights.shape != logprobs.shape:
        raise DataError(f"token_weights must be [B, T]={tuple(logprobs.shape)}; got {tuple(token_weights.shape)}")


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    agg: LossAgg = "seq_mean",
    normalizer: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: PPO-clip on the length-normalised *sequence* importance ratio.

    Per sequence i with policy tokens y_i (Zheng et al., arXiv 2507.18071, eqs. 5-7)::

        s_i = (pi(y_i | x) / pi_old(y_i | x)) ** (1 / |y_i|) = exp(mean_t (logprobs - old_logprobs))
        loss_i = -min(s_i * A_i, clip(s_i, 1 - clip_eps_low, 1 + clip_eps_high) * A_i)

    ``loss_i`` is written on every policy token of sequence i and reduced by
    :func:`masked_aggregate`: ``agg="seq_mean"`` is the paper's ``1/G sum_i loss_i`` exactly
    (value and gradient); ``"token_mean"`` weights each sequence by its length (GSPO-token's
    objective with sequence-level advantages). Clip ranges in the paper are about 100x smaller
    than PPO's (3e-4 / 4e-4): the ratio is a per-token geometric mean.

    Args:
        logprobs: [B, T] log-probs under the policy being trained (carries the gradient).
        old_logprobs: [B, T] log-probs of the same tokens under the sampling policy.
        advantages: [B] one advantage per sequence.
        loss_mask: [B, T] 1/True on policy tokens.
        clip_eps_low, clip_eps_high: the sequence ratio is clipped to [1 - low, 1 + high].
        agg, normalizer: as :func:`ppo_clip_loss`.
        token_weights: optional [B, T] constant weights per token (mismatch correction).

    Returns:
        ``(loss, metrics)``: metrics are means over this batch's policy tokens of
        :data:`CLIP_FRAC` (tokens of sequences whose clipped branch is active),
        :data:`RATIO_MEAN` (the sequence ratio s_i), :data:`APPROX_KL` (per-token k3).

    Raises:
        DataError: shapes disagree, or a clip range is negative.
    """
    _check_loss_inputs(logprobs, old_logprobs, advantages, loss_mask, clip_eps_low, clip_eps_high, token_weights)
    mask = loss_mask.bool()
    log_ratio = torch.where(mask, logprobs - old_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))
    lengths = mask.sum(dim=-1).clamp(min=1).to(logprobs.dtype)
    seq_ratio = torch.exp(log_ratio.sum(dim=-1) / lengths)  # [B]
    adv = advantages.to(logprobs.dtype)
    unclipped = seq_ratio * adv
    clipped = torch.clamp(seq_ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    per_seq = -torch.minimum(unclipped, clipped)
    per_token = per_seq[:, None].expand_as(logprobs)
    if token_weights is not None:
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    loss = masked_aggregate(per_token, mask, agg, normalizer)
    with torch.no_grad():
        metrics = {
            CLIP_FRAC: masked_mean((clipped < unclipped).to(logprobs.dtype)[:, None].expand_as(logprobs), mask),
            RATIO_MEAN: masked_mean(seq_ratio[:, None].expand_as(logprobs), mask),
            APPROX_KL: masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        }
    return loss, metrics


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    agg: LossAgg = "token_mean",
    normalizer: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight on every token.

    Per policy token (MiniMax-M1, arXiv 2506.13585, eqs. 4-5)::

        r = exp(logprobs - old_logprobs)
        loss = -sg(clip(r, 1 - clip_eps_low, 1 + clip_eps_high)) * A * logprobs

    Unlike PPO-clip, no token loses its gradient: the weight is clipped, not the objective.
    The paper sets only an upper bound (``clip_eps_low`` large, e.g. 1.0: no lower clip) and
    aggregates with the token mean. The loss *value* is ``-w A log pi``, not comparable with
    PPO's; its gradient is ``-w A grad log pi``.

    Args:
        logprobs: [B, T] log-probs under the policy being trained (carries the gradient).
        old_logprobs: [B, T] log-probs of the same tokens under the sampling policy.
        advantages: [B] one advantage per sequence.
        loss_mask: [B, T] 1/True on policy tokens.
        clip_eps_low, clip_eps_high: the weight is clipped to [1 - low, 1 + high].
        agg, normalizer: as :func:`ppo_clip_loss`.
        token_weights: optional [B, T] constant weights per token (mismatch correction).

    Returns:
        ``(loss, metrics)``: means over this batch's policy tokens of :data:`CLIP_FRAC` (tokens
        whose weight was clipped), :data:`RATIO_MEAN`, :data:`APPROX_KL`.

    Raises:
        DataError: shapes disagree, or a clip range is negative.
    """
    _check_loss_inputs(logprobs, old_logprobs, advantages, loss_mask, clip_eps_low, clip_eps_high, token_weights)
    mask = loss_mask.bool()
    log_ratio = torch.where(mask, logprobs - old_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs)).detach()
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    adv = advantages.to(logprobs.dtype)[:, None]
    per_token = -(weight * adv) * torch.where(mask, logprobs, torch.zeros_like(logprobs))
    if token_weights is not None:
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    loss = masked_aggregate(per_token, mask, agg, normalizer)
    with torch.no_grad():
        metrics = {
            CLIP_FRAC: masked_mean((weight != ratio).to(logprobs.dtype), mask),
            RATIO_MEAN: masked_mean(ratio, mask),
            APPROX_KL: masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        }
    return loss, metrics


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    agg: LossAgg = "token_mean",
    normalizer: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss ``trainer.loss`` names: :func:`ppo_clip_loss` (``"ppo_clip"``),
    :func:`gspo_loss` (``"gspo"``) or :func:`cispo_loss` (``"cispo"``), same arguments and returns.

    Raises:
        ConfigError: unknown ``name``.
        DataError: as the loss.
    """
    fns = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss}
    if name not in fns:
        raise ConfigError(f"trainer.loss={name!r} is unknown; expected one of {list(POLICY_LOSSES)}")
    return fns[name](logprobs, old_logprobs, advantages, loss_mask, clip_eps_low, clip_eps_high, agg, normalizer,
                     token_weights=token_weights)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set (0 where nothing is)."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)
