"""From rewards to advantages: the group estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++), the batch
normalisation of REINFORCE++ and DAPO's overlong reward penalty.

Sources: GRPO, arXiv 2402.03300; Dr. GRPO, arXiv 2503.20783; RLOO, arXiv 2402.14740;
REINFORCE++, arXiv 2501.03262; overlong shaping, DAPO arXiv 2503.14476 §3.4.
"""

from __future__ import annotations

import math

import torch

from relax_agent.errors import ConfigError, DataError
from relax_agent.train.algorithms.names import ADVANTAGE_ESTIMATORS


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
