"""The HF engine's worker thread: continuous batching from the request queue.

One thread owns the model. It gathers queued requests, prefills each (over only the prompt
tokens the prefix cache lacks) and samples its first token, then runs one decode step over all
rows at a time; between two steps a queued request joins while the batch has room and no weight
load is pending, and a row that finishes is delivered at once. Under ``engine.hf.update_policy:
abort_resume`` a pending weight load also goes in between two steps, and the running rows resume
on the new weights (:meth:`Scheduler._resume_on_new_weights`). :class:`Scheduler` holds these
steps; :class:`~relax_agent.rollout.engines.hf.engine.HFEngine` inherits it and owns the state
it declares.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from relax_agent.errors import EngineError
from relax_agent.moe.record import RouteRecorder, stack_routes
from relax_agent.rollout.engines.base import Generation
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.rollout.engines.hf.batch import Batch, Request, Row
from relax_agent.rollout.engines.hf.kv_cache import PrefixCache, cache_of, kv_of
from relax_agent.rollout.engines.hf.sampling import sample_tokens

STOP = object()
"""Queue sentinel that ends the worker."""


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
        resumed_rows: running rows moved to new weights mid-generation (``update_policy: abort_resume``),
            each at the cost of one prefill of its tokens so far.
        media_items: media items encoded (a multimodal policy's requests).
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
    resumed_rows: int = 0
    media_items: int = 0


class _Closed(Exception):
    """Raised inside the decode loop when the engine closes mid-batch."""


class Scheduler:
    """The worker loop of :class:`~relax_agent.rollout.engines.hf.engine.HFEngine` (its ``_run`` is
    the worker thread's target). The attributes below are the engine's, set in its ``__init__``."""

    _model: Any
    _cfg: EngineConfig
    _device: torch.device
    _cache_kw: str
    _queue: queue.Queue[Any]
    _closed: bool
    _version: int
    _unverified: str | None
    _weights_lock: threading.Lock
    _loads_cv: threading.Condition
    _loads_pending: int
    _prefix: PrefixCache | None
    _routes: RouteRecorder | None
    stats: EngineStats

    def _run(self) -> None:
        while True:
            waiting = self._collect()
            if waiting is None:
                return
            if self._closed:
                _fail_unfinished(waiting, EngineError("the engine was closed before this request ran"))
                continue
            self._serve(waiting)

    def _collect(self) -> list[Request] | None:
        """Block for one request, then gather more for up to ``batch_wait_s``; None once closed."""
        first = self._queue.get()
        if first is STOP:
            return None
        batch = [first]
        deadline = time.monotonic() + self._cfg.batch_wait_s
        while len(batch) < self._cfg.max_batch_size:
            remaining_s = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=remaining_s) if remaining_s > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is STOP:
                self._queue.put(STOP)
                break
            batch.append(item)
        return batch

    def _serve(self, waiting: list[Request]) -> None:
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
    def _decode(self, waiting: list[Request], served: list[Request], version: int) -> None:
        """Admit requests, then one decode step for all rows, until no row is left.

        ``served`` collects every request taken from the queue (to fail them if a step fails).
        """
        batch = Batch(self._device)
        self.stats.batches += 1
        while True:
            batch.merge(self._admit(waiting, batch, served, version))
            waiting = []
            self.stats.max_batch_rows = max(self.stats.max_batch_rows, len(batch.rows))
            if not batch.rows:
                return
            if self._closed:
                raise _Closed
            if self._loads_pending and self._cfg.hf.update_policy == "abort_resume":
                batch, version = self._resume_on_new_weights(batch)
                continue
            self._step(batch, version)

    def _resume_on_new_weights(self, batch: Batch) -> tuple[Batch, int]:
        """Let the pending weight loads run between two decode steps, then rebuild the running
        rows on the new weights: each row's KV is recomputed by one prefill of its prompt and the
        tokens it has sampled but the last (which is fed by the next step, as before). The tokens
        already sampled keep their versions and log-probs; every later token is an exact sample of
        the new policy, never computed on KV written by the old weights.

        Returns:
            the rebuilt batch and the version it now decodes with.

        Raises:
            EngineError: the loaded weights failed verification (the rows fail with it).
        """
        self._weights_lock.release()  # held by _serve; the loader takes it now
        try:
            with self._loads_cv:
                self._loads_cv.wait_for(lambda: self._loads_pending == 0)
        finally:
            self._weights_lock.acquire()
        if self._unverified is not None:
            raise EngineError(f"the engine's weights are not verified: {self._unverified}")
        fresh = Batch(self._device)
        rows = [r for r in batch.rows if not r.cancelled]
        fresh.merge([Row(r, self._forward_ids(r.prompt_ids + r.token_ids[:-1])[1],
                         len(r.prompt_ids) + len(r.token_ids) - 1, r.token_ids[-1]) for r in rows])
        self.stats.resumed_rows += len(rows)
        return fresh, self._version

    def _admit(self, waiting: list[Request], batch: Batch, served: list[Request],
               version: int) -> list[Row]:
        """Prefill ``waiting``, then queued requests while the batch has room and no weight
        load is pending; returns the prefilled rows that did not finish at their first token."""
        rows: list[Row] = []
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

    def _take_queued(self) -> Request | None:
        """The next queued request without waiting; None if there is none or the engine closes."""
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        if item is STOP:
            self._queue.put(STOP)
            return None
        return item

    def _prefill(self, req: Request, version: int) -> Row | None:
        """Run the prompt tokens the prefix cache lacks and sample the first token.

        Shapes: ``input_ids`` and ``position_ids`` [1, n - reused], ``attention_mask`` [1, n];
        the row's cache then holds keys and values [1, kv_heads, n, head_dim] per layer.

        Returns:
            the row to decode, or None if it finished at its first token.
        """
        n = len(req.prompt_ids)
        out, kv = self._forward_ids(req.prompt_ids)
        self.stats.prefills += 1
        req.generator = torch.Generator().manual_seed(req.seed)
        temps = torch.tensor([req.params.temperature], device=self._device, dtype=torch.float32)
        top_ps = torch.tensor([req.params.top_p], device=self._device, dtype=torch.float32)
        tokens, logprobs = sample_tokens(out.logits[:, -1, :], temps, top_ps, [req.generator])
        routes = self._routes.last_position(1) if self._routes is not None else None
        if not self._advance([req], tokens.tolist(), logprobs.tolist(), version, routes):
            return None
        return Row(req, kv, n, int(tokens[0]))

    def _forward_ids(self, ids: list[int]) -> tuple[Any, Any]:
        """Forward ``ids`` over the tokens the prefix cache lacks (at least the last one) and cache
        the result; returns the model output (logits [1, 1, vocab] of the last position) and the
        KV of all ``ids`` ([1, kv_heads, len(ids), head_dim] per layer)."""
        prompt = torch.tensor(ids, dtype=torch.long)
        n = len(ids)
        reused, past = self._prefix.lookup(prompt, limit=n - 1) if self._prefix is not None else (0, None)
        out = self._model(input_ids=prompt[None, reused:].to(self._device),
                          attention_mask=torch.ones((1, n), dtype=torch.long, device=self._device),
                          position_ids=torch.arange(reused, n, device=self._device)[None],
                          use_cache=True, logits_to_keep=1, **{self._cache_kw: cache_of(past)})
        self.stats.forward_passes += 1
        self.stats.prefill_tokens += n - reused
        self.stats.prefix_hit_tokens += reused
        kv = kv_of(getattr(out, self._cache_kw))
        if self._prefix is not None:
            self._prefix.insert(prompt, kv)
        return out, kv

    def _step(self, batch: Batch, version: int) -> None:
        """One forward pass over every row (its last sampled token), then sample each row's next.

        Shapes: ``input_ids`` and ``position_ids`` [rows, 1]; ``attention_mask`` [rows, width + 1],
        1 on the columns a row really holds (see :class:`Batch`).
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

    def _advance(self, rows: list[Request], tokens: list[int], logprobs: list[float], version: int,
                 routes: Any = None) -> list[int]:
        """Append each row's token; deliver rows that finished; return indices of rows still going."""
        keep = []
        for i, (req, tok, lp) in enumerate(zip(rows, tokens, logprobs, strict=True)):
            req.token_ids.append(tok)
            req.logprobs.append(lp)
            req.versions.append(version)
            if req.on_token is not None:
                req.on_token(tok, lp, version)
            if routes is not None:
                req.routes.append(routes[i])
            self.stats.new_tokens += 1
            if tok in req.stop_ids:
                self._finish(req, "stop")
            elif len(req.token_ids) >= req.params.max_new_tokens:
                self._finish(req, "length")
            elif not req.cancelled:
                keep.append(i)
        return keep

    def _finish(self, req: Request, reason: str) -> None:
        """Deliver ``req``: its policy version is that of its first token (versions only rise), and the
        per-token versions come along only when it was resumed on new weights mid-generation."""
        req.done = True
        self.stats.sequences += 1
        routed = stack_routes(req.routes) if req.routes else None
        spans = req.versions[0] != req.versions[-1]
        req.deliver(Generation(tuple(req.token_ids), tuple(req.logprobs), reason, req.versions[0], routed,
                               token_versions=tuple(req.versions) if spans else ()))


def _fail_unfinished(reqs: list[Request], error: EngineError) -> None:
    """Deliver ``error`` to every request of a failed batch that has not been answered yet."""
    for req in reqs:
        if not req.done:
            req.done = True
            req.deliver(error)
