"""HTTP reward service: a FastAPI app around any :class:`RewardFunction`, run by uvicorn.

Routes: ``POST /v1/reward`` (bearer token when one is set), ``GET /healthz`` (open),
``GET /openapi.json`` and ``/docs``. A malformed request is answered 422 with the standard
FastAPI ``detail`` list plus a one-line ``message`` naming the bad field
(``"items.0.id: Field required"``); a body over ``max_body_bytes`` is answered 413 before it
is read in full. ``/healthz`` answers 503 with the reason while the reward reports that it
cannot take work (its ``health()``: e.g. every slot held by a hung call).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from relax_agent.errors import ConfigError
from relax_agent.reward_services.local import LocalReward, resolve_target
from relax_agent.reward_services.protocol import (
    API_VERSION,
    HEALTH_PATH,
    REWARD_PATH,
    HealthResponse,
    ReportsHealth,
    RewardFunction,
    RewardRequest,
    RewardResponse,
    RewardResult,
    RewardStatus,
)

log = logging.getLogger("relax_agent.reward_services")

DEFAULT_MAX_ITEMS = 4096
"""Most items one request may carry."""
DEFAULT_MAX_BODY_BYTES = 64 * 2**20
"""Largest request body accepted, bytes (64 MiB)."""


def create_app(reward: RewardFunction, *, token: str | None = None, max_items: int = DEFAULT_MAX_ITEMS,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, title: str = "relax-agent reward service") -> FastAPI:
    """The FastAPI app serving ``reward``.

    Args:
        reward: scores the items; closed when the app shuts down. If it has a ``health()``
            method (as :class:`LocalReward` does), a non-None answer makes ``/healthz`` 503.
        token: bearer token required on ``POST /v1/reward``; None serves without auth.
        max_items: requests with more items are refused with 422 naming ``items``.
        max_body_bytes: larger request bodies are refused with 413.

    Raises:
        ConfigError: ``max_items`` or ``max_body_bytes`` below 1.
    """
    if max_items < 1 or max_body_bytes < 1:
        raise ConfigError(f"max_items and max_body_bytes must be >= 1, got {max_items}, {max_body_bytes}")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await reward.aclose()

    app = FastAPI(title=title, version=API_VERSION, lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    auth = _bearer_auth(token)
    health = reward.health if isinstance(reward, ReportsHealth) else None

    @app.get(HEALTH_PATH, response_model=HealthResponse, responses={503: {"description": "cannot take work now"}})
    async def healthz() -> Any:
        """Answers without auth: 200 while the service can take requests, 503 with the reason when not."""
        problem = health() if health is not None else None
        if problem:
            return JSONResponse(status_code=503, content={"status": "unavailable", "api_version": API_VERSION,
                                                          "message": problem})
        return HealthResponse()

    @app.post(REWARD_PATH, response_model=RewardResponse, dependencies=[Depends(auth)],
              responses={401: {"description": "missing or wrong bearer token"},
                         422: {"description": "malformed request; `message` names the field"}})
    async def score(request: RewardRequest) -> RewardResponse:
        """Score a batch: one result per item, in item order. Empty ``items`` is an authenticated no-op."""
        if len(request.items) > max_items:
            raise _field_error(("body", "items"), f"at most {max_items} items per request, got {len(request.items)}")
        results = await reward.score(request.items)
        return RewardResponse(results=_aligned(request, results))

    return app


def _aligned(request: RewardRequest, results: list[RewardResult]) -> list[RewardResult]:
    """Results in item order; an item the reward function skipped, or answered more than once,
    becomes an error result (results for ids not asked for are dropped)."""
    by_id: dict[str, RewardResult] = {}
    twice: set[str] = set()
    for r in results:
        if r.id in by_id:
            twice.add(r.id)
        by_id[r.id] = r
    if twice:
        log.warning("reward function returned more than one result for ids %s", sorted(twice)[:10])
    out = []
    for i in request.items:
        if i.id in twice:
            out.append(RewardResult.failed(i.id, RewardStatus.ERROR, "reward function returned more than one result "
                                                                     "for this id"))
        else:
            out.append(by_id.get(i.id) or RewardResult.failed(i.id, RewardStatus.ERROR,
                                                              "reward function returned no result for this id"))
    return out


class BodyLimit:
    """ASGI middleware: refuse HTTP request bodies over ``max_bytes`` with 413.

    A declared ``Content-Length`` over the limit is refused before the body is read; a body
    without one (chunked) is counted as it arrives: once it passes the limit the 413 is sent
    and the app is told the client disconnected (whatever it answers then is dropped).
    """

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Pass non-HTTP scopes through; refuse an HTTP request with 413 when its declared length, or
        the body it streams, exceeds ``max_bytes``."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, int(declared))
            return
        received, started, over, refused = 0, False, False, False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received, over, refused
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    if not started:
                        refused = True
                        await self._refuse(send, received)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out already
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _refuse(self, send: Any, size: int) -> None:
        message = f"request body of {size}+ bytes is over the limit of {self.max_bytes} bytes (--max-body-bytes)"
        body = json.dumps({"detail": message, "message": message}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _bearer_auth(token: str | None) -> Any:
    scheme = HTTPBearer(auto_error=False, description="Token from the server's --token-env variable")

    async def check(creds: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:
        if token is None:
            return
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    return check


def _field_error(loc: tuple[str, ...], msg: str) -> RequestValidationError:
    return RequestValidationError([{"loc": loc, "msg": msg, "type": "value_error"}])


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    lines = []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        lines.append(f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}")
    detail = json.loads(json.dumps(errors, default=str))
    return JSONResponse(status_code=422, content={"detail": detail, "message": "; ".join(lines)})


# Environment variables that carry the serve options into uvicorn worker processes.
_ENV_TARGET = "RELAX_REWARD_TARGET"
_ENV_OPTIONS = "RELAX_REWARD_OPTIONS"


def app_from_env() -> FastAPI:
    """uvicorn factory: the app described by ``RELAX_REWARD_TARGET`` / ``RELAX_REWARD_OPTIONS``.

    Each uvicorn worker process calls this once, so each loads the user's function itself.
    """
    target = os.environ.get(_ENV_TARGET)
    if not target:
        raise ConfigError(f"{_ENV_TARGET} is not set; start the service with `relax-agent serve-reward`")
    opts = json.loads(os.environ.get(_ENV_OPTIONS, "{}"))
    token = read_token(opts["token_env"]) if opts.get("token_env") else None
    reward = LocalReward.from_target(target, opts.get("kwargs"), timeout_s=opts["timeout_s"],
                                     max_concurrency=opts["max_concurrency"])
    return create_app(reward, token=token, max_items=opts["max_items"],
                      max_body_bytes=opts.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES), title=f"reward service: {target}")


def read_token(token_env: str) -> str:
    """The bearer token held in environment variable ``token_env``.

    Raises:
        ConfigError: the variable is unset or empty.
    """
    value = os.environ.get(token_env, "")
    if not value:
        raise ConfigError(f"environment variable {token_env!r} (the bearer token) is unset or empty")
    return value


def serve(target: str, *, host: str = "127.0.0.1", port: int = 8001, workers: int = 1, token_env: str | None = None,
          timeout_s: float = 30.0, max_concurrency: int = 64, max_items: int = DEFAULT_MAX_ITEMS,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, kwargs: dict[str, Any] | None = None,
          log_level: str = "info") -> None:
    """Serve ``target`` over HTTP with uvicorn until interrupted (blocks).

    The function is loaded once here first, so a bad target fails before any port is bound.

    Raises:
        ConfigError: bad target, missing token variable, or bad option values.
    """
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    target = resolve_target(target)
    opts = {"token_env": token_env, "timeout_s": timeout_s, "max_concurrency": max_concurrency,
            "max_items": max_items, "max_body_bytes": max_body_bytes, "kwargs": kwargs}
    os.environ[_ENV_TARGET] = target
    os.environ[_ENV_OPTIONS] = json.dumps(opts)
    app_from_env()  # fail fast, in this process, on a bad target or missing token
    if token_env is None and not _is_loopback(host):
        log.warning("serving on %s without a bearer token: pass --token-env NAME", host)
    import uvicorn

    uvicorn.run("relax_agent.reward_services.server:app_from_env", factory=True, host=host, port=port,
                workers=workers, log_level=log_level, timeout_graceful_shutdown=5)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
