"""The engine thread: one ``vllm.LLMEngine`` (engine core in this process) stepped in a loop,
continuous batching over every request in flight. Everything that touches the engine (adding,
aborting, weight reloads, prefix-cache resets) is a command the thread runs *between* two steps,
so a weight update never lands inside a forward pass."""

import queue
import threading
import time
import traceback
from typing import Any

from route_capture import RouteCapture
from weight_check import VerificationError, served_mismatches, verify_tensors
from weight_reload import _prepack_cpu_experts_again, _tie_again, _tied_parameters
from work_items import _Load, _Req, _settle


class EngineLoop:
    """Owns the ``LLMEngine``; runs commands between steps (see the module docstring)."""

    def __init__(self, llm: Any, seed: int, batch_wait_s: float = 0.0, capture: RouteCapture | None = None) -> None:
        self.llm = llm
        self.capture = capture
        self.batch_wait_s = batch_wait_s
        self.version = 0
        self.seed = seed
        self.commands: queue.Queue = queue.Queue()
        self.running: dict[str, _Req] = {}
        """vLLM request id -> request, for requests added to the engine."""
        self.parked: list[_Req] = []
        """Requests waiting for a weight update to finish (new ones under finish_old, aborted
        ones under abort_resume)."""
        self.pending_load: _Load | None = None
        self.tied: list[list[str]] = []
        """Groups of parameter names that are one tensor, as of the last reload (a tied head)."""
        self.aborted_ids: dict[str, None] = {}
        """Client ids aborted before their request arrived (the abort overtook it): refused on arrival."""
        self.error: str | None = None
        self.stats: dict[str, Any] = {"steps": 0, "requests": 0, "new_tokens": 0, "prompt_tokens": 0,
                                      "cached_prompt_tokens": 0, "aborted": 0, "resumed": 0, "max_running": 0,
                                      "weight_loads": 0, "weight_load_s": 0.0, "last_load": {}}
        self.thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            while True:
                busy = self.llm.has_unfinished_requests()
                self._drain_commands(block=not busy)
                if self.pending_load is not None and (self.pending_load.policy == "abort_resume"
                                                      or not self.running):
                    self._apply_load(self.pending_load)
                    self.pending_load = None
                    for req in self.parked:
                        self._add(req)
                    self.parked = []
                if self.llm.has_unfinished_requests():
                    self._step()
        except BaseException as exc:  # the engine is unusable: fail everyone and say why
            self.error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            failure = RuntimeError(f"vLLM engine thread died: {self.error}")
            for req in [*self.running.values(), *self.parked]:
                _settle(req.loop, req.future, failure)
            if self.pending_load is not None:
                _settle(self.pending_load.loop, self.pending_load.future, failure)
            self._fail_commands(failure)

    def _fail_commands(self, failure: BaseException) -> None:
        while True:
            try:
                kind, item = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind in ("add", "load"):
                _settle(item.loop, item.future, failure)

    def _drain_commands(self, block: bool) -> None:
        """Run the queued commands. ``block`` (the engine is idle): wait for one, and after a first
        request wait up to ``batch_wait_s`` for more, so a burst starts as one batch."""
        try:
            kind, item = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        deadline = time.monotonic() + (self.batch_wait_s if block and kind == "add" else 0.0)
        while True:
            if kind == "add":
                self.stats["requests"] += 1
                if item.id in self.aborted_ids:
                    del self.aborted_ids[item.id]
                    self.stats["aborted"] += 1
                    _settle(item.loop, item.future, item.reply("abort"))
                elif self.pending_load is not None:
                    self.parked.append(item)
                else:
                    self._add(item)
            elif kind == "abort":
                self._abort(item)
            elif kind == "load":
                self._start_load(item)
            try:
                remaining_s = deadline - time.monotonic()
                kind, item = self.commands.get(timeout=remaining_s) if remaining_s > 0 else self.commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, req: _Req) -> None:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        remaining = req.max_tokens - len(req.token_ids)
        params = SamplingParams(max_tokens=remaining, logprobs=0, ignore_eos=True, detokenize=False,
                                skip_special_tokens=False, output_kind=RequestOutputKind.DELTA, **req.sampling)
        req.vllm_id = f"{req.id}#{req.attempt}"
        req.first_output = True
        engine_id = self.llm.add_request(req.vllm_id, TokensPrompt(prompt_token_ids=req.prompt_ids + req.token_ids),
                                         params)
        req.engine_id = engine_id if isinstance(engine_id, str) else None
        self.running[req.vllm_id] = req
        self.stats["max_running"] = max(self.stats["max_running"], len(self.running))

    def _abort(self, client_id: str) -> None:
        found = False
        for vid, req in list(self.running.items()):
            if req.id == client_id:
                self.llm.abort_request([vid])
                del self.running[vid]
                found = True
                self.stats["aborted"] += 1
                _settle(req.loop, req.future, req.reply("abort"))
        for req in [r for r in self.parked if r.id == client_id]:
            self.parked.remove(req)
            found = True
            self.stats["aborted"] += 1
            _settle(req.loop, req.future, req.reply("abort"))
        if not found:  # not arrived yet, or already finished: refuse it if it still comes
            self.aborted_ids[client_id] = None
            while len(self.aborted_ids) > 10_000:
                del self.aborted_ids[next(iter(self.aborted_ids))]

    def _start_load(self, load: _Load) -> None:
        if self.pending_load is not None:  # a newer version replaces one not applied yet
            _settle(self.pending_load.loop, self.pending_load.future,
                    RuntimeError(f"superseded by version {load.version} before it was applied"))
        self.pending_load = load

    def _step(self) -> None:
        if self.capture is not None:
            self.capture.start_step()
        outputs = self.llm.step()
        self.stats["steps"] += 1
        step_routes = None
        for out in outputs:
            req = self.running.get(out.request_id)
            if req is None:  # aborted between the step and now
                continue
            if req.first_output:
                req.first_output = False
                n_prompt = len(out.prompt_token_ids or ())
                cached = int(out.num_cached_tokens or 0)
                req.prompt_tokens += n_prompt
                req.cached_prompt_tokens += cached
                self.stats["prompt_tokens"] += n_prompt
                self.stats["cached_prompt_tokens"] += cached
            comp = out.outputs[0]
            new = list(comp.token_ids)
            if new and req.routes is not None:
                if len(new) != 1:
                    raise RuntimeError(f"request {req.vllm_id} sampled {len(new)} tokens in one step; routes "
                                       "are recorded for one token per request per step")
                assert self.capture is not None  # requests record routes only under --record-routes
                if step_routes is None:
                    step_routes = self.capture.step_routes()
                req.routes.append(step_routes[1][self.capture.row_of(req, step_routes[0])].copy())
            for i, tok in enumerate(new):
                req.token_ids.append(int(tok))
                req.logprobs.append(float(comp.logprobs[i][tok].logprob))
                req.token_versions.append(self.version)
            self.stats["new_tokens"] += len(new)
            if out.finished:
                del self.running[out.request_id]
                reason = comp.finish_reason if comp.finish_reason in ("stop", "length") else str(comp.finish_reason)
                _settle(req.loop, req.future, req.reply(reason))

    def _apply_load(self, load: _Load) -> None:
        start = time.perf_counter()
        try:
            tensors, read_s, verify_s = self._read(load)
        except VerificationError as exc:  # nothing was touched: the previous version keeps serving
            _settle(load.loop, load.future, exc)
            return
        aborted = 0
        if load.policy == "abort_resume":
            for vid, req in list(self.running.items()):
                self.llm.abort_request([vid])
                del self.running[vid]
                req.attempt += 1
                self.stats["resumed"] += 1
                self.parked.append(req)
                aborted += 1
        try:
            reload_s = self._reload(tensors)
        except Exception as exc:  # the old weights may be half replaced: nothing can be trusted now
            _settle(load.loop, load.future, RuntimeError(f"reload_weights from {load.path} failed: "
                                                         f"{type(exc).__name__}: {exc}"))
            raise
        served_s = time.perf_counter()
        served: tuple[int, int, list[str]] = (0, 0, [])
        if load.expected is not None:
            read = dict(tensors)
            served = self.llm.apply_model(lambda model: served_mismatches(model, read, self.tied, load.version))[0]
        served_s = time.perf_counter() - served_s
        if self.capture is not None:
            self.capture.bind()
        self.llm.reset_prefix_cache()
        if served[2]:
            self._restore(load, served[2])
            return
        self.version = load.version
        pause_s = time.perf_counter() - start
        self.stats["weight_loads"] += 1
        self.stats["weight_load_s"] += pause_s
        detail = {"version": load.version, "pause_s": pause_s, "read_s": read_s, "reload_s": reload_s,
                  "verify_s": verify_s, "verified": len(load.expected or ()), "served_verify_s": served_s,
                  "served_verified": served[0], "served_unverified": served[1], "aborted": aborted}
        self.stats["last_load"] = detail
        _settle(load.loop, load.future, detail)

    def _read(self, load: _Load) -> tuple[list, float, float]:
        """Read ``load.path`` (a safetensors file, memory-mapped) and verify the tensors in ``load.expected``
        as read, before any is loaded; (tensors, read_s, verify_s).

        Raises:
            VerificationError: a tensor differs from what the client sent (names it).
        """
        from safetensors import safe_open

        start = time.perf_counter()
        with safe_open(load.path, framework="pt", device="cpu") as f:
            tensors = [(name, f.get_tensor(name)) for name in f.keys()]
        read_s = time.perf_counter() - start
        if load.expected:
            verify_tensors(tensors, load.expected, load.version)
        return tensors, read_s, time.perf_counter() - start - read_s

    def _restore(self, load: _Load, differences: list[str]) -> None:
        """The engine serves ``load``'s version differently from its file: reload the file of the version
        served before (``load.previous``) and answer with the differences; without one, fail the engine.

        Raises:
            RuntimeError: no previous file, or reloading it failed (the engine thread dies: /health 500).
        """
        error = VerificationError(f"version {load.version}: the engine serves {len(differences)} tensor(s) other "
                                  f"than the version file it read; version {self.version} was reloaded and keeps "
                                  f"serving (weights.verify): " + "; ".join(differences[:20]))
        try:
            if load.previous is None:
                raise RuntimeError("no previous version file to reload")
            from safetensors import safe_open

            with safe_open(load.previous, framework="pt", device="cpu") as f:
                self._reload([(name, f.get_tensor(name)) for name in f.keys()])
            self.llm.reset_prefix_cache()
        except Exception as exc:
            _settle(load.loop, load.future, RuntimeError(f"{error}; reloading version {self.version} from "
                                                         f"{load.previous} failed: {type(exc).__name__}: {exc}"))
            raise
        _settle(load.loop, load.future, error)

    def _reload(self, tensors: list) -> float:
        """Reload ``tensors`` (checkpoint names) in place; returns the seconds it took."""
        start = time.perf_counter()
        loaded = {name for name, _ in tensors}
        tied = self.tied = self.llm.apply_model(_tied_parameters)[0]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors)})
        self.llm.apply_model(lambda model: _tie_again(model, tied, loaded))
        self.llm.apply_model(_prepack_cpu_experts_again)
        return time.perf_counter() - start
