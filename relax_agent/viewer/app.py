"""The viewer's web server: a FastAPI app over :class:`~relax_agent.viewer.data.RunReader` and the
static page (HTML/JS/CSS in ``static/``, no external assets).

Every request passes two checks first: on a loopback bind its ``Host`` header must name the bound
address or a loopback name (a page on another site that rebinds its DNS name to 127.0.0.1 cannot
read the run: 403), and, when a token is set, it must carry it (``Authorization: Bearer TOKEN``, the
``relax_view_token`` cookie, or ``?token=TOKEN``, which sets the cookie: 401 otherwise). An API
request that fails on the run's files answers 500 with what failed, which the page shows.

Routes: ``/`` the page; ``/static/*`` its assets; ``/curves.png`` the run's ``plots/curves.png``;
JSON under ``/api``: ``overview``, ``steps/{step}`` (filters as query parameters),
``steps/{step}/episode?sample=ID``, ``evals/{name}`` (filters, ``reason``). Unknown steps, samples
or evaluations answer 404 with the reason; a bad filter value 422.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from relax_agent.errors import ConfigError, DataError, RelaxError
from relax_agent.viewer.data import EpisodeFilter, RunReader

STATIC = Path(__file__).parent / "static"


class ViewerConfig(BaseModel):
    """Where the viewer reads and listens.

    Attributes:
        run_dir: the run's ``run.output_dir``.
        host: address to bind; a loopback one (127.0.0.0/8, ``localhost``) unless you mean to share
            the run with your network.
        port: TCP port; 0 picks a free one.
        tokenizer: shows token ids as text: a tokenizer folder or hub id; "auto" takes the run's
            latest checkpoint's (``checkpoints/step_N/model``); None shows ids only.
        token: a secret every request must carry (see the module docstring); None: none asked
            (keep ``host`` loopback then).
    """

    run_dir: Path
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    tokenizer: str | None = "auto"
    token: str | None = Field(None, min_length=16)


RUN_MARKERS = ("metrics.jsonl", "summary.json", "rollouts", "eval", "checkpoints", "plots", "tensorboard", "config.yaml")
"""What a run folder holds (any one of them, from the run's first seconds on)."""

TOKEN_COOKIE = "relax_view_token"


def host_allowed(host_header: str, bound: str) -> bool:
    """Whether a request's ``Host`` header names the bound address or a loopback name (any port)."""
    from relax_agent.netaddr import is_loopback

    name = host_header.strip()
    if name.startswith("["):  # [::1]:8000
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.lower().rstrip(".")
    return bool(name) and (name == bound.lower() or is_loopback(name))


def build_app(reader: RunReader, bound_host: str = "127.0.0.1", token: str | None = None) -> Any:
    """The FastAPI app serving ``reader``'s run (every request re-reads what changed on disk), with the
    ``Host`` check against a loopback ``bound_host`` and, when given, the ``token`` check (a viewer
    bound to another address is reached by any name: its token is what guards it)."""
    from fastapi import FastAPI, HTTPException, Query
    from fastapi.responses import FileResponse, JSONResponse
    from fastapi.staticfiles import StaticFiles

    from relax_agent.netaddr import is_loopback

    app = FastAPI(title=f"relax-agent view {reader.dir}", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.middleware("http")
    async def _guard(request: Any, call_next: Any) -> Any:
        host = request.headers.get("host", "")
        if is_loopback(bound_host) and not host_allowed(host, bound_host):
            return JSONResponse({"detail": f"Host {host!r} is not this viewer's address; open it at 127.0.0.1 "
                                           "(other names are refused against DNS rebinding)"}, status_code=403)
        given = request.query_params.get("token")
        if token is not None:
            auth = request.headers.get("authorization", "")
            sent = given or request.cookies.get(TOKEN_COOKIE) or (auth[7:] if auth.startswith("Bearer ") else "")
            if not hmac.compare_digest(sent.encode(), token.encode()):
                return JSONResponse({"detail": "this viewer needs its token: open the URL it printed "
                                               "(?token=...)"}, status_code=401)
        try:
            response = await call_next(request)
        except Exception as exc:  # noqa: BLE001 - a corrupt file of the run: said in the page, not a bare 500
            return JSONResponse({"detail": f"reading the run failed: {type(exc).__name__}: {exc}"}, status_code=500)
        if token is not None and given:
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(DataError)
    async def _not_found(_request: Any, exc: DataError) -> Any:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(ConfigError)
    async def _bad_value(_request: Any, exc: ConfigError) -> Any:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    def _filter(failed: bool | None, min_reward: float | None, max_reward: float | None,
                stop_reason: str | None, crossed: bool | None) -> EpisodeFilter:
        return EpisodeFilter(failed=failed, min_reward=min_reward, max_reward=max_reward,
                             stop_reason=stop_reason or None, crossed=crossed)

    @app.get("/", include_in_schema=False)
    def index() -> Any:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/curves.png", include_in_schema=False)
    def curves() -> Any:
        if not reader.curves_png.is_file():
            raise HTTPException(404, "no plots/curves.png yet (drawn at the end of the run and at each evaluation)")
        return FileResponse(reader.curves_png, headers={"Cache-Control": "no-store"})

    @app.get("/api/overview")
    def overview() -> Any:
        return reader.overview()

    @app.get("/api/steps/{step}")
    def step(step: int, failed: bool | None = None, min_reward: float | None = None,
             max_reward: float | None = None, stop_reason: str | None = None,
             crossed: bool | None = None) -> Any:
        return reader.step(step, _filter(failed, min_reward, max_reward, stop_reason, crossed))

    @app.get("/api/steps/{step}/episode")
    def episode(step: int, sample: str = Query(..., description="sample id, e.g. s3/g0/1")) -> Any:
        return reader.episode(step, sample)

    @app.get("/api/evals/{name}")
    def evals(name: str, failed: bool | None = None, min_reward: float | None = None,
              max_reward: float | None = None, stop_reason: str | None = None, reason: str = "") -> Any:
        return reader.eval_samples(name, _filter(failed, min_reward, max_reward, stop_reason, None), reason)

    return app


class ViewerServer:
    """The viewer served by uvicorn on a background thread (tests) or the calling thread (the CLI).

    Binds on construction, so :attr:`url` is known (``port=0`` resolved) before serving starts.

    Raises:
        ConfigError: the run folder does not exist or holds none of :data:`RUN_MARKERS`, or the
            address cannot be bound.
    """

    def __init__(self, cfg: ViewerConfig):
        import uvicorn

        self.cfg = cfg
        self.reader = RunReader(cfg.run_dir, cfg.tokenizer)
        if not any((self.reader.dir / name).exists() for name in RUN_MARKERS):
            raise ConfigError(f"{str(cfg.run_dir)!r} is not a run folder: it holds none of {list(RUN_MARKERS)}; "
                              "expected a run's run.output_dir")
        try:
            infos = socket.getaddrinfo(cfg.host, cfg.port, type=socket.SOCK_STREAM)
            family, _, _, _, addr = infos[0]
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(addr)
        except OSError as exc:
            raise ConfigError(f"viewer: cannot listen on {cfg.host}:{cfg.port}: {exc}; "
                              "expected a free port (0 picks one) on a local address") from exc
        host, self.port = self.sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/" + (f"?token={cfg.token}" if cfg.token else "")
        config = uvicorn.Config(build_app(self.reader, cfg.host, cfg.token), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        """Serve on this thread until Ctrl-C."""
        self.server.run(sockets=[self.sock])

    def start(self, timeout_s: float = 10.0) -> ViewerServer:
        """Serve on a daemon thread; returns once it accepts connections.

        Raises RelaxError when it has not started within ``timeout_s``."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                        name="relax-viewer", daemon=True)
        self._thread.start()
        import time

        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RelaxError(f"viewer: the server at {self.url} did not start within {timeout_s} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop a server started with :meth:`start` and close its socket."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> ViewerServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def build(cfg: ViewerConfig) -> ViewerServer:
    """A :class:`ViewerServer` for ``cfg``: bound (its :attr:`~ViewerServer.url` known), not yet serving.

    Raises ConfigError (see :class:`ViewerServer`)."""
    return ViewerServer(cfg)
