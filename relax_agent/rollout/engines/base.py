"""The inference-engine protocol the rollout drivers talk to."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from relax_agent.errors import ConfigError, DataError


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options for one request.

    Attributes:
        max_new_tokens: most tokens to sample.
        temperature: softmax temperature (> 0).
        top_p: nucleus mass in (0, 1].
        stop_token_ids: generation ends after any of these is sampled (it is kept).
        seed: optional per-request seed (engines may ignore it when batching).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Generation:
    """What the engine returns for one request.

    Attributes:
        token_ids: [n] sampled token ids (stop token included when finish_reason == "stop").
        logprobs: [n] log-prob of each sampled token under the temperature-scaled policy.
        finish_reason: "stop" or "length".
        policy_version: weights version that produced every token of this generation.
        routed_experts: optional [n, layers, top_k] uint8/int16 expert indices (MoE).
        prompt_routed_experts: optional [P - 1, layers, top_k] experts the prefill chose at prompt
            positions 0 .. P - 2, i.e. for prompt tokens 1 .. P - 1 (MoE; an engine that prefills
            the whole prompt each request, as the HF engine does for a multimodal policy); the last prompt position
            scored the first sampled token and is ``routed_experts[0]``.
        token_versions: [n] policy version of each token, for an engine that can swap weights
            inside a request (vLLM under ``update_policy: abort_resume``); then
            ``policy_version`` is the oldest. Empty: every token is ``policy_version``'s.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    policy_version: int
    routed_experts: Any = None
    token_versions: tuple[int, ...] = ()
    prompt_routed_experts: Any = None


@runtime_checkable
class InferenceEngine(Protocol):
    """Generates continuations of token-id prompts; batches concurrent requests itself."""

    @property
    def policy_version(self) -> int:
        """The version of the weights the engine samples with now (0: the initial weights)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample a continuation of ``prompt_ids``.

        Raises:
            EngineError: the engine failed or was closed.
        """
        ...

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Atomically switch to new weights between generation steps."""
        ...

    def close(self) -> None:
        """Release the engine (its model, threads and any server); generating after it fails."""


# -- optional capabilities of an engine (declared, checked with isinstance, never looked up by name) --
@runtime_checkable
class RecordsRoutes(Protocol):
    """An engine that can record MoE routes for routing replay (R3)."""

    @property
    def route_layout(self) -> tuple[tuple[int, ...], str] | None:
        """``((layers, top_k), dtype)`` of the routes it records, or None when it records none."""
        ...


@runtime_checkable
class ReportsMetrics(Protocol):
    """An engine with counters of its own (prefix-cache hit rate, batch sizes) for the step row."""

    def metrics(self) -> dict[str, float]:
        """``engine/<name>`` -> value since the last call (or cumulative, as each engine documents)."""
        ...


@runtime_checkable
class DeclaresWeightLayout(Protocol):
    """An engine that declares the tensors it loads (a weight subscriber checks a version against it
    before loading, and verifies what was loaded per tensor)."""

    def weight_layout(self) -> Mapping[str, tuple[tuple[int, ...], Any]]:
        """Engine tensor name -> (shape, dtype) of every weight :meth:`InferenceEngine.load_weights` accepts."""
        ...


class WeightLoadStats(Protocol):
    """Seconds an engine spent applying weights (cumulative)."""

    weight_load_s: float
    weight_verify_s: float


@runtime_checkable
class TimesWeightLoads(Protocol):
    """An engine that measures its own pause while weights load (:class:`WeightLoadStats`)."""

    stats: WeightLoadStats


def route_layout_of(engine: Any) -> tuple[tuple[int, ...], str] | None:
    """``engine.route_layout`` for an engine that :class:`RecordsRoutes`, else None."""
    return engine.route_layout if isinstance(engine, RecordsRoutes) else None


def engine_metrics(engine: Any) -> dict[str, float]:
    """``engine.metrics()`` for an engine that :class:`ReportsMetrics`, else ``{}``."""
    return engine.metrics() if isinstance(engine, ReportsMetrics) else {}


TURN_END_TOKENS = ("<|im_end|>", "<|call|>", "<|return|>", "<|eom_id|>", "<|observation|>", "<|user|>", "<turn|>",
                   "<|tool_response>")
"""Tokens that end an assistant turn in some family whatever the tokenizer's EOS says: ChatML's
``<|im_end|>``, gpt-oss's ``<|call|>`` (a tool call) and ``<|return|>``, Llama 3.1's ``<|eom_id|>``,
GLM-4.5+'s next-role tokens ``<|observation|>`` and ``<|user|>`` (its ``generation_config`` stops on
them), Gemma 4's ``<turn|>`` and ``<|tool_response>`` (a tool call waits for its result there)."""


def default_stop_ids(tokenizer: Any) -> list[int]:
    """EOS plus those of :data:`TURN_END_TOKENS` that the vocabulary has."""
    ids = []
    eos = tokenizer.eos_token_id
    ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    vocab = tokenizer.get_vocab()
    ids.extend(vocab[t] for t in TURN_END_TOKENS if t in vocab)
    return sorted(set(ids))


def check_request(prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_len: int | None,
                  limit_name: str, hint: str = "") -> None:
    """Refuse a request no engine can serve, before it is queued.

    Args:
        prompt_ids: [n] prompt token ids.
        vocab_size: ids must lie in ``[0, vocab_size)``.
        max_len: most tokens of prompt plus ``max_new_tokens``; None: no bound.
        limit_name: what ``max_len`` is, for the message (``"the model's max_position_embeddings"``).
        hint: appended to that message (where the bound is set).

    Raises:
        ConfigError: ``temperature <= 0``, ``top_p`` outside (0, 1], or ``max_new_tokens < 1``.
        DataError: an empty prompt, an id outside the vocabulary, or prompt + ``max_new_tokens`` over ``max_len``.
    """
    if not params.temperature > 0:
        raise ConfigError(f"SamplingParams.temperature={params.temperature} must be > 0")
    if not 0 < params.top_p <= 1:
        raise ConfigError(f"SamplingParams.top_p={params.top_p} must be in (0, 1]")
    if params.max_new_tokens < 1:
        raise ConfigError(f"SamplingParams.max_new_tokens={params.max_new_tokens} must be >= 1")
    if not prompt_ids:
        raise DataError("prompt_ids is empty; the engine needs at least one prompt token")
    lo, hi = min(prompt_ids), max(prompt_ids)
    if lo < 0 or hi >= vocab_size:
        raise DataError(f"prompt_ids holds token id {lo if lo < 0 else hi}, outside the vocabulary [0, {vocab_size})")
    total = len(prompt_ids) + params.max_new_tokens
    if max_len is not None and total > max_len:
        raise DataError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                        f"{total} exceeds {limit_name}={max_len}{hint}")
