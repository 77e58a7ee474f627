"""Config of the rollout inference engine (``engine:`` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relax_agent.configbase import Dtype, Section


class EngineConfig(Section):
    """The rollout inference engine."""

    kind: Literal["hf", "fake"] = "hf"
    """"hf": the batched Hugging Face engine (:mod:`relax_agent.rollout.engines.hf`); "fake": scripted
    replies without a model, for tests (:mod:`relax_agent.rollout.engines.fake`)."""
    dtype: Dtype = "fp32"
    max_batch_size: int = Field(default=64, ge=1)
    """Most sequences decoded in one forward pass."""
    batch_wait_s: float = Field(default=0.02, ge=0.0)
    """How long the engine waits for more requests before starting a batch."""
