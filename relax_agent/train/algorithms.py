"""GRPO algorithms as pure tensor functions: group advantages, the PPO-clip loss, KL estimators.

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
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from relax_agent.errors import DataError

LossAgg = Literal["token_mean", "seq_mean"]

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
