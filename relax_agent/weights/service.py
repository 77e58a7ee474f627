"""The coordinator as an HTTP service (FastAPI + uvicorn), and the client that talks to it.

Endpoints (JSON; every one needs ``Authorization: Bearer <token>``, else 401)::

    POST   /subscribers              {"name"}                 -> {"id"}
    GET    /subscribers/{id}                                  -> {"registered": bool}
    DELETE /subscribers/{id}
    POST   /versions                 VersionMeta              (header X-Relax-Publisher: the publisher's
                                                               fencing token, else 403; 409: not newer)
    GET    /versions/latest                                   -> VersionMeta | null
    GET    /versions/wait?after=&timeout_s=&subscriber=&epoch= -> VersionMeta | null (long poll)
    POST   /reports                  ApplyReport
    GET    /status                                            -> publisher, epoch, subscribers, latest version

Malformed requests (bad JSON, missing or mistyped fields, a NaN or negative ``timeout_s``) get
422 naming the problem. The token is shared by the publisher and its replicas (like
``serve-reward``'s): ``weights.service_token_env`` names the environment variable holding it;
without one the publisher makes a random token per run (``WeightSync.service_token``) for the
launcher to hand to the replicas.

Each waiting long poll holds one of the server's worker threads (anyio's default pool has
40), which bounds the replicas one service can hold in a long poll at once.

``HttpCoordinator`` implements the same methods as the in-process
:class:`~relax_agent.weights.coordinator.Coordinator`, so an ``EngineSubscriber`` in another
process uses it unchanged.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time
from dataclasses import asdict
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from relax_agent.errors import WeightSyncError
from relax_agent.weights.coordinator import ApplyReport, Coordinator, check_poll_timeout
from relax_agent.weights.meta import VersionMeta

_START_TIMEOUT_S = 15.0
_MAX_POLL_S = 120.0


class _Name(BaseModel):
    name: str


class _Report(BaseModel):
    subscriber: str
    version: int
    error: str | None = None
    stats: dict[str, float] = {}


def create_coordinator_app(coordinator: Coordinator, token: str, publisher_token: str | None = None) -> FastAPI:
    """A FastAPI app exposing ``coordinator`` (handlers are sync: long polls block a pool thread).

    Args:
        token: the bearer token every request must carry.
        publisher_token: the fencing token ``POST /versions`` must carry in ``X-Relax-Publisher``
            (None: the coordinator's registered publisher commits in-process only).

    Raises:
        WeightSyncError: an empty ``token``.
    """
    if not token:
        raise WeightSyncError("the weight coordinator service needs a non-empty bearer token")

    def auth(authorization: str | None = Header(default=None)) -> None:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token (weights.service_token_env)",
                                headers={"WWW-Authenticate": "Bearer"})

    app = FastAPI(title="relax-agent weight coordinator", dependencies=[Depends(auth)])

    @app.exception_handler(RequestValidationError)
    async def unprocessable(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": f"malformed request to {request.url.path}: {exc.errors()}"}, status_code=422)

    @app.post("/subscribers")
    def register(body: _Name) -> dict[str, str]:
        return {"id": coordinator.register_subscriber(body.name)}

    @app.get("/subscribers/{subscriber}")
    def registered(subscriber: str) -> dict[str, bool]:
        return {"registered": coordinator.is_registered(subscriber)}

    @app.delete("/subscribers/{subscriber}")
    def unregister(subscriber: str) -> dict[str, bool]:
        coordinator.unregister_subscriber(subscriber)
        return {"ok": True}

    @app.post("/versions")
    def commit(meta: dict[str, Any], x_relax_publisher: str | None = Header(default=None)) -> dict[str, int]:
        if publisher_token is None or not hmac.compare_digest((x_relax_publisher or "").encode(),
                                                              publisher_token.encode()):
            raise HTTPException(403, "only the registered publisher commits versions (X-Relax-Publisher)")
        try:
            parsed = VersionMeta.from_json(meta)
        except WeightSyncError as exc:
            raise HTTPException(422, str(exc)) from exc
        try:
            coordinator.commit(parsed, publisher=publisher_token)
        except WeightSyncError as exc:
            raise HTTPException(409, str(exc)) from exc
        return {"version": parsed.version}

    @app.get("/versions/latest")
    def latest() -> dict[str, Any] | None:
        meta = coordinator.latest()
        return None if meta is None else meta.to_json()

    @app.get("/versions/wait")
    def wait(after: int | None = None, timeout_s: float = 30.0, subscriber: str | None = None,
             epoch: str | None = None) -> dict[str, Any] | None:
        try:
            meta = coordinator.wait_for_version(after, min(check_poll_timeout(timeout_s), _MAX_POLL_S), subscriber, epoch)
        except WeightSyncError as exc:
            raise HTTPException(422, str(exc)) from exc
        if meta is None and coordinator.closed:  # the publisher is shutting down: replicas retry after a pause
            raise HTTPException(503, "the weight coordinator is closed (publisher shutting down)")
        return None if meta is None else meta.to_json()

    @app.post("/reports")
    def report(body: _Report) -> dict[str, bool]:
        coordinator.report(ApplyReport(body.subscriber, body.version, body.error, dict(body.stats)))
        return {"ok": True}

    @app.get("/status")
    def status() -> dict[str, Any]:
        return coordinator.describe()

    return app


class CoordinatorService:
    """A coordinator app served by uvicorn in a daemon thread; ``url`` and ``token`` once started."""

    def __init__(self, coordinator: Coordinator, host: str, port: int, token: str | None = None,
                 publisher_token: str | None = None) -> None:
        import uvicorn

        self.token = token or secrets.token_urlsafe(24)
        app = create_coordinator_app(coordinator, self.token, publisher_token)
        self._sock = socket.create_server((host, port))
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="weights-coordinator", daemon=True)

    def start(self) -> CoordinatorService:
        """Start serving; returns once the server accepts requests.

        Raises:
            WeightSyncError: it did not start within 15 s.
        """
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise WeightSyncError(f"weight coordinator service at {self.url} did not start")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        """Stop the server (waiting up to 10 s for its thread) and close its socket."""
        self._server.should_exit = True
        self._thread.join(10.0)
        self._sock.close()


def serve_coordinator(coordinator: Coordinator, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                      publisher_token: str | None = None) -> CoordinatorService:
    """Serve ``coordinator`` over HTTP on ``host:port`` (0: a free port); returns the running service.

    Args:
        token: bearer token clients must send (None: a random one, ``service.token``).
        publisher_token: fencing token that lets ``POST /versions`` commit (None: no HTTP commits).

    Raises:
        WeightSyncError: the port cannot be bound or the server did not start.
    """
    try:
        return CoordinatorService(coordinator, host, port, token, publisher_token).start()
    except OSError as exc:
        raise WeightSyncError(f"weight coordinator cannot listen on {host}:{port} (weights.service_port): {exc}") from exc


class HttpCoordinator:
    """Client of a :class:`CoordinatorService` with the in-process coordinator's methods.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8600``.
        timeout_s: per-request timeout (long polls add their own wait to it).
        transport: an ``httpx`` transport for tests.
        token: the service's bearer token (``WeightSync.service_token``).
        publisher_token: the publisher's fencing token, for :meth:`commit` only.

    Every method raises :class:`WeightSyncError` when the service cannot be reached or refuses.
    """

    def __init__(self, url: str, timeout_s: float = 10.0, transport: httpx.BaseTransport | None = None, *,
                 token: str | None = None, publisher_token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        if publisher_token is not None:
            headers["X-Relax-Publisher"] = publisher_token
        self._client = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport, headers=headers)

    def _call(self, method: str, path: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        try:
            resp = self._client.request(method, path, timeout=timeout_s or self._timeout_s, **kwargs)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"weight coordinator {self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400:
            raise WeightSyncError(f"weight coordinator {self.url}{path} answered {resp.status_code}: {resp.text}")
        return resp.json()

    def register_subscriber(self, name: str) -> str:
        """``POST /subscribers``: register a subscriber named ``name``; returns its id."""
        return self._call("POST", "/subscribers", json={"name": name})["id"]

    def unregister_subscriber(self, subscriber: str) -> None:
        """``DELETE /subscribers/<id>``: remove ``subscriber``."""
        self._call("DELETE", f"/subscribers/{quote(subscriber, safe='')}")

    def is_registered(self, subscriber: str) -> bool:
        """``GET /subscribers/<id>``: whether ``subscriber`` is registered (also a keep-alive)."""
        return bool(self._call("GET", f"/subscribers/{quote(subscriber, safe='')}")["registered"])

    def commit(self, meta: VersionMeta) -> None:
        """``POST /versions``: make ``meta`` the latest complete version."""
        self._call("POST", "/versions", json=meta.to_json())

    def latest(self) -> VersionMeta | None:
        """``GET /versions/latest``: the latest complete version (None before the first commit)."""
        data = self._call("GET", "/versions/latest")
        return None if data is None else VersionMeta.from_json(data)

    def wait_for_version(self, after: int | None, timeout_s: float, subscriber: str | None = None,
                         epoch: str | None = None) -> VersionMeta | None:
        """``GET /versions/wait``: long poll for a version newer than ``after`` (each request waits at most
        ``_MAX_POLL_S``; None when it ends without one, see :meth:`Coordinator.wait_for_version`)."""
        timeout_s = min(check_poll_timeout(timeout_s), _MAX_POLL_S)
        params: dict[str, Any] = {"timeout_s": timeout_s}
        if after is not None:
            params["after"] = after
        if subscriber is not None:
            params["subscriber"] = subscriber
        if epoch is not None:
            params["epoch"] = epoch
        data = self._call("GET", "/versions/wait", timeout_s=self._timeout_s + timeout_s, params=params)
        return None if data is None else VersionMeta.from_json(data)

    def report(self, report: ApplyReport) -> None:
        """``POST /reports``: record a subscriber's outcome for a version."""
        self._call("POST", "/reports", json=asdict(report))

    def status(self) -> dict[str, Any]:
        """``GET /status``: publisher, subscribers, latest version and last reports."""
        return self._call("GET", "/status")

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()
