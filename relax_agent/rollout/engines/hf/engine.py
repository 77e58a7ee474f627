"""The HF engine's public face: :class:`HFEngine` takes requests, loads weights, reports stats.

Callers' threads (or event loops) submit requests to a queue and are answered by the worker
thread (:mod:`relax_agent.rollout.engines.hf.scheduler`); :meth:`HFEngine.load_weights` copies
weights in under the lock a running batch holds. A multimodal policy's requests are served
unbatched, media and all, by :mod:`relax_agent.rollout.engines.hf.media`, under the same lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from relax_agent import metrics as M
from relax_agent.errors import ConfigError, DataError, EngineError, WeightSyncError
from relax_agent.moe.record import build_route_recorder
from relax_agent.rollout.engines.base import Generation, SamplingParams, check_request, default_stop_ids
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.rollout.engines.hf.batch import Request
from relax_agent.rollout.engines.hf.kv_cache import PrefixCache, check_cache_layout
from relax_agent.rollout.engines.hf.media import MediaPath, is_media_model
from relax_agent.rollout.engines.hf.scheduler import STOP, EngineStats, Scheduler
from relax_agent.weights.digest import Expected, TensorDigest, load_failure, tensor_digest

if TYPE_CHECKING:
    from relax_agent.records import MediaInputs

_CLOSE_JOIN_S = 60.0
"""Seconds :meth:`HFEngine.close` waits for the worker thread to end."""


class HFEngine(Scheduler):
    """Batched sampling from a Hugging Face causal LM (implements ``InferenceEngine``).

    Args:
        model: a ``*ForCausalLM`` (eval mode) already on ``device``.
        tokenizer: its tokenizer; EOS and ``<|im_end|>`` are the default stop ids.
        cfg: ``max_batch_size`` (rows per forward pass), ``batch_wait_s`` (how long an idle
            engine waits for more requests before it starts), ``prefix_cache`` and
            ``prefix_cache_max_tokens`` (KV reuse across turns and requests).
        device: where input tensors are built ("cpu", "cuda:0").
        seed: seeds the engine's generator; each request without ``params.seed`` draws its
            own sampling seed from it in arrival order.
        stop_token_ids: replaces the default stop ids; ``params.stop_token_ids`` add to them.
        record_routes: MoE policies: record each sampled token's top-k experts per MoE layer
            into ``Generation.routed_experts`` for routing replay (see :mod:`relax_agent.moe.record`);
            ignored, with a warning, for a dense model.

    Sampling is reproducible per request: a row samples from its own ``torch.Generator``
    seeded with ``params.seed`` (or a seed drawn from the engine generator), so what it
    samples does not depend on which other rows share its batch.

    A multimodal policy (a ``*ForConditionalGeneration`` of a family in
    :data:`~relax_agent.multimodal.processor.FAMILIES`) is served one request at a time, with or
    without media, by ``transformers`` ``generate`` (:mod:`relax_agent.rollout.engines.hf.media`:
    placeholder ids never sampled, no prefix cache); :meth:`generate` takes its ``media=``.

    Raises:
        ConfigError: a model whose cache is not plain attention KV (linear attention layers).
    """

    def __init__(self, model: Any, tokenizer: Any, cfg: EngineConfig, device: str = "cpu", seed: int = 0,
                 stop_token_ids: Sequence[int] | None = None, record_routes: bool = False) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._cfg = cfg
        self._device = torch.device(device)
        self._vocab_size = int(model.config.get_text_config().vocab_size)
        self._max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        # transformers >= 5.24 names the KV cache `cache` (argument and output); older: `past_key_values`.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._default_stop = frozenset(default_stop_ids(tokenizer) if stop_token_ids is None else stop_token_ids)
        self._generator = torch.Generator().manual_seed(seed)
        self._seed_lock = threading.Lock()
        self._weights_lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self._version = 0
        self._unverified: str | None = None
        """Why the weights held failed verification (then no request is served), else None."""
        self._closed = False
        self._queue: queue.Queue[Any] = queue.Queue()
        self.stats = EngineStats()
        self._metrics_mark = (0, 0)
        check_cache_layout(model)
        self._prefix = PrefixCache(cfg.prefix_cache_max_tokens) if cfg.uses_prefix_cache() else None
        self._loads_pending = 0
        self._loads_cv = threading.Condition()
        self._routes = build_route_recorder(model) if record_routes else None
        self._media = MediaPath(model, tokenizer, self._device, self._routes) if is_media_model(model.config) else None
        self._worker = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ public API

    @property
    def policy_version(self) -> int:
        """Version of the weights the next batch will use."""
        return self._version

    @property
    def model_config(self) -> Any:
        """The policy's transformers config."""
        return self._model.config

    @property
    def route_layout(self) -> tuple[tuple[int, int], str] | None:
        """``((moe_layers, top_k), dtype name)`` of the routes this engine records (routing
        replay), or None when it records none."""
        if self._routes is None:
            return None
        return (len(self._routes.routers), self._routes.routers[0].top_k), self._routes.dtype.name

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: Callable[[int, float, int], None] | None = None,
                       media: MediaInputs | None = None) -> Generation:
        """Sample a continuation of ``prompt_ids`` ([n] token ids); batched with concurrent calls.

        Cancelling the awaiting task drops the row from its batch at the next decode step.
        ``on_token(token_id, logprob, policy_version)`` (token streaming) is called from the
        engine's worker thread as each token is sampled, before the result is delivered; it must
        be quick and thread-safe (e.g. ``loop.call_soon_threadsafe``).

        A multimodal policy's request (``media``: the items whose placeholders ``prompt_ids``
        holds, in order; None without) is served unbatched (:mod:`relax_agent.rollout.engines.hf.media`);
        ``on_token`` is then called for each token once the generation is done.

        Raises:
            ConfigError: invalid sampling parameters.
            DataError: empty prompt, token id outside the vocabulary, or too long for the model;
                ``media`` for a text policy; placeholder tokens that do not match ``media``.
            EngineError: the engine is closed or the forward pass failed.
        """
        if self._media is not None:
            return await self._generate_media(prompt_ids, params, on_token, media)
        if media is not None:
            raise DataError(f"generate got {len(media)} media item(s) for a text policy "
                            f"({self._model.config.model_type}); a multimodal family is needed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Generation] = loop.create_future()

        def deliver(result: Generation | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(_resolve, fut, result)
            except RuntimeError:  # the caller's loop is gone; nobody is waiting
                pass

        req = self._submit(prompt_ids, params, deliver, on_token)
        try:
            return await fut
        except asyncio.CancelledError:
            req.cancelled = True
            raise

    async def _generate_media(self, prompt_ids: list[int], params: SamplingParams,
                              on_token: Callable[[int, float, int], None] | None,
                              media: MediaInputs | None) -> Generation:
        """:meth:`generate` of a multimodal policy: one request at a time in the media path's thread."""
        assert self._media is not None
        if self._closed:
            raise EngineError("the engine is closed")
        self._check_request(prompt_ids, params)
        self._media.check(prompt_ids, media)
        seed = self._draw_seed(params)
        stop = self._default_stop | frozenset(params.stop_token_ids)
        loop = asyncio.get_running_loop()
        gen = await loop.run_in_executor(self._media.pool, self._serve_media, list(prompt_ids), params, media, seed,
                                         stop)
        if on_token is not None:
            for token, logprob in zip(gen.token_ids, gen.logprobs, strict=True):
                on_token(token, logprob, gen.policy_version)
        return gen

    def _serve_media(self, prompt_ids: list[int], params: SamplingParams, media: MediaInputs | None, seed: int,
                     stop: frozenset[int]) -> Generation:
        """One media request under the weights lock (the media path's worker thread)."""
        assert self._media is not None
        with self._weights_lock:
            if self._unverified is not None:
                raise EngineError(f"the engine's weights are not verified: {self._unverified}")
            gen = self._media.generate(prompt_ids, params, media, seed, stop, self._version)
            self.stats.sequences += 1
            self.stats.new_tokens += len(gen.token_ids)
            self.stats.media_items += 0 if media is None else len(media)
        return gen

    def generate_many(self, prompts: Sequence[Sequence[int]],
                      params: SamplingParams | Sequence[SamplingParams]) -> list[Generation]:
        """Blocking batch generation for evaluation code: one :class:`Generation` per prompt, in order.

        Raises:
            ConfigError: ``params`` is a sequence of the wrong length, or invalid.
            DataError, EngineError: as :meth:`generate`.
        """
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ConfigError(f"generate_many got {len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        futures = []
        for prompt, p in zip(prompts, per_prompt, strict=True):
            fut: concurrent.futures.Future[Generation] = concurrent.futures.Future()
            futures.append(fut)
            self._submit(list(prompt), p, functools.partial(_resolve, fut))
        return [f.result() for f in futures]

    def load_weights(self, state_dict: Mapping[str, Any], version: int,
                     expected_digests: Expected | None = None) -> None:
        """Copy ``state_dict`` into the model between decode batches and set ``policy_version``.

        Blocks until the running rows (if any) have finished (``engine.hf.update_policy:
        finish_old``) or until the next decode step ends (``abort_resume``: the rows then resume on
        the new weights); no new request joins them meanwhile. Clears the prefix cache (its KV came from the old weights). Keys may be a subset of the
        model's (partial updates); values are cast to the parameter's dtype and device.

        Args:
            expected_digests: name -> digest of what was sent, in this engine's dtypes, or a future of
                them (``weights.verify``, :mod:`relax_agent.weights.digest`). After the copy, still holding
                the lock no batch decodes without, the engine digests the parameters it now holds and
                compares; on a mismatch the version is not served: ``policy_version`` stays, and every
                request fails with :class:`EngineError` until a later load verifies (the parameters are
                already overwritten, so the previous version cannot be served either).

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
        with self._loads_cv:
            self._loads_pending += 1
        try:
            with self._weights_lock, torch.no_grad():
                start = time.perf_counter()
                self._copy_weights(target, state_dict)
                if self._prefix is not None:
                    self._prefix.clear()
                if expected_digests is not None:
                    spent, failure = load_failure(expected_digests, lambda want: self.weight_digest(want, target), version)
                    self.stats.weight_verify_s += spent
                    if failure is not None:
                        self._unverified = failure.unverified  # type: ignore[attr-defined]
                        self.stats.weight_load_s += time.perf_counter() - start
                        raise failure
                self._unverified = None
                self._version = int(version)
                self.stats.weight_loads += 1
                self.stats.weight_load_s += time.perf_counter() - start
        finally:
            with self._loads_cv:
                self._loads_pending -= 1
                self._loads_cv.notify_all()

    def _copy_weights(self, target: Mapping[str, torch.Tensor], state_dict: Mapping[str, Any]) -> None:
        """Copy (and cast) each of ``state_dict`` into the model's tensor of that name (lock held)."""
        for name, value in state_dict.items():
            target[name].copy_(value)

    def weight_digest(self, expected: Mapping[str, TensorDigest],
                      held: Mapping[str, torch.Tensor] | None = None) -> dict[str, TensorDigest | None]:
        """Digests of the model's tensors named in ``expected`` as this engine holds them (its dtype),
        each with that entry's sample count; None for a name the model does not have. ``held``: the
        model's ``state_dict()`` if the caller has it."""
        held = self._model.state_dict() if held is None else held
        return {name: tensor_digest(held[name], samples=want.samples) if name in held else None
                for name, want in expected.items()}

    def weight_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every tensor :meth:`load_weights` accepts (weight sync checks it)."""
        return {name: (tuple(t.shape), t.dtype) for name, t in self._model.state_dict().items()}

    def metrics(self) -> dict[str, float]:
        """``rollout/prefix_cache_hit_rate`` (prompt tokens whose KV was reused / prompt tokens)
        since the previous call; empty with ``engine.prefix_cache`` off."""
        if self._prefix is None:
            return {}
        hit, run = self.stats.prefix_hit_tokens, self.stats.prefill_tokens
        d_hit, d_run = hit - self._metrics_mark[0], run - self._metrics_mark[1]
        self._metrics_mark = (hit, run)
        return {M.PREFIX_CACHE_HIT_RATE: d_hit / (d_hit + d_run) if d_hit + d_run else 0.0}

    def reseed(self, seed: int) -> None:
        """Restart the engine generator (seeds of requests submitted from now on)."""
        with self._seed_lock:
            self._generator.manual_seed(seed)

    def close(self) -> None:
        """Stop the worker; pending and in-flight requests fail with :class:`EngineError`. Idempotent."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(STOP)
        if threading.current_thread() is not self._worker:
            self._worker.join(_CLOSE_JOIN_S)
            if self._worker.is_alive():
                warnings.warn(f"HFEngine worker still running {_CLOSE_JOIN_S}s after close()", stacklevel=2)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Request):
                item.deliver(EngineError("the engine was closed before this request ran"))
        if self._media is not None:
            self._media.close()

    def __enter__(self) -> HFEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ submission

    def _submit(self, prompt_ids: list[int], params: SamplingParams,
                deliver: Callable[[Generation | BaseException], None],
                on_token: Callable[[int, float, int], None] | None = None) -> Request:
        self._check_request(prompt_ids, params)
        seed = self._draw_seed(params)
        req = Request(list(prompt_ids), params, self._default_stop | frozenset(params.stop_token_ids), seed, deliver,
                      on_token)
        with self._submit_lock:
            if self._closed:
                raise EngineError("the engine is closed")
            self._queue.put(req)
        return req

    def _draw_seed(self, params: SamplingParams) -> int:
        """``params.seed``, else the next seed of the engine generator."""
        if params.seed is not None:
            return params.seed
        with self._seed_lock:
            return int(torch.randint(0, 2**62, (1,), generator=self._generator))

    def _check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        check_request(prompt_ids, params, self._vocab_size, self._max_positions,
                      "the model's max_position_embeddings")


def _resolve(fut: asyncio.Future[Generation] | concurrent.futures.Future[Generation],
             result: Generation | BaseException) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
