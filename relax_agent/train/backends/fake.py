"""A trainer without a model: records every batch it gets, for tests of the control plane.

Its "weights" are one float tensor ``w`` [4] that counts the updates taken, so a test can see
which version an engine holds after a publish.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from relax_agent.errors import CheckpointError
from relax_agent.train.batch import TrainBatch


class FakeTrainer:
    """Implements :class:`~relax_agent.train.backends.base.Trainer` without a model.

    Args:
        train_s: seconds each :meth:`train_step` sleeps (a slow trainer, for schedule tests).

    Attributes:
        batches: every batch trained on, in order.
        step: updates taken.
    """

    def __init__(self, train_s: float = 0.0) -> None:
        self.train_s = train_s
        self.batches: list[TrainBatch] = []
        self.sft_batches: list[TrainBatch] = []
        self.step = 0

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Record ``batch``; the loss is the mean advantage (a value a test can predict)."""
        if self.train_s:
            time.sleep(self.train_s)
        self.batches.append(batch)
        self.step += 1
        return {"train/loss": float(batch.advantages.mean()), "train/sequences": float(batch.size)}

    def sft_step(self, batch: TrainBatch, lr: float) -> dict[str, float]:
        """Record ``batch`` in :attr:`sft_batches`; counts as an update (its weights change)."""
        self.sft_batches.append(batch)
        self.step += 1
        return {"sft/loss": float(batch.num_policy_tokens), "sft/tokens": float(batch.num_policy_tokens)}

    def end_sft(self) -> None:
        """Nothing to drop."""

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """``{"w": [4] float32}`` filled with the number of updates taken."""
        return {"w": torch.full((4,), float(self.step))}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "step" not in state:
            raise CheckpointError(f"fake trainer state lacks 'step'; got keys {sorted(state)}")
        self.step = int(state["step"])

    def save_model(self, path: Path) -> None:
        """Write ``fake_model.json`` (the update count) into ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "fake_model.json").write_text(json.dumps({"step": self.step}))
