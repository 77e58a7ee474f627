"""Continuous-batching Hugging Face inference engine with prefix reuse.

Episodes call :meth:`HFEngine.generate` concurrently (asyncio tasks). Requests go into a
queue; one worker thread owns the model and keeps a *running batch*. A request joins it
between two decode steps, as soon as the batch has fewer than ``max_batch_size`` rows
(continuous batching: it never waits for a batch to finish). Joining means one prefill of
its own, over only the part of its prompt the prefix cache does not hold, and sampling its
first token; then every decode step is one forward pass over all rows, each row feeding its
last sampled token. Each row keeps its own temperature, top-p, token budget, stop ids and
random stream; a row that finishes is delivered to its caller at once and leaves the batch.

Prefix reuse (``engine.prefix_cache``): the KV of every prefilled prompt and of every
finished sequence (prompt + completion) stays in an LRU cache bounded in tokens. The next
turn of a multi-turn episode sends a prompt that extends the previous turn's ids (prompt +
sampled tokens + observation), so the longest cached prefix of its ids (found by comparing
token ids, no episode id needed) covers all earlier turns and only the new tokens are
prefilled. Requests of a group, which share their prompt, prefill it once.

Log-probs: the log-prob of each sampled token is ``log_softmax(logits.float() / T)`` at that
token, i.e. under the full temperature-scaled distribution *before* top-p truncation. The
trainer computes the same quantity from a forward pass over prompt + completion, so the two
agree up to kernel noise (checked to 1e-4 in the tests); with ``top_p < 1`` the sampling
distribution is the truncated one, and the importance ratio should account for that.

Weights: :meth:`HFEngine.load_weights` waits until the running rows have finished (no new
row joins meanwhile), copies the weights and clears the prefix cache, all under the lock a
running batch holds. So every token of a generation comes from one policy version, and no
token is ever computed on KV written by older weights. With ``weights.verify`` it digests what
it now holds under the same lock and refuses a version whose digest differs from what was sent.

Reproducibility: a row samples from its own ``torch.Generator`` seeded with its request's
seed, so what it samples does not depend on which other rows share its batch. With
``max_batch_size: 1`` (and the prefix cache off, its default there) each request is prefilled
in full and decoded alone, so results are bit-identical whatever the load.
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
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from relax_agent import metrics as M
from relax_agent.errors import ConfigError, DataError, EngineError, WeightSyncError
from relax_agent.moe.record import build_route_recorder, stack_routes
from relax_agent.rollout.engines.base import Generation, SamplingParams, default_stop_ids
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.weights.digest import Expected, TensorDigest, load_failure, tensor_digest

_STOP = object()
"""Queue sentinel that ends the worker."""

_CLOSE_JOIN_S = 60.0


@dataclass
class EngineStats:
    """Counters since construction (read them between runs; the worker updates them).

    Attributes:
        batches: decode runs, each from the first admitted request until no row is left.
        forward_passes: model forward calls (prefills and decode steps).
        prefills: requests prefilled (one forward pass each).
        prefill_tokens: prompt tokens run through the model by prefills.
        prefix_hit_tokens: prompt tokens whose KV came from the prefix cache instead.
        decode_steps: batched decode forward passes (one sampled token per row each).
        admitted_mid_batch: requests that joined a batch while other rows were decoding.
        sequences: requests served.
        new_tokens: tokens sampled.
        max_batch_rows: most rows decoding together.
        weight_loads: :meth:`HFEngine.load_weights` calls applied.
        weight_load_s: seconds spent copying weights in, during which no batch could decode.
        weight_verify_s: part of ``weight_load_s`` spent on digests of the loaded weights (``weights.verify``).
    """

    batches: int = 0
    forward_passes: int = 0
    prefills: int = 0
    prefill_tokens: int = 0
    prefix_hit_tokens: int = 0
    decode_steps: int = 0
    admitted_mid_batch: int = 0
    sequences: int = 0
    new_tokens: int = 0
    max_batch_rows: int = 0
    weight_loads: int = 0
    weight_load_s: float = 0.0
    weight_verify_s: float = 0.0


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    seed: int
    deliver: Callable[[Generation | BaseException], None]
    on_token: Callable[[int, float, int], None] | None = None
    """Called from the worker with (token id, log-prob, policy version) as each token is sampled."""
    cancelled: bool = False
    done: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[Any] = field(default_factory=list)
    """Per sampled token, [layers, top_k] experts of the forward that scored it (MoE with record_routes)."""
    generator: torch.Generator | None = None
    """The row's random stream, seeded with ``seed`` when it is prefilled."""


