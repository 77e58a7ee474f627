"""The server's HTTP API over the engine thread (FastAPI; served by uvicorn in ``__main__``).

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
"""

import asyncio
import os
from typing import Any

from engine_loop import EngineLoop
from weight_check import VerificationError
from work_items import POLICIES, _Load, _Req


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
