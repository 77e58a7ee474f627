"""HTTP reward service: a FastAPI app around any :class:`RewardFunction`, run by uvicorn.

Routes: ``POST /v1/reward`` (bearer token when one is set), ``GET /healthz`` (open),
``GET /openapi.json`` and ``/docs``. A malformed request is answered 422 with the standard
FastAPI ``detail`` list plus a one-line ``message`` naming the bad field
(``"items.0.id: Field required"``).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

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
    RewardFunction,
    RewardRequest,
    RewardResponse,
    RewardResult,
    RewardStatus,
)

log = logging.getLogger("relax_agent.reward_services")

DEFAULT_MAX_ITEMS = 4096
"""Most items one request may carry."""


def create_app(reward: RewardFunction, *, token: str | None = None, max_items: int = DEFAULT_MAX_ITEMS,
               title: str = "relax-agent reward service") -> FastAPI:
    """The FastAPI app serving ``reward``.

    Args:
        reward: scores the items; closed when the app shuts down.
        token: bearer token required on ``POST /v1/reward``; None serves without auth.
        max_items: requests with more items are refused with 422 naming ``items``.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await reward.aclose()

    app = FastAPI(title=title, version=API_VERSION, lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _validation_error)
    auth = _bearer_auth(token)

    @app.get(HEALTH_PATH, response_model=HealthResponse)
    async def healthz() -> HealthResponse:
        """Liveness: answers without auth as soon as the service can take requests."""
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
    """Results in item order; an item the reward function skipped becomes an error result."""
    by_id = {r.id: r for r in results}
    missing = RewardStatus.ERROR
    return [by_id.get(i.id) or RewardResult.failed(i.id, missing, "reward function returned no result for this id")
            for i in request.items]


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
    return create_app(reward, token=token, max_items=opts["max_items"], title=f"reward service: {target}")


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
          kwargs: dict[str, Any] | None = None, log_level: str = "info") -> None:
    """Serve ``target`` over HTTP with uvicorn until interrupted (blocks).

    The function is loaded once here first, so a bad target fails before any port is bound.

    Raises:
        ConfigError: bad target, missing token variable, or bad option values.
    """
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    target = resolve_target(target)
    opts = {"token_env": token_env, "timeout_s": timeout_s, "max_concurrency": max_concurrency,
            "max_items": max_items, "kwargs": kwargs}
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