class _Closed(Exception):
    """Raised inside the decode loop when the engine closes mid-batch."""


class HFEngine:
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
        _check_cache_layout(model)
        self._prefix = _PrefixCache(cfg.prefix_cache_max_tokens) if cfg.uses_prefix_cache() else None
        self._loads_pending = 0
        self._loads_cv = threading.Condition()
        self._routes = build_route_recorder(model) if record_routes else None
        self._worker = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ public API

    @property
    def policy_version(self) -> int:
        """Version of the weights the next batch will use."""
        return self._version

    @property
    def route_layout(self) -> tuple[tuple[int, int], str] | None:
        """``((moe_layers, top_k), dtype name)`` of the routes this engine records (routing
        replay), or None when it records none."""
        if self._routes is None:
            return None
        return (len(self._routes.routers), self._routes.routers[0].top_k), self._routes.dtype.name

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: Callable[[int, float, int], None] | None = None) -> Generation:
        """Sample a continuation of ``prompt_ids`` ([n] token ids); batched with concurrent calls.

        Cancelling the awaiting task drops the row from its batch at the next decode step.
        ``on_token(token_id, logprob, policy_version)`` (token streaming) is called from the
        engine's worker thread as each token is sampled, before the result is delivered; it must
        be quick and thread-safe (e.g. ``loop.call_soon_threadsafe``).

        Raises:
            ConfigError: invalid sampling parameters.
            DataError: empty prompt, token id outside the vocabulary, or too long for the model.
            EngineError: the engine is closed or the forward pass failed.
        """
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

        Blocks until the running rows (if any) have finished; no new request joins them
        meanwhile. Clears the prefix cache (its KV came from the old weights). Keys may be a subset of the
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
            self._queue.put(_STOP)
        if threading.current_thread() is not self._worker:
            self._worker.join(_CLOSE_JOIN_S)
            if self._worker.is_alive():
                warnings.warn(f"HFEngine worker still running {_CLOSE_JOIN_S}s after close()", stacklevel=2)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Request):
                item.deliver(EngineError("the engine was closed before this request ran"))

    def __enter__(self) -> HFEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ submission

    def _submit(self, prompt_ids: list[int], params: SamplingParams,
                deliver: Callable[[Generation | BaseException], None],
                on_token: Callable[[int, float, int], None] | None = None) -> _Request:
        self._check_request(prompt_ids, params)
        if params.seed is not None:
            seed = params.seed
        else:
            with self._seed_lock:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._generator))
        req = _Request(list(prompt_ids), params, self._default_stop | frozenset(params.stop_token_ids), seed, deliver,
                       on_token)
        with self._submit_lock:
            if self._closed:
                raise EngineError("the engine is closed")
            self._queue.put(req)
        return req

    def _check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if not params.temperature > 0:
            raise ConfigError(f"SamplingParams.temperature={params.temperature} must be > 0")
        if not 0 < params.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p={params.top_p} must be in (0, 1]")
        if params.max_new_tokens < 1:
            raise ConfigError(f"SamplingParams.max_new_tokens={params.max_new_tokens} must be >= 1")
        if not prompt_ids:
            raise DataError("prompt_ids is empty; the engine needs at least one prompt token")
        lo, hi = min(prompt_ids), max(prompt_ids)
        if lo < 0 or hi >= self._vocab_size:
            raise DataError(f"prompt_ids holds token id {lo if lo < 0 else hi}, outside the vocabulary "
                            f"[0, {self._vocab_size})")
        total = len(prompt_ids) + params.max_new_tokens
        if self._max_positions is not None and total > self._max_positions:
            raise DataError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                            f"{total} exceeds the model's max_position_embeddings={self._max_positions}")

    # ------------------------------------------------------------------ worker

    def _run(self) -> None:
        while True:
            waiting = self._collect()
            if waiting is None:
                return
            if self._closed:
                _fail_unfinished(waiting, EngineError("the engine was closed before this request ran"))
                continue
            self._serve(waiting)

    def _collect(self) -> list[_Request] | None:
        """Block for one request, then gather more for up to ``batch_wait_s``; None once closed."""
        first = self._queue.get()
        if first is _STOP:
            return None
        batch = [first]
        deadline = time.monotonic() + self._cfg.batch_wait_s
        while len(batch) < self._cfg.max_batch_size:
            remaining_s = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=remaining_s) if remaining_s > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                self._queue.put(_STOP)
                break
            batch.append(item)
        return batch

    def _serve(self, waiting: list[_Request]) -> None:
        """Decode ``waiting`` and every request admitted after them until no row is left."""
        live = [r for r in waiting if not r.cancelled]
        if not live:
            return
        with self._loads_cv:  # a pending weight load goes first
            self._loads_cv.wait_for(lambda: self._loads_pending == 0)
        served = list(live)
        try:
            with self._weights_lock:
                if self._unverified is not None:
                    _fail_unfinished(served, EngineError(f"the engine's weights are not verified: {self._unverified}"))
                    return
                self._decode(live, served, self._version)
        except _Closed:
            _fail_unfinished(served, EngineError("the engine was closed while this request was decoding"))
        except Exception as exc:
            error = EngineError(f"decode batch of {len(served)} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            _fail_unfinished(served, error)

    @torch.inference_mode()
    def _decode(self, waiting: list[_Request], served: list[_Request], version: int) -> None:
        """Admit requests, then one decode step for all rows, until no row is left.

        ``served`` collects every request taken from the queue (to fail them if a step fails).
        """
        batch = _Batch(self._device)
        self.stats.batches += 1
        while True:
            batch.merge(self._admit(waiting, batch, served, version))
            waiting = []
            self.stats.max_batch_rows = max(self.stats.max_batch_rows, len(batch.rows))
            if not batch.rows:
                return
            if self._closed:
                raise _Closed
            self._step(batch, version)

    def _admit(self, waiting: list[_Request], batch: _Batch, served: list[_Request],
               version: int) -> list[_Row]:
        """Prefill ``waiting``, then queued requests while the batch has room and no weight
        load is pending; returns the prefilled rows that did not finish at their first token."""
        rows: list[_Row] = []
        mid_batch = bool(batch.rows)
        pending = iter(waiting)
        while len(batch.rows) + len(rows) < self._cfg.max_batch_size:
            req = next(pending, None)
            if req is None:
                if self._loads_pending or self._closed:
                    break
                req = self._take_queued()
                if req is None:
                    break
                served.append(req)
                self.stats.admitted_mid_batch += mid_batch
            if self._closed:
                raise _Closed
            if not req.cancelled and (row := self._prefill(req, version)) is not None:
                rows.append(row)
        return rows

    def _take_queued(self) -> _Request | None:
        """The next queued request without waiting; None if there is none or the engine closes."""
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        if item is _STOP:
            self._queue.put(_STOP)
            return None
        return item

    def _prefill(self, req: _Request, version: int) -> _Row | None:
        """Run the prompt tokens the prefix cache lacks and sample the first token.

        Shapes: ``input_ids`` and ``position_ids`` [1, n - reused], ``attention_mask`` [1, n];
        the row's cache then holds keys and values [1, kv_heads, n, head_dim] per layer.

        Returns:
            the row to decode, or None if it finished at its first token.
        """
        prompt = torch.tensor(req.prompt_ids, dtype=torch.long)
        n = len(req.prompt_ids)
        reused, past = self._prefix.lookup(prompt, limit=n - 1) if self._prefix is not None else (0, None)
        out = self._model(input_ids=prompt[None, reused:].to(self._device),
                          attention_mask=torch.ones((1, n), dtype=torch.long, device=self._device),
                          position_ids=torch.arange(reused, n, device=self._device)[None],
                          use_cache=True, logits_to_keep=1, **{self._cache_kw: _cache_of(past)})
        self.stats.forward_passes += 1
        self.stats.prefills += 1
        self.stats.prefill_tokens += n - reused
        self.stats.prefix_hit_tokens += reused
        kv = _kv_of(getattr(out, self._cache_kw))
        if self._prefix is not None:
            self._prefix.insert(prompt, kv)
        req.generator = torch.Generator().manual_seed(req.seed)
        temps = torch.tensor([req.params.temperature], device=self._device, dtype=torch.float32)
        top_ps = torch.tensor([req.params.top_p], device=self._device, dtype=torch.float32)
        tokens, logprobs = sample_tokens(out.logits[:, -1, :], temps, top_ps, [req.generator])
        routes = self._routes.last_position(1) if self._routes is not None else None
        if not self._advance([req], tokens.tolist(), logprobs.tolist(), version, routes):
            return None
        return _Row(req, kv, n, int(tokens[0]))

    def _step(self, batch: _Batch, version: int) -> None:
        """One forward pass over every row (its last sampled token), then sample each row's next.

        Shapes: ``input_ids`` and ``position_ids`` [rows, 1]; ``attention_mask`` [rows, width + 1],
        1 on the columns a row really holds (see :class:`_Batch`).
        """
        input_ids, attn, positions = batch.step_inputs()
        out = self._model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True,
                          **{self._cache_kw: batch.cache})
        self.stats.forward_passes += 1
        self.stats.decode_steps += 1
        batch.stepped(getattr(out, self._cache_kw))
        tokens, logprobs = batch.sample(out.logits[:, -1, :])
        routes = self._routes.last_position(len(batch.rows)) if self._routes is not None else None
        token_list = tokens.tolist()
        keep = self._advance(batch.rows, token_list, logprobs.tolist(), version, routes)
        if self._prefix is not None:
            for i, req in enumerate(batch.rows):
                if req.done:  # finished now: keep prompt + completion (but its last token, never fed)
                    self._prefix.insert(torch.tensor(req.prompt_ids + req.token_ids[:-1]), batch.row_kv(i))
        batch.select(keep, token_list)

    def _advance(self, rows: list[_Request], tokens: list[int], logprobs: list[float], version: int,
                 routes: Any = None) -> list[int]:
        """Append each row's token; deliver rows that finished; return indices of rows still going."""
        keep = []
        for i, (req, tok, lp) in enumerate(zip(rows, tokens, logprobs, strict=True)):
            req.token_ids.append(tok)
            req.logprobs.append(lp)
            if req.on_token is not None:
                req.on_token(tok, lp, version)
            if routes is not None:
                req.routes.append(routes[i])
            self.stats.new_tokens += 1
            if tok in req.stop_ids:
                self._finish(req, "stop", version)
            elif len(req.token_ids) >= req.params.max_new_tokens:
                self._finish(req, "length", version)
            elif not req.cancelled:
                keep.append(i)
        return keep

    def _finish(self, req: _Request, reason: str, version: int) -> None:
        req.done = True
        self.stats.sequences += 1
        routed = stack_routes(req.routes) if req.routes else None
        req.deliver(Generation(tuple(req.token_ids), tuple(req.logprobs), reason, version, routed))



