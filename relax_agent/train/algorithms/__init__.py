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

Modules: :mod:`.names` (option literals, modes, metric keys), :mod:`.advantages` (rewards to
advantages, overlong penalty), :mod:`.losses` (policy losses and their reduction), :mod:`.kl` (the
k3 estimator), :mod:`.corrections` (train/rollout mismatch metrics and corrections).

Each function has a loop-based twin in :mod:`relax_agent.train.reference_algorithms`; the unit
tests compare the two (values and gradients).
"""

from __future__ import annotations

from relax_agent.train.algorithms.advantages import (
    batch_normalized_advantages,
    estimator_advantages,
    group_advantages,
    leave_one_out_advantages,
    overlong_penalty,
)
from relax_agent.train.algorithms.corrections import (
    SEQ_WEIGHTED_CORRECTION_METRICS,
    TOKEN_WEIGHTED_CORRECTION_METRICS,
    check_mismatch_bounds,
    importance_weight_metrics,
    mismatch_correction,
    mismatch_metrics,
    tis_weights,
)
from relax_agent.train.algorithms.kl import k3_kl
from relax_agent.train.algorithms.losses import (
    cispo_loss,
    gspo_loss,
    loss_normalizer,
    masked_aggregate,
    policy_loss,
    ppo_clip_loss,
)
from relax_agent.train.algorithms.names import (
    ADVANTAGE_ESTIMATORS,
    APPROX_KL,
    BATCH_NORMALIZED,
    CLIP_FRAC,
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
    POLICY_LOSSES,
    RATIO_MEAN,
    AdvantageEstimator,
    LossAgg,
    MismatchMode,
    OverlongMode,
    PolicyLoss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "APPROX_KL",
    "AdvantageEstimator",
    "BATCH_NORMALIZED",
    "CLIP_FRAC",
    "CORR_CLIPPED_TOKEN_FRAC",
    "CORR_MASKED_SEQ_FRAC",
    "CORR_MASKED_TOKEN_FRAC",
    "CORR_SEQ_LOG_RATIO_MEAN",
    "CORR_WEIGHT_MEAN",
    "IW_CLIPPED_FRAC",
    "IW_MAX",
    "IW_MEAN",
    "LossAgg",
    "MISMATCH_ABS_DIFF_MAX",
    "MISMATCH_ABS_DIFF_MEAN",
    "MISMATCH_FRAC_GT_LN2",
    "MISMATCH_FRAC_GT_LN5",
    "MISMATCH_K3_KL",
    "MISMATCH_MODES",
    "MismatchMode",
    "OverlongMode",
    "POLICY_LOSSES",
    "PolicyLoss",
    "RATIO_MEAN",
    "SEQ_WEIGHTED_CORRECTION_METRICS",
    "TOKEN_WEIGHTED_CORRECTION_METRICS",
    "batch_normalized_advantages",
    "check_mismatch_bounds",
    "cispo_loss",
    "estimator_advantages",
    "group_advantages",
    "gspo_loss",
    "importance_weight_metrics",
    "k3_kl",
    "leave_one_out_advantages",
    "loss_normalizer",
    "masked_aggregate",
    "mismatch_correction",
    "mismatch_metrics",
    "overlong_penalty",
    "policy_loss",
    "ppo_clip_loss",
    "tis_weights",
]
