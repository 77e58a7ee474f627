"""The trainer protocol the control plane talks to (through a trainer service).

A backend turns a :class:`~relax_agent.train.batch.TrainBatch` (collated from data-bus fields by
:func:`relax_agent.train.collate.collate_fields`) into one optimizer update, hands its policy
weights to the weight sync, and saves / restores its own state for checkpoints. Backends:
``torch`` (:class:`~relax_agent.train.backends.torch_backend.TorchTrainer`, one process) and
``fake`` (:class:`~relax_agent.train.backends.fake.FakeTrainer`, no model, for tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from relax_agent.train.batch import TrainBatch


@runtime_checkable
class Trainer(Protocol):
    """One policy's optimiser state and update rule."""

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer update on ``batch`` ([B, T] tensors); returns the step's metrics
        (``train/loss``, ``train/grad_norm``, mismatch metrics...)."""
        ...

    def sft_step(self, batch: TrainBatch, lr: float) -> dict[str, float]:
        """One supervised update (negative log-likelihood of the ``loss_mask`` tokens) at
        learning rate ``lr``: the cold-start warm-up before RL (``trainer.sft_warmup_steps``)."""
        ...

    def end_sft(self) -> None:
        """The warm-up is over: release what only it needed (its optimizer)."""
        ...

    def policy_state_dict(self) -> Mapping[str, Any]:
        """The policy weights for the weight sync, under the engine's (Hugging Face) names.
        May be live tensors: they change at the next :meth:`train_step`."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything but the weights that a resume needs (optimizer, schedules, counters)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (weights were loaded with the model).

        Raises:
            CheckpointError: the state does not fit this trainer.
        """
        ...

    def save_model(self, path: Path) -> None:
        """Write the policy weights (and its config) to folder ``path`` so that the policy
        loader can load them back."""
        ...


@runtime_checkable
class HoldsProcesses(Protocol):
    """A trainer that holds processes or other resources beyond its tensors (the Megatron backend's
    ranks): its service calls :meth:`close` when the run ends."""

    def close(self) -> None:
        """Stop the processes it started (idempotent)."""
        ...