def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
                  generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row with its own temperature, top-p and random stream.

    Inverse-CDF sampling: one uniform draw per row from that row's (CPU) generator, located
    in the cumulative sum of the row's top-p-truncated probabilities. A row's sample thus
    depends only on its own logits and generator, never on the other rows of the batch.

    Args:
        logits: [rows, vocab] next-token logits (any float dtype).
        temperatures: [rows] > 0.
        top_ps: [rows] in (0, 1].
        generators: one ``torch.Generator`` per row.

    Returns:
        ``(tokens, logprobs)``: [rows] long token ids, and [rows] float32
        ``log_softmax(logits / T)`` at those tokens (the full distribution, before top-p).
    """
    logp = torch.log_softmax(logits.float() / temperatures[:, None], dim=-1)
    probs = logp.exp()
    if bool((top_ps < 1).any()):
        probs = top_p_filter(probs, top_ps)
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).to(logits.device)
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).clamp_min(torch.finfo(torch.float32).tiny)
    tokens = torch.searchsorted(cdf, target[:, None]).squeeze(1).clamp_max(probs.shape[-1] - 1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail of each row outside its nucleus (Holtzman et al. 2020, arXiv 1904.09751).

    Args:
        probs: [rows, vocab] probabilities.
        top_p: [rows] nucleus mass in (0, 1]; a row keeps the smallest set of most likely
            tokens whose mass reaches ``top_p`` (always at least one token).

    Returns:
        [rows, vocab] unnormalised probabilities with the tail set to 0.
    """
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def _resolve(fut: asyncio.Future[Generation] | concurrent.futures.Future[Generation],
             result: Generation | BaseException) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


