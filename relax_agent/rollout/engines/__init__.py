"""Inference engines behind one small protocol (:class:`InferenceEngine`).

``HFEngine`` (transformers, batched) lives in :mod:`relax_agent.rollout.engines.hf` and
``FakeEngine`` (scripted, for tests) in :mod:`relax_agent.rollout.engines.fake`; both are
imported from there so that importing the protocol never loads torch.
"""

from relax_agent.rollout.engines.base import Generation, InferenceEngine, SamplingParams

__all__ = ["Generation", "InferenceEngine", "SamplingParams"]
