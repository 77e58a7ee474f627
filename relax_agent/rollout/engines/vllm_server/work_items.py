"""Work the HTTP handlers hand to the engine thread: a generation request, a weight load, and how
the thread settles the handler's future from its own thread."""

import asyncio
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("abort_resume", "finish_old")
"""What a weight load does with requests in flight (see ``http_api``'s ``POST /load_weights``)."""


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


def _settle(req_loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value: Any) -> None:
    def set_it() -> None:
        if fut.done():
            return
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)

    req_loop.call_soon_threadsafe(set_it)