def _fail_unfinished(reqs: list[_Request], error: EngineError) -> None:
    """Deliver ``error`` to every request of a failed batch that has not been answered yet."""
    for req in reqs:
        if not req.done:
            req.done = True
            req.deliver(error)


KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each [rows, kv_heads, seq, head_dim]."""
RowKV = list[tuple[torch.Tensor, torch.Tensor]]
"""One row's per-layer (keys, values), each [kv_heads, seq, head_dim]."""

_SPARE_COLUMNS = 64
"""Columns a KV buffer holds beyond its content, for decode steps to write into."""


@dataclass
class _Row:
    """A prefilled request joining the batch: its KV ([1, kv_heads, length, head_dim] per layer),
    cached length (= the position of its next input token) and that next input token."""

    req: _Request
    kv: KV
    length: int
    next_token: int


class _Batch:
    """The rows decoding together and their KV cache.

    Layout: per layer, keys and values [rows, kv_heads, width, head_dim]; row ``i`` holds its
    ``lengths[i]`` real columns right-aligned (columns ``width - lengths[i]`` .. ``width - 1``),
    the columns before them are zero padding that the attention mask hides. Its next input token
    ``next_tokens[i]`` goes at position ``lengths[i]``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[_Request] = []
        self.lengths: list[int] = []
        self.next_tokens: list[int] = []
        self.cache: DynamicCache | None = None
        self._sampling: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def width(self) -> int:
        if self.cache is None:
            return 0
        first: Any = self.cache.layers[0]  # an attention layer (transformers types its keys as optional)
        return first.keys.shape[-2]

    def merge(self, new: list[_Row]) -> None:
        """Add prefilled rows: the batch's KV is copied once into buffers wide enough for every row."""
        if not new:
            return
        rows_kv = [self._row_views(i) for i in range(len(self.rows))] + [[(k[0], v[0]) for k, v in r.kv] for r in new]
        self.lengths += [r.length for r in new]
        self.cache = _assemble(rows_kv, self.lengths)
        self.rows += [r.req for r in new]
        self.next_tokens += [r.next_token for r in new]
        self._sampling = None

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input_ids`` [rows, 1], ``attention_mask`` [rows, width + 1], ``position_ids`` [rows, 1]."""
        lengths = torch.tensor(self.lengths, device=self.device)
        columns = torch.arange(self.width + 1, device=self.device)
        attn = (columns[None, :] >= (self.width - lengths)[:, None]).long()
        input_ids = torch.tensor(self.next_tokens, dtype=torch.long, device=self.device)[:, None]
        return input_ids, attn, lengths[:, None]

    def stepped(self, cache: DynamicCache) -> None:
        """Take the cache a decode step returned (one more column for every row)."""
        self.cache = cache
        self.lengths = [n + 1 for n in self.lengths]

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`sample_tokens` for the rows, from ``logits`` [rows, vocab]."""
        if self._sampling is None:
            self._sampling = (
                torch.tensor([r.params.temperature for r in self.rows], device=self.device, dtype=torch.float32),
                torch.tensor([r.params.top_p for r in self.rows], device=self.device, dtype=torch.float32))
        generators = [r.generator for r in self.rows if r.generator is not None]
        assert len(generators) == len(self.rows)  # a row gets its generator when it is prefilled
        return sample_tokens(logits, *self._sampling, generators)

    def row_kv(self, i: int) -> KV:
        """Row ``i``'s real columns, copied out: [1, kv_heads, lengths[i], head_dim] per layer."""
        return [(k[None].clone(), v[None].clone()) for k, v in self._row_views(i)]

    def select(self, keep: list[int], tokens: list[int]) -> None:
        """Keep rows ``keep`` (their next input tokens from ``tokens``); drop padding no row needs."""
        if len(keep) < len(self.rows):
            self._sampling = None
            rows_kv = [self._row_views(i) for i in keep]
            self.rows = [self.rows[i] for i in keep]
            self.lengths = [self.lengths[i] for i in keep]
            self.cache = _assemble(rows_kv, self.lengths) if keep else None
        self.next_tokens = [tokens[i] for i in keep]

    def _row_views(self, i: int) -> RowKV:
        assert self.cache is not None  # rows have columns only once the batch has a cache
        start = self.width - self.lengths[i]
        return [(k[i, :, start:], v[i, :, start:]) for k, v in _kv_of(self.cache)]


