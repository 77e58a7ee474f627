"""The rollout engine of a multimodal policy: ``transformers`` ``generate`` with media inputs.

Each request is a prompt's token ids plus the :class:`~relax_agent.records.MediaInputs` of the
media items in it (the renderer expanded each item's placeholder into exactly as many tokens
as its features). One worker thread serves requests one at a time: the media encoders run once
per request over all of the prompt's items (no KV is kept between turns), which on tiny CPU
models costs milliseconds. The text engine (:mod:`relax_agent.rollout.engines.hf`) batches and
caches prefixes; this one trades that for the families' own position handling (Qwen's 3-D rope
indices are computed by ``generate`` from the media grids).

Log-probs: ``log_softmax(logits.float() / T)`` at each sampled token, from the raw logits of
the same forward pass that sampled it (before top-p), as the text engine and the trainer compute
them. The media placeholder ids (``<|image_pad|>``, ``<|video_pad|>``, ``<|audio_pad|>``: the
family's ``token_ids``) are never sampled: their logits are set to -inf before sampling
(``suppress_tokens``), since a placeholder no media fills cannot be trained on; the recorded
log-probs stay those of the full distribution, as the trainer scores them (the sampling
distribution differs from it by the policy's probability mass on those ids). Sampling is reproducible per request: ``generate`` runs under a forked torch RNG seeded
with the request's seed.

Routing replay (``record_routes``, MoE policies such as Qwen3-VL-MoE): every router's choice in
every forward of ``generate`` is kept, the prefill's and each decode step's, so a generation
carries the routes of its sampled tokens (``routed_experts``) and of its whole prompt, media
tokens included (``prompt_routed_experts``); see :mod:`relax_agent.moe.record`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relax_agent.errors import ConfigError, DataError, EngineError, WeightSyncError
from relax_agent.moe.record import build_route_recorder
from relax_agent.multimodal.batch import media_model_kwargs
from relax_agent.multimodal.processor import MediaFamily, check_placeholders
from relax_agent.records import MediaInputs
from relax_agent.rollout.engines.base import Generation, SamplingParams, default_stop_ids
from relax_agent.weights.digest import Expected, load_failure, tensor_digest


@dataclass
class MediaEngineStats:
    """Counters since construction: ``sequences`` served, ``new_tokens`` sampled,
    ``media_items`` encoded, ``weight_loads`` and ``weight_load_s`` (seconds copying weights)."""

    sequences: int = 0
    new_tokens: int = 0
    media_items: int = 0
    weight_loads: int = 0
    weight_load_s: float = 0.0
    weight_verify_s: float = 0.0


class MediaEngine:
    """Implements :class:`~relax_agent.rollout.engines.base.InferenceEngine` for a multimodal policy,
    with ``generate(prompt_ids, params, media=...)``.

    Args:
        model: the engine's own copy of the policy (a ``*ForConditionalGeneration`` of a family in
            :data:`~relax_agent.multimodal.processor.FAMILIES`).
        tokenizer: its tokenizer (pad and default stop ids).
        device: torch device.
        seed: draws a sampling seed for each request without ``params.seed``.
        stop_token_ids: replaces the default stop ids (EOS, ``<|im_end|>``); ``params.stop_token_ids`` add to them.
        record_routes: MoE policies: record the experts of every prompt and sampled token
            (``Generation.prompt_routed_experts`` / ``routed_experts``) for routing replay; a dense
            policy records nothing (with a warning).

    Raises:
        ConfigError: ``record_routes`` for an MoE family without a router adapter.
    """

    def __init__(self, model: Any, tokenizer: Any, device: str = "cpu", seed: int = 0,
                 stop_token_ids: Sequence[int] | None = None, record_routes: bool = False) -> None:
        self._model = model.to(device).eval()
        self._tokenizer = tokenizer
        self._device = torch.device(device)
        self.family = MediaFamily.from_config(model.config)
        self._vocab = int(model.config.get_text_config().vocab_size)
        self._default_stop = frozenset(default_stop_ids(tokenizer) if stop_token_ids is None else stop_token_ids)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._seeds = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="media-engine")
        self._version = 0
        self._unverified: str | None = None
        """Why the weights held failed verification (then no request is served), else None."""
        self._closed = False
        self._routes = build_route_recorder(self._model) if record_routes else None
        self.stats = MediaEngineStats()

    @property
    def route_layout(self) -> tuple[tuple[int, int], str] | None:
        """``((moe_layers, top_k), dtype name)`` of the routes this engine records; None when it records none."""
        if self._routes is None:
            return None
        return (len(self._routes.routers), self._routes.routers[0].top_k), self._routes.dtype.name

    @property
    def model_config(self) -> Any:
        """The policy's transformers config."""
        return self._model.config

    @property
    def policy_version(self) -> int:
        """Version of the weights the next request uses."""
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       media: MediaInputs | None = None) -> Generation:
        """Sample a continuation of ``prompt_ids`` [P] whose media placeholders ``media`` fills.

        Raises:
            ConfigError: temperature <= 0 or top_p outside (0, 1].
            DataError: an empty prompt, a token id outside the vocabulary, or placeholder tokens
                that do not match ``media`` (names the kind and both counts).
            EngineError: the engine is closed or the forward pass failed.
        """
        if self._closed:
            raise EngineError("the media engine is closed")
        self._check(prompt_ids, params, media)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, (1,), generator=self._seeds))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._generate, list(prompt_ids), params, media, seed)

    def _check(self, prompt_ids: list[int], params: SamplingParams, media: MediaInputs | None) -> None:
        if not params.temperature > 0 or not 0 < params.top_p <= 1:
            raise ConfigError(f"sampling needs temperature > 0 and 0 < top_p <= 1; got {params.temperature}, {params.top_p}")
        if not prompt_ids:
            raise DataError("generate got an empty prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self._vocab]
        if bad:
            raise DataError(f"prompt token ids {bad[:3]} are outside the vocabulary [0, {self._vocab})")
        check_placeholders(prompt_ids, media, self.family, where="generate prompt")

    def _generate(self, prompt_ids: list[int], params: SamplingParams, media: MediaInputs | None,
                  seed: int) -> Generation:
        from transformers import GenerationConfig

        stop = self._default_stop | frozenset(params.stop_token_ids)
        config = GenerationConfig(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0,
                                  max_new_tokens=params.max_new_tokens, eos_token_id=sorted(stop) or None,
                                  pad_token_id=self._pad_id, output_logits=True, return_dict_in_generate=True,
                                  suppress_tokens=sorted(self.family.token_ids.values()) or None)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self._device)
        mask = torch.ones_like(input_ids)
        with self._lock, torch.no_grad(), torch.random.fork_rng(devices=[]):
            if self._unverified is not None:
                raise EngineError(f"the media engine's weights are not verified: {self._unverified}")
            torch.manual_seed(seed)
            version = self._version
            if self._routes is not None:
                self._routes.start_collecting()
            try:
                kwargs = media_model_kwargs(self._model, self.family, input_ids, [media])
                out = self._model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config, **kwargs)
            except Exception as exc:
                raise EngineError(f"media engine forward failed: {type(exc).__name__}: {exc}") from exc  # noqa
            finally:
                routes = self._routes.stop_collecting() if self._routes is not None else None
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        n = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
        tokens = tokens[:n]
        logprobs = [float(torch.log_softmax(step[0].float() / params.temperature, -1)[t])
                    for step, t in zip(out.logits, tokens, strict=False)]  # tokens: cut at the stop token
        self.stats.sequences += 1
        self.stats.new_tokens += len(tokens)
        self.stats.media_items += 0 if media is None else len(media)
        finish = "stop" if tokens and tokens[-1] in stop else "length"
        if routes is None:
            return Generation(tuple(tokens), tuple(logprobs), finish, version)
        p = len(prompt_ids)  # routes row q: forward position q (prefill 0 .. p-1, then one per decode step)
        assert len(routes) >= p - 1 + len(tokens), "one route row per forward position"
        return Generation(tuple(tokens), tuple(logprobs), finish, version, routed_experts=routes[p - 1:p - 1 + len(tokens)],
                          prompt_routed_experts=routes[:p - 1])

    def load_weights(self, state_dict: Mapping[str, Any], version: int,
                     expected_digests: Expected | None = None) -> None:
        """Copy ``state_dict`` (a subset of the model's keys; cast to its dtypes) between requests.

        Args:
            expected_digests: ``weights.verify``: digests of what was sent in this engine's dtypes (or a future);
                compared after the copy, under the lock no request runs without. On a mismatch the
                version is not served and every request fails (``EngineError``) until a later load
                verifies, as :meth:`relax_agent.rollout.engines.hf.HFEngine.load_weights`.

        Raises:
            WeightSyncError: an unknown key or a shape mismatch (nothing is copied then); a digest
                that differs after the copy (names the version and each tensor).
        """
        target = self._model.state_dict()
        unknown = [k for k in state_dict if k not in target]
        if unknown:
            raise WeightSyncError(f"load_weights: {len(unknown)} keys are not in the model, e.g. {unknown[:3]}")
        for name, value in state_dict.items():
            if tuple(value.shape) != tuple(target[name].shape):
                raise WeightSyncError(f"load_weights: {name} has shape {tuple(value.shape)}, "
                                      f"the model expects {tuple(target[name].shape)}")
        with self._lock, torch.no_grad():
            start = time.perf_counter()
            self._copy_weights(target, state_dict)
            if expected_digests is not None:
                spent, failure = load_failure(expected_digests, lambda want: {
                    n: tensor_digest(target[n], samples=d.samples) if n in target else None for n, d in want.items()},
                    version)
                self.stats.weight_verify_s += spent
                if failure is not None:
                    self._unverified = failure.unverified  # type: ignore[attr-defined]
                    self.stats.weight_load_s += time.perf_counter() - start
                    raise failure
            self._unverified = None
            self._version = int(version)
            self.stats.weight_loads += 1
            self.stats.weight_load_s += time.perf_counter() - start

    def _copy_weights(self, target: Mapping[str, torch.Tensor], state_dict: Mapping[str, Any]) -> None:
        """Copy (and cast) each of ``state_dict`` into the model's tensor of that name (lock held)."""
        for name, value in state_dict.items():
            target[name].copy_(value)

    def close(self) -> None:
        """Refuse new requests and stop the worker after the running one."""
        self._closed = True
        self._pool.shutdown(wait=False)
