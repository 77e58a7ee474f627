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
        hang_at_update: the update (1-based, counting restored ones) whose :meth:`train_step` never
            returns (sleeps forever: a hung trainer); None: never.
        hang_marker: with ``hang_at_update``: a file created when the hang starts; when it exists
            already, the trainer does not hang (a restarted trainer goes on).

    Attributes:
        batches: every batch trained on, in order.
        step: updates taken.
    """

    def __init__(self, train_s: float = 0.0, hang_at_update: int | None = None,
                 hang_marker: str | Path | None = None) -> None:
        self.train_s = train_s
        self.hang_at_update = hang_at_update
        self.hang_marker = None if hang_marker is None else Path(hang_marker)
        self.batches: list[TrainBatch] = []
        self.sft_batches: list[TrainBatch] = []
        self.step = 0

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Record ``batch``; the loss is the mean advantage (a value a test can predict)."""
        if self.train_s:
            time.sleep(self.train_s)
        if self.step + 1 == self.hang_at_update and not (self.hang_marker is not None and self.hang_marker.exists()):
            if self.hang_marker is not None:
                self.hang_marker.touch()
            while True:
                time.sleep(3600.0)
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
        """``{"step": ...}``: the fake trainer's only state."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["step"]``.

        Raises:
            CheckpointError: ``state`` has no ``step``.
        """
        if "step" not in state:
            raise CheckpointError(f"fake trainer state lacks 'step'; got keys {sorted(state)}")
        self.step = int(state["step"])

    def save_model(self, path: Path) -> None:
        """Write ``fake_model.json`` (the update count) into ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "fake_model.json").write_text(json.dumps({"step": self.step}))