class _PrefixCache:
    """KV of recent prompts and finished sequences, found again by longest common token prefix.

    An entry is ``ids`` [m] (CPU long) with keys and values [1, kv_heads, m, head_dim] per layer,
    computed under the engine's current weights (the engine clears the cache on every weight
    update). Bounded to ``max_tokens`` in total, least recently used first out; an entry whose
    ids are a prefix of a newer entry's is dropped (the newer one serves every lookup it would).

    Args:
        max_tokens: most tokens held over all entries.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[int, tuple[torch.Tensor, KV]] = OrderedDict()
        self._next_key = 0

    def lookup(self, ids: torch.Tensor, limit: int) -> tuple[int, KV | None]:
        """``(r, kv)``: the longest cached prefix of ``ids`` [n], cut to at most ``limit`` tokens,
        and its keys/values [1, kv_heads, r, head_dim] per layer (views); ``(0, None)`` on a miss."""
        best, best_key = 0, None
        for key, (cached, _) in self._entries.items():
            common = _common_prefix(cached, ids)
            if common > 0 and common >= best:  # ties: the most recent entry
                best, best_key = common, key
        reused = min(best, limit)
        if best_key is None or reused <= 0:
            return 0, None
        self._entries.move_to_end(best_key)
        kv = self._entries[best_key][1]
        return reused, [(k[:, :, :reused], v[:, :, :reused]) for k, v in kv]

    def insert(self, ids: torch.Tensor, kv: KV) -> None:
        """Hold ``kv`` (per layer [1, kv_heads, len(ids), head_dim]) for ``ids``, evicting LRU entries."""
        if len(ids) > self.max_tokens:
            return
        for key in [k for k, (cached, _) in self._entries.items()
                    if len(cached) <= len(ids) and _common_prefix(cached, ids) == len(cached)]:
            self._drop(key)
        self._entries[self._next_key] = (ids, kv)
        self._next_key += 1
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def _drop(self, key: int) -> None:
        ids, _ = self._entries.pop(key)
        self.tokens -= len(ids)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of the 1-D id tensors ``a`` and ``b``."""
    n = min(len(a), len(b))
    mismatch = (a[:n] != b[:n]).nonzero()
    return int(mismatch[0]) if len(mismatch) else n


