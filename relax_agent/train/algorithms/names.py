"""The names the algorithms share: the option literals, the known modes and the metric keys.

Metric keys are namespaced strings shared with the trainer and the metrics sinks.
"""

from __future__ import annotations

from typing import Literal

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
