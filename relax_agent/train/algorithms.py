"""RL algorithms as pure tensor functions: advantage estimators, policy losses, mismatch corrections.

Nothing here knows about models, optimizers or micro-batches beyond one rule: every loss
takes the *global* normaliser of the step (see :func:`loss_normalizer`), so summing the
losses of micro-batches gives exactly the loss, and the gradient, of the full batch.

Sources:
    GRPO: Shao et al., "DeepSeekMath", arXiv 2402.03300 (group-relative advantages,
    per-sequence mean, k3 KL to the reference policy).
    Dr. GRPO: Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783 (no std
    division).
    DAPO: Yu et al., arXiv 2503.14476 (clip-higher, token-level mean).
    PPO: Schulman et al., arXiv 1707.06347. k3: J. Schulman, "Approximating KL Divergence"
    (2020 blog note).
    TIS: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training" (2025 blog post, fengyao.notion.site/off-policy-rl): truncated importance
    sampling against the rollout engine's log-probs.
    RLOO: Ahmadian et al., "Back to Basics", arXiv 2402.14740 (leave-one-out baseline).
    REINFORCE++: Hu et al., arXiv 2501.03262 (batch-level advantage normalisation).
    GSPO: Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071.
    CISPO: MiniMax, "MiniMax-M1", arXiv 2506.13585 (clipped, stop-gradient IS weight).
    IcePop: Ling Team, "Every Step Evolves" (Ring-1T), arXiv 2510.18855 (masked IS).
    Overlong shaping: DAPO, arXiv 2503.14476, §3.4 (soft overlong punishment, overlong filtering).

Each function has a loop-based twin in :mod:`relax_agent.train.reference_algorithms`; the unit
tests compare the two (values and gradients).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from relax_agent.errors import ConfigError, DataError

LossAgg = Literal["token_mean", "seq_mean"]
PolicyLoss = Literal["ppo_clip", "gspo", "cispo"]
AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
MismatchMode = Literal["none", "tis", "seq_tis", "icepop", "geo_mask", "seq_reject"]
OverlongMode = Literal["none", "soft", "mask"]

POLICY_LOSSES: tuple[str, ...] = ("ppo_clip", "gspo", "cispo")
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
BATCH_NORMALIZED: tuple[str, ...] = ("reinforce_pp", "reinforce_pp_baseline")
"""Estimators whose group-level values are normalised over the whole step's batch
(:func:`batch_normalized_advantages`) before the update."""
MISMATCH_MODES: tuple[str, ...] = ("none", "tis", "seq_tis", "icepop", "geo_mask", "seq_reject")

# Metric keys (namespaced, shared with the trainer and the metrics sinks).
CLIP_FRAC = "train/clip_frac"
RATIO_MEAN = "train/ratio_mean"
APPROX_KL = "train/approx_kl"
MISMATCH_K3_KL = "mismatch/k3_kl"
MISMATCH_ABS_DIFF_MEAN = "mismatch/abs_logprob_diff_mean"
MISMATCH_ABS_DIFF_MAX = "mismatch/abs_logprob_diff_max"
MISMATCH_FRAC_GT_LN2 = "mismatch/frac_abs_diff_gt_ln2"
MISMATCH_FRAC_GT_LN5 = "mismatch/frac_abs_diff_gt_ln5"
IW_MEAN = "off_policy/iw_mean"
IW_MAX = "off_policy/iw_max"
IW_CLIPPED_FRAC = "off_policy/iw_clipped_frac"
CORR_WEIGHT_MEAN = "mismatch/weight_mean"
CORR_MASKED_TOKEN_FRAC = "mismatch/masked_token_frac"
CORR_CLIPPED_TOKEN_FRAC = "mismatch/clipped_token_frac"
CORR_MASKED_SEQ_FRAC = "mismatch/masked_seq_frac"
CORR_SEQ_LOG_RATIO_MEAN = "mismatch/seq_log_ratio_mean"

_K3_MAX_DELTA = 20.0
"""Log-ratios above this are clamped in :func:`k3_kl` so exp() stays finite (exp(20) ≈ 4.9e8)."""


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    valid: torch.Tensor,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages: reward minus its group's mean, over the group's std.

    GRPO's outcome supervision (DeepSeekMath, arXiv 2402.03300, §4.1.2):
    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``; with ``std_normalize=False``
    the division is dropped (Dr. GRPO, arXiv 2503.20783), which removes the bias towards
    groups whose rewards barely differ.

    The std is the *unbiased* sample std (Bessel's n-1), as in torch.std and in the
    reference implementations people compare against (verl's ``compute_grpo_outcome_advantage``,
    TRL's ``GRPOTrainer``), so advantages and the learning rates tuned on them carry over.

    Args:
        rewards: [B] scalar reward per sample; entries of invalid samples are ignored
            (they may be NaN).
        group_index: [B] integer group id per sample (any ints; need not be contiguous).
        valid: [B] bool; False marks infrastructure failures (reward error/timeout).
            Invalid samples are left out of their group's mean and std and get advantage 0.
        std_normalize: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std before dividing.

    Returns:
        [B] advantages in ``rewards.dtype`` (float32 when rewards are not floating).
        Exactly 0 for invalid samples, for groups whose valid rewards are all equal (no
        learning signal) and for groups with a single valid sample.

    Raises:
        DataError: tensors are not 1-D of the same length, ``group_index`` is not integer,
            or a valid sample has a non-finite reward.
    """
    _check_group_inputs(rewards, group_index, valid)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    valid = valid.bool()
    _, gid = torch.unique(group_index, return_inverse=True)
    num_groups = int(gid.max()) + 1
    r = torch.where(valid, rewards.double(), torch.zeros((), dtype=torch.float64, device=rewards.device))
    w = valid.double()

    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, gid, w)
    total = torch.zeros_like(count).index_add_(0, gid, r)
    mean = total / count.clamp(min=1.0)
    centred = (r - mean[gid]) * w
    if std_normalize:
        sq = torch.zeros_like(count).index_add_(0, gid, centred * centred)
        std = torch.sqrt(sq / (count - 1.0).clamp(min=1.0))
        centred = centred / (std[gid] + eps)

    inf = torch.tensor(math.inf, dtype=torch.float64, device=r.device)
    hi = torch.full((num_groups,), -math.inf, dtype=torch.float64, device=r.device)
    lo = torch.full((num_groups,), math.inf, dtype=torch.float64, device=r.device)
    hi = hi.scatter_reduce(0, gid, torch.where(valid, r, -inf), reduce="amax")
    lo = lo.scatter_reduce(0, gid, torch.where(valid, r, inf), reduce="amin")
    has_signal = (hi > lo)[gid] & valid
    adv = torch.where(has_signal, centred, torch.zeros_like(centred))
    return adv.to(out_dtype)