def _kv_of(cache: DynamicCache) -> KV:
    layers: list[Any] = cache.layers  # attention layers (transformers types their keys/values as optional)
    return [(layer.keys, layer.values) for layer in layers]


def _cache_of(kv: KV | None) -> DynamicCache:
    """A ``DynamicCache`` holding ``kv`` (no copy), or an empty one for None."""
    cache = DynamicCache()
    for keys, values in kv or ():
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


class _GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose new columns are written in place into spare buffer capacity.

    ``DynamicLayer`` concatenates, copying the whole cache at every decode step; here a step
    writes one column per row. ``keys``/``values`` are views [rows, kv_heads, length, head_dim]
    of buffers with at least ``length`` columns, reallocated 25% larger when full.

    Args:
        keys, values: buffers [rows, kv_heads, capacity, head_dim].
        length: columns already filled.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self._buffers: tuple[torch.Tensor, ...] = (keys, values)
        self._length = length
        self._expose()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._length, self._length + key_states.shape[-2]
        if end > self._buffers[0].shape[-2]:
            self._buffers = tuple(_widened(buf, start, end + max(_SPARE_COLUMNS, end // 4)) for buf in self._buffers)
        self._buffers[0][:, :, start:end] = key_states
        self._buffers[1][:, :, start:end] = value_states
        self._length = end
        return self._expose()

    def _expose(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = (buf[:, :, :self._length] for buf in self._buffers)
        self.keys, self.values = keys, values
        return keys, values


def _widened(buf: torch.Tensor, filled: int, capacity: int) -> torch.Tensor:
    out = buf.new_empty((*buf.shape[:2], capacity, buf.shape[3]))
    out[:, :, :filled] = buf[:, :, :filled]
    return out


def _assemble(rows_kv: list[RowKV], lengths: list[int]) -> DynamicCache:
    """A batch cache: row ``j``'s ``lengths[j]`` columns right-aligned in ``max(lengths)`` columns
    (zeros before them), in buffers with ``_SPARE_COLUMNS`` more for decode steps."""
    width = max(lengths)
    cache = DynamicCache()
    for layer in range(len(rows_kv[0])):
        ref = rows_kv[0][layer][0]
        buffers = []
        for side in (0, 1):
            buf = ref.new_empty((len(rows_kv), ref.shape[0], width + _SPARE_COLUMNS, ref.shape[2]))
            for j, (row, n) in enumerate(zip(rows_kv, lengths, strict=True)):
                buf[j, :, :width - n].zero_()
                buf[j, :, width - n:width] = row[layer][side]
            buffers.append(buf)
        cache.layers.append(_GrowingLayer(buffers[0], buffers[1], width))
    return cache


def _check_cache_layout(model: Any) -> None:
    """Refuse models whose cache is not plain attention KV (linear attention, shared KV layers).

    The engine keeps a full ``DynamicLayer`` per layer (sliding-window layers included: the
    attention mask applies the window), which it splits and merges by rows.
    """
    odd = sorted({type(layer).__name__ for layer in DynamicCache(config=model.config).layers
                  if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)})
    if odd:
        raise ConfigError(f"engine.kind=hf keeps one attention KV cache per layer; this model "
                          f"({model.config.model_type}) needs cache layers {odd}")
