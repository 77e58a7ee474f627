"""The torch trainer's metric keys, and the sums it accumulates over the micro-batches of a step."""

from __future__ import annotations

import torch

LOSS = "train/loss"
PG_LOSS = "train/pg_loss"
KL_REF = "train/kl_ref"
GRAD_NORM = "train/grad_norm"
ENTROPY = "train/entropy"
LR = "train/lr"
TOKENS = "train/tokens"
POLICY_TOKENS = "train/policy_tokens"
SEQUENCES = "train/sequences"
LOSS_SCALE = "train/loss_scale"
SKIPPED_STEP = "train/skipped_step"
STEP = "train/step"
STEP_TIME_S = "timing/train_step_s"
RESIDENT_GB = "memory/trainer_resident_gb"


class Totals:
    """Sums of per-micro-batch values, some weighted by policy tokens."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.train_lp: list[torch.Tensor] = []
        self.rollout_lp: list[torch.Tensor] = []

    def add(self, key: str, value: torch.Tensor, weight: torch.Tensor | float = 1.0) -> None:
        """Add ``value`` times ``weight`` to the sum under ``key``."""
        value = value.detach().double() * weight
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def get(self, key: str, divide_by: float = 1.0) -> float:
        """The sum under ``key`` divided by ``divide_by``."""
        return float(self.sums[key]) / divide_by
