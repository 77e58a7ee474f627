"""Inference engines behind one small protocol (:class:`InferenceEngine`)."""

from relax_agent.rollout.engines.base import Generation, InferenceEngine, SamplingParams

__all__ = ["Generation", "InferenceEngine", "SamplingParams"]