def leave_one_out_advantages(rewards: torch.Tensor, group_index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """RLOO advantages: each reward minus the mean of the *other* valid rewards of its group.

    ``A_i = r_i - 1/(k-1) * sum_{j != i} r_j`` over the k valid samples of the group (RLOO,
    Ahmadian et al., "Back to Basics", arXiv 2402.14740, eq. 9; Kool et al. 2019). Equal to
    ``k/(k-1) * (r_i - mean(r_group))``: Dr. GRPO's advantage scaled by k/(k-1).

    Args:
        rewards: [B] scalar reward per sample (entries of invalid samples are ignored).
        group_index: [B] integer group id per sample.
        valid: [B] bool; invalid samples take no part in any baseline and get 0.

    Returns:
        [B] advantages in ``rewards.dtype`` (float32 when rewards are not floating); exactly 0
        for invalid samples, groups with fewer than 2 valid samples and groups whose valid
        rewards are all equal.

    Raises:
        DataError: as :func:`group_advantages`.
    """
    _check_group_inputs(rewards, group_index, valid)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    gid, r, w, count, total, has_signal = _group_sums(rewards, group_index, valid)
    others_mean = (total[gid] - r) / (count[gid] - 1.0).clamp(min=1.0)
    adv = torch.where(has_signal, (r - others_mean) * w, torch.zeros_like(r))
    return adv.to(out_dtype)


def _group_sums(rewards: torch.Tensor, group_index: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(gid [B], r [B] f64 with invalid zeroed, w [B] f64 validity, count [G], total [G], has_signal [B] bool)``."""
    valid = valid.bool()
    _, gid = torch.unique(group_index, return_inverse=True)
    num_groups = int(gid.max()) + 1
    r = torch.where(valid, rewards.double(), torch.zeros((), dtype=torch.float64, device=rewards.device))
    w = valid.double()
    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, gid, w)
    total = torch.zeros_like(count).index_add_(0, gid, r)
    inf = torch.tensor(math.inf, dtype=torch.float64, device=r.device)
    hi = torch.full((num_groups,), -math.inf, dtype=torch.float64, device=r.device)
    lo = torch.full((num_groups,), math.inf, dtype=torch.float64, device=r.device)
    hi = hi.scatter_reduce(0, gid, torch.where(valid, r, -inf), reduce="amax")
    lo = lo.scatter_reduce(0, gid, torch.where(valid, r, inf), reduce="amin")
    has_signal = (hi > lo)[gid] & valid
    return gid, r, w, count, total, has_signal


def estimator_advantages(
    estimator: str, rewards: torch.Tensor, group_index: torch.Tensor, valid: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """The group-level advantages [B] of ``estimator`` (``trainer.advantage``).

    - ``"grpo"``: ``(r - group mean) / (group std + eps)`` (:func:`group_advantages`, arXiv 2402.03300);
    - ``"dr_grpo"``: ``r - group mean`` (no std division, arXiv 2503.20783);
    - ``"rloo"``: ``r - mean of the group's other rewards`` (:func:`leave_one_out_advantages`, arXiv 2402.14740);
    - ``"reinforce_pp"``: the reward itself; the step then normalises it over the batch
      (:func:`batch_normalized_advantages`; REINFORCE++, arXiv 2501.03262);
    - ``"reinforce_pp_baseline"``: ``r - group mean``, then normalised over the batch likewise
      (REINFORCE++-baseline, arXiv 2501.03262 v3+, as verl's ``reinforce_plus_plus_baseline``).

    For the two ``reinforce_pp`` estimators the values returned here are *not* the final
    advantages: apply :func:`batch_normalized_advantages` over the step (see :data:`BATCH_NORMALIZED`).

    Args:
        estimator: one of :data:`ADVANTAGE_ESTIMATORS`.
        rewards, group_index, valid: [B] each, as :func:`group_advantages`.
        eps: added to the group std (``"grpo"``).

    Returns:
        [B] in ``rewards.dtype`` (float32 when rewards are not floating); 0 for invalid samples.

    Raises:
        ConfigError: unknown ``estimator``.
        DataError: as :func:`group_advantages`.
    """
    if estimator == "grpo":
        return group_advantages(rewards, group_index, valid, std_normalize=True, eps=eps)
    if estimator in ("dr_grpo", "reinforce_pp_baseline"):
        return group_advantages(rewards, group_index, valid, std_normalize=False, eps=eps)
    if estimator == "rloo":
        return leave_one_out_advantages(rewards, group_index, valid)
    if estimator == "reinforce_pp":
        _check_group_inputs(rewards, group_index, valid)
        out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
        return torch.where(valid.bool(), rewards.to(out_dtype), torch.zeros((), dtype=out_dtype, device=rewards.device))
    raise ConfigError(f"trainer.advantage={estimator!r} is unknown; expected one of {list(ADVANTAGE_ESTIMATORS)}")


def batch_normalized_advantages(
    advantages: torch.Tensor, token_counts: torch.Tensor, valid: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++'s batch normalisation: whiten the step's advantages over all its policy tokens.

    Every policy token of sequence ``i`` carries ``a_i`` (outcome reward, no discount), so the
    token-level mean and (unbiased) variance over the batch are the token-count-weighted ones:
    ``mu = sum_i n_i a_i / N``, ``var = sum_i n_i (a_i - mu)^2 / (N - 1)`` with ``N = sum_i n_i``,
    and ``A_i = (a_i - mu) / sqrt(var + eps)`` (Hu et al., arXiv 2501.03262, §3.2 "advantage
    normalization"; the formula of verl's ``masked_whiten`` and OpenRLHF's normalisation, which
    people compare against).

    Args:
        advantages: [B] group-level values from :func:`estimator_advantages`.
        token_counts: [B] policy tokens of each sequence (the weight of its advantage).
        valid: [B] bool; invalid rows and rows without policy tokens take no part and get 0.
        eps: added to the variance.

    Returns:
        [B] float32 (float64 for float64 input). All 0 when fewer than 2 policy tokens are valid.

    Raises:
        DataError: shapes differ or are not 1-D, a valid row's advantage is not finite, or a
            token count is negative.
    """
    shapes = (tuple(advantages.shape), tuple(token_counts.shape), tuple(valid.shape))
    if advantages.dim() != 1 or len(set(shapes)) != 1:
        raise DataError(f"advantages, token_counts and valid must be 1-D of one length [B]; got shapes {shapes}")
    if bool((token_counts < 0).any()):
        raise DataError(f"token_counts must be >= 0; got {token_counts.tolist()}")
    out_dtype = torch.promote_types(advantages.dtype, torch.float32)
    a = advantages.double()
    n = token_counts.double() * valid.bool().double()
    if bool((~torch.isfinite(a) & (n > 0)).any()):
        raise DataError(f"a valid row has a non-finite advantage: {advantages.tolist()}")
    total = float(n.sum())
    if total < 2:
        return torch.zeros_like(a, dtype=out_dtype)
    a = torch.where(n > 0, a, torch.zeros_like(a))
    mean = (n * a).sum() / total
    var = (n * (a - mean) ** 2).sum() / (total - 1.0)
    out = torch.where(n > 0, (a - mean) / torch.sqrt(var + eps), torch.zeros_like(a))
    return out.to(out_dtype)


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer_tokens: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward of each sample (arXiv 2503.14476, eq. 13).

    With ``L_max = max_tokens`` and ``L_cache = buffer_tokens``::

        R(|y|) = 0                                   if |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
               = -1                                  if |y| > L_max

    times ``factor``: a linear penalty from 0 to ``-factor`` over the last ``buffer_tokens``
    tokens before the limit.

    Args:
        lengths: [B] response lengths in tokens (integers >= 0).
        max_tokens: L_max, e.g. ``rollout.max_new_tokens``.
        buffer_tokens: L_cache, 1 <= L_cache <= L_max.
        factor: scale of the penalty (>= 0).

    Returns:
        [B] float32 penalties in [-factor, 0].

    Raises:
        ConfigError: ``buffer_tokens`` outside [1, max_tokens] or ``factor`` < 0.
        DataError: ``lengths`` is not 1-D or holds a negative length.
    """
    if not 1 <= buffer_tokens <= max_tokens:
        raise ConfigError(f"rollout.overlong.buffer_tokens={buffer_tokens} must be in [1, max_new_tokens={max_tokens}]")
    if factor < 0:
        raise ConfigError(f"rollout.overlong.penalty={factor} must be >= 0")
    if lengths.dim() != 1 or bool((lengths < 0).any()):
        raise DataError(f"lengths must be [B] integers >= 0; got {lengths.tolist()}")
    length = lengths.double()
    expected = float(max_tokens - buffer_tokens)
    ramp = (expected - length) / buffer_tokens
    pen = torch.where(length <= expected, torch.zeros_like(length),
                      torch.where(length <= max_tokens, ramp, torch.full_like(length, -1.0)))
    return (pen * factor).to(torch.float32)


def _check_group_inputs(rewards: torch.Tensor, group_index: torch.Tensor, valid: torch.Tensor) -> None:
    shapes = (tuple(rewards.shape), tuple(group_index.shape), tuple(valid.shape))
    if rewards.dim() != 1 or len(set(shapes)) != 1:
        raise DataError(f"rewards, group_index and valid must be 1-D of one length [B]; got shapes {shapes}")
    if group_index.is_floating_point() or group_index.is_complex():
        raise DataError(f"group_index must hold integer group ids, got dtype {group_index.dtype}")
    bad = valid.bool() & ~torch.isfinite(rewards.double())
    if bool(bad.any()):
        idx = int(bad.nonzero()[0, 0])
        raise DataError(
            f"reward of valid sample {idx} is {rewards[idx].item()}; mark it invalid (valid=False) "
            "or give it a finite reward"
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
            CLIP_FRAC: _masked_mean((clipped < unclipped).to(logprobs.dtype), mask),
            RATIO_MEAN: _masked_mean(ratio, mask),
            APPROX_KL: _masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
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
            CLIP_FRAC: _masked_mean((clipped < unclipped).to(logprobs.dtype)[:, None].expand_as(logprobs), mask),
            RATIO_MEAN: _masked_mean(seq_ratio[:, None].expand_as(logprobs), mask),
            APPROX_KL: _masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
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
            CLIP_FRAC: _masked_mean((weight != ratio).to(logprobs.dtype), mask),
            RATIO_MEAN: _masked_mean(ratio, mask),
            APPROX_KL: _masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
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


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


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
    delta = delta.clamp(max=_K3_MAX_DELTA)
    return torch.expm1(delta) - delta


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
    w = torch.exp(log_w.clamp(max=_K3_MAX_DELTA))
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
        CORR_WEIGHT_MEAN: _masked_mean(weights, mask),
        CORR_MASKED_TOKEN_FRAC: _masked_mean(masked.to(dtype), mask),
        CORR_CLIPPED_TOKEN_FRAC: _masked_mean(clipped.to(dtype), mask),
        CORR_MASKED_SEQ_FRAC: (seq_all_masked.to(dtype) * seqs).sum() / n_seqs,
        CORR_SEQ_LOG_RATIO_MEAN: (seq_log_r / n_tokens.clamp(min=1).to(dtype) * seqs).sum() / n_seqs,
    }
    return weights, metrics
