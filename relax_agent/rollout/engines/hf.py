"""Batched Hugging Face inference engine: many concurrent episodes, one forward pass per step.

Episodes call :meth:`HFEngine.generate` concurrently (asyncio tasks). Requests go into a
queue; one worker thread takes up to ``max_batch_size`` of them (waiting up to
``batch_wait_s`` for more), left-pads the prompts, and runs its own decode loop over the
KV cache: one prefill, then one forward pass per new token for the whole batch. Each row
keeps its own temperature, top-p, token budget, stop ids and random stream; a row that
finishes is delivered to its caller at once and dropped from the batch (its KV-cache rows
are released), so finished rows stop consuming compute.

Log-probs: the log-prob of each sampled token is ``log_softmax(logits.float() / T)`` at that
token, i.e. under the full temperature-scaled distribution *before* top-p truncation. The
trainer computes the same quantity from a forward pass over prompt + completion, so the two
agree up to kernel noise (checked to 1e-4 in the tests); with ``top_p < 1`` the sampling
distribution is the truncated one, and the importance ratio should account for that.

Weights: :meth:`HFEngine.load_weights` takes the same lock as a decode batch, so it swaps
weights between batches and every token of a generation comes from one policy version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.errors import ConfigError, DataError, EngineError, WeightSyncError
from relax_agent.moe.record import build_route_recorder, stack_routes
from relax_agent.rollout.engines.base import Generation, SamplingParams, default_stop_ids

_STOP = object()
"""Queue sentinel that ends the worker."""

_CLOSE_JOIN_S = 60.0


@dataclass
class EngineStats:
    """Counters since construction (read them between runs; the worker updates them).

    Attributes:
        batches: decode batches run (each: one prefill plus decode steps).
        forward_passes: model forward calls (prefill and decode steps).
        sequences: requests served.
        new_tokens: tokens sampled.
        max_batch_rows: largest batch served.
        weight_loads: :meth:`HFEngine.load_weights` calls applied.
        weight_load_s: seconds spent copying weights in, during which no batch could decode.
    """

    batches: int = 0
    forward_passes: int = 0
    sequences: int = 0
    new_tokens: int = 0
    max_batch_rows: int = 0
    weight_loads: int = 0
    weight_load_s: float = 0.0


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


class _Closed(Exception):
    """Raised inside the decode loop when the engine closes mid-batch."""


class HFEngine:
    """Batched sampling from a Hugging Face causal LM (implements ``InferenceEngine``).

    Args:
        model: a ``*ForCausalLM`` (eval mode) already on ``device``.
        tokenizer: its tokenizer; ``pad_token_id`` fills left padding, EOS and ``<|im_end|>``
            are the default stop ids.
        cfg: ``max_batch_size`` (rows per forward pass) and ``batch_wait_s`` (how long to
            wait for more requests before a batch starts).
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
    """

    def __init__(self, model: Any, tokenizer: Any, cfg: EngineConfig, device: str = "cpu", seed: int = 0,
                 stop_token_ids: Sequence[int] | None = None, record_routes: bool = False) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._cfg = cfg
        self._device = torch.device(device)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
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
        self._closed = False
        self._queue: queue.Queue[Any] = queue.Queue()
        self.stats = EngineStats()
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
        for prompt, p in zip(prompts, per_prompt):
            fut: concurrent.futures.Future[Generation] = concurrent.futures.Future()
            futures.append(fut)
            self._submit(list(prompt), p, lambda r, f=fut: _resolve(f, r))
        return [f.result() for f in futures]

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Copy ``state_dict`` into the model between decode batches and set ``policy_version``.

        Blocks until the running batch (if any) has finished. Keys may be a subset of the
        model's (partial updates); values are cast to the parameter's dtype and device.

        Raises:
            WeightSyncError: an unknown key or a shape mismatch (nothing is copied then).
        """
        target = self._model.state_dict()
        unknown = [k for k in state_dict if k not in target]
        if unknown:
            raise WeightSyncError(f"load_weights: {len(unknown)} keys are not in the model, e.g. {unknown[:3]}")
        for name, value in state_dict.items():
            if tuple(value.shape) != tuple(target[name].shape):
                raise WeightSyncError(f"load_weights: {name} has shape {tuple(value.shape)}, "
                                      f"the model expects {tuple(target[name].shape)}")
        with self._weights_lock, torch.no_grad():
            start = time.perf_counter()
            for name, value in state_dict.items():
                target[name].copy_(value)
            self._version = int(version)
            self.stats.weight_loads += 1
            self.stats.weight_load_s += time.perf_counter() - start

    def weight_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every tensor :meth:`load_weights` accepts (weight sync checks it)."""
        return {name: (tuple(t.shape), t.dtype) for name, t in self._model.state_dict().items()}

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

    def __enter__(self) -> "HFEngine":
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
            batch = self._collect()
            if batch is None:
                return
            if self._closed:
                _fail_unfinished(batch, EngineError("the engine was closed before this request ran"))
                continue
            self._serve(batch)

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

    def _serve(self, batch: list[_Request]) -> None:
        live = [r for r in batch if not r.cancelled]
        if not live:
            return
        try:
            with self._weights_lock:
                version = self._version
                self._decode(live, version)
        except _Closed:
            _fail_unfinished(live, EngineError("the engine was closed while this request was decoding"))
        except Exception as exc:
            error = EngineError(f"decode batch of {len(live)} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            _fail_unfinished(live, error)

    @torch.inference_mode()
    def _decode(self, reqs: list[_Request], version: int) -> None:
        """Prefill the left-padded prompts, then sample one token per live row per step.

        Shapes: ``input_ids``/``attention_mask`` [rows, max_prompt_len] for the prefill,
        then [rows, 1] tokens and a [rows, len] mask that grows by one column per step.
        """
        input_ids, attn = self._left_pad([r.prompt_ids for r in reqs])
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self._model(input_ids=input_ids, attention_mask=attn, position_ids=positions,
                          use_cache=True, logits_to_keep=1)
        cache, logits = getattr(out, self._cache_kw), out.logits[:, -1, :]
        next_pos = positions[:, -1] + 1
        self._count_batch(len(reqs))
        rows = list(reqs)
        sampler = _RowSampler(rows, self._device)
        while True:
            tokens, logprobs = sampler.sample(logits)
            routes = self._routes.last_position(len(rows)) if self._routes is not None else None
            keep = self._advance(rows, tokens.tolist(), logprobs.tolist(), version, routes)
            if not keep:
                return
            if self._closed:
                raise _Closed
            if len(keep) < len(rows):
                idx = torch.tensor(keep, device=self._device)
                cache.reorder_cache(idx)
                attn, next_pos, tokens = attn[idx], next_pos[idx], tokens[idx]
                rows = [rows[i] for i in keep]
                sampler = sampler.select(keep)
            attn = torch.cat([attn, attn.new_ones(len(rows), 1)], dim=1)
            out = self._model(input_ids=tokens[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                              use_cache=True, **{self._cache_kw: cache})
            self.stats.forward_passes += 1
            cache, logits = getattr(out, self._cache_kw), out.logits[:, -1, :]
            next_pos = next_pos + 1

    def _advance(self, rows: list[_Request], tokens: list[int], logprobs: list[float], version: int,
                 routes: Any = None) -> list[int]:
        """Append each row's token; deliver rows that finished; return indices of rows still going."""
        keep = []
        for i, (req, tok, lp) in enumerate(zip(rows, tokens, logprobs)):
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

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, max_len] token ids (pad on the left) and attention mask (1 on real tokens)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p):] = 1
        return ids.to(self._device), attn.to(self._device)

    def _count_batch(self, rows: int) -> None:
        self.stats.batches += 1
        self.stats.forward_passes += 1
        self.stats.max_batch_rows = max(self.stats.max_batch_rows, rows)


class _RowSampler:
    """The sampling state of a batch's live rows: temperatures, top-p and one generator per row."""

    def __init__(self, rows: list[_Request], device: torch.device,
                 generators: list[torch.Generator] | None = None) -> None:
        self.rows = rows
        self.temps = torch.tensor([r.params.temperature for r in rows], device=device, dtype=torch.float32)
        self.top_ps = torch.tensor([r.params.top_p for r in rows], device=device, dtype=torch.float32)
        self.generators = generators if generators is not None else [
            torch.Generator().manual_seed(r.seed) for r in rows]

    def select(self, keep: list[int]) -> "_RowSampler":
        return _RowSampler([self.rows[i] for i in keep], self.temps.device, [self.generators[i] for i in keep])

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_tokens(logits, self.temps, self.top_ps, self.generators)


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
