"""Config of the rollout inference engine (``engine:`` section)."""

from __future__ import annotations

from typing import Any, Literal

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

    def build(self, model: Any = None, tokenizer: Any = None, device: str = "cpu", seed: int = 0,
              record_routes: bool = False) -> Any:
        """The engine this section selects (``kind``), over runtime objects.

        Args:
            model: the engine's own copy of the policy (``kind: hf``; unused by ``fake``).
            tokenizer: its tokenizer (stop ids, padding).
            device: where the engine runs.
            seed: seeds requests that carry no seed of their own.
            record_routes: record MoE routes for routing replay.

        Returns:
            an :class:`~relax_agent.rollout.engines.base.InferenceEngine`.
        """
        if self.kind == "fake":
            from relax_agent.rollout.engines.base import default_stop_ids
            from relax_agent.rollout.engines.fake import FakeEngine, echo_reply

            stop = default_stop_ids(tokenizer) if tokenizer is not None else (2,)
            return FakeEngine(echo_reply(stop), stop_token_ids=stop)
        from relax_agent.rollout.engines.hf import HFEngine

        return HFEngine(model, tokenizer, self, device=device, seed=seed, record_routes=record_routes)
