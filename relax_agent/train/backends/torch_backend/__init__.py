"""The torch trainer backend: token log-probs and one policy-gradient step per batch.

Modules: :mod:`.trainer` (:class:`TorchTrainer`, the step, its state and the SFT warm-up),
:mod:`.logprobs` (chunked per-token log-probs and entropies), :mod:`.metrics` (the metric keys),
:mod:`.policy` (readying the model: master weights, LoRA, frozen embeddings, dropout check).
"""

from __future__ import annotations

from relax_agent.train.backends.torch_backend.logprobs import (
    first_scored_position,
    token_logprobs,
    token_logprobs_and_entropy,
)
from relax_agent.train.backends.torch_backend.metrics import (
    ENTROPY,
    GRAD_NORM,
    KL_REF,
    LOSS,
    LOSS_SCALE,
    LR,
    PG_LOSS,
    POLICY_TOKENS,
    RESIDENT_GB,
    SEQUENCES,
    SKIPPED_STEP,
    STEP,
    STEP_TIME_S,
    TOKENS,
)
from relax_agent.train.backends.torch_backend.trainer import TorchTrainer

__all__ = [
    "ENTROPY",
    "GRAD_NORM",
    "KL_REF",
    "LOSS",
    "LOSS_SCALE",
    "LR",
    "PG_LOSS",
    "POLICY_TOKENS",
    "RESIDENT_GB",
    "SEQUENCES",
    "SKIPPED_STEP",
    "STEP",
    "STEP_TIME_S",
    "TOKENS",
    "TorchTrainer",
    "first_scored_position",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
