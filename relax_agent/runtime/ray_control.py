"""The controller's HTTP control endpoint (``runtime: ray``) and its client, ``relax-agent scale``.

Endpoints (JSON; every one needs ``Authorization: Bearer <token>``, else 401)::

    GET  /status                       -> the supervisor's status: target, replicas, restarts, events
                                          (details carry root causes), trainer (heartbeat, the call in
                                          flight, hangs), fatal (the role death ending the run, or null)
    POST /scale   {"rollout": N}       -> set the rollout replicas (422 naming the value when invalid)

While the run lives, ``run.output_dir/runtime.json`` (mode 0600) holds the endpoint's URL and token;
:func:`scale_run` reads it, so ``relax-agent scale RUN_DIR --rollout N`` needs neither Ray nor the token.

Each connection holds one thread of the driver: a connection idle for ``idle_timeout_s`` (10 s) is
closed, a connection still open ``request_timeout_s`` (15 s) after it was accepted is cut (a client
trickling one byte every few seconds never goes idle), and beyond ``max_connections`` (16) open at
once a new one is answered 503 and closed, so idle, slow or unauthenticated clients cannot pile up
threads or keep the owner out for longer than ``request_timeout_s``; :func:`scale_run` retries a 503
until its own timeout.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from relax_agent.errors import ConfigError

RUNTIME_FILE = "runtime.json"
"""In ``run.output_dir``: the control endpoint's URL and bearer token (mode 0600), while the run lives."""


_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _CappedServer(ThreadingHTTPServer):
    """A threading HTTP server that serves at most ``max_connections`` connections at once (a
    connection beyond them gets 503 and is closed at once)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int,
                 request_timeout_s: float = 15.0) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self.request_timeout_s = request_timeout_s

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        deadline = threading.Timer(self.request_timeout_s, _cut, args=(request,))
        deadline.daemon = True
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._slots.release()


def _cut(request: socket.socket) -> None:
    """End a connection past its deadline: its blocked read returns, its thread ends, its slot frees."""
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class ControlServer:
    """Serves ``supervisor``'s status and scaling on ``host:port`` (port 0: a free one) in a daemon
    thread, and writes ``run_dir/runtime.json``; :meth:`close` stops it and removes the file.

    Args:
        idle_timeout_s: a connection that sends nothing for this long is closed.
        request_timeout_s: a connection still open this long after it was accepted is cut.
        max_connections: connections served at once; one more is answered 503 and closed.
        advertise: the host written into the URL in ``runtime.json`` (None: ``host``; the driver's node
            address when ``host`` binds every interface).

    Raises:
        ConfigError: ``host:port`` cannot be bound (names ``runtime.control_host`` / ``runtime.control_port``).
    """

    def __init__(self, supervisor: Any, run_dir: str | Path, host: str = "127.0.0.1", port: int = 0, *,
                 idle_timeout_s: float = 10.0, request_timeout_s: float = 15.0, max_connections: int = 16,
                 advertise: str | None = None) -> None:
        self.token = secrets.token_urlsafe(24)
        self.path = Path(run_dir) / RUNTIME_FILE
        try:
            self._server = _CappedServer((host, port), _handler(supervisor, self.token, idle_timeout_s),
                                         max_connections, request_timeout_s)
        except OSError as exc:
            raise ConfigError(f"the control endpoint cannot listen on {host}:{port} (runtime.control_host / "
                              f"runtime.control_port): {exc}") from exc
        self.url = f"http://{advertise or host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="relax-control", daemon=True)
        self._thread.start()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.url, "token": self.token, "pid": os.getpid()}, f)

    def close(self) -> None:
        """Stop serving and remove the address file."""
        self._server.shutdown()
        self._server.server_close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def _handler(supervisor: Any, token: str, idle_timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = idle_timeout_s  # socket timeout: an idle connection ends (and frees its thread)

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _send(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "")
            if secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return True
            self._send(401, {"detail": "missing or wrong bearer token (see run.output_dir/runtime.json)"})
            return False

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path != "/status":
                return self._send(404, {"detail": f"unknown path {self.path}; expected /status or /scale"})
            self._send(200, supervisor.status())

        def do_POST(self) -> None:
            if not self._authorized():
                return
            if self.path != "/scale":
                return self._send(404, {"detail": f"unknown path {self.path}; expected /status or /scale"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0") or 0)) or b"{}")
                self._send(200, supervisor.scale(body.get("rollout") if isinstance(body, dict) else None))
            except (ConfigError, ValueError) as exc:
                self._send(422, {"detail": str(exc)})

    return Handler


def scale_run(run_dir: str | Path, rollout: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """Ask the running controller of ``run_dir`` for ``rollout`` replicas; returns its status.

    A 503 (every connection slot taken) is retried with back-off until ``timeout_s`` has passed.

    Raises:
        ConfigError: no ``runtime.json`` in ``run_dir`` (not a live ``runtime: ray`` run), nothing
            answers at its URL (the run ended), the controller stayed busy for ``timeout_s``, or it
            refused the value.
    """
    import httpx

    path = Path(run_dir) / RUNTIME_FILE
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: {run_dir} is not the run.output_dir of a running training "
                          "with runtime.kind=ray (and runtime.control_port set)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read ({exc}); is it a runtime: ray run folder?") from exc
    deadline, wait_s = time.monotonic() + timeout_s, 0.1
    while True:
        try:
            resp = httpx.post(f"{info['url']}/scale", json={"rollout": rollout}, timeout=timeout_s,
                              headers={"Authorization": f"Bearer {info['token']}"})
        except httpx.HTTPError as exc:
            raise ConfigError(f"the controller of {run_dir} does not answer at {info['url']} "
                              f"({type(exc).__name__}); the run has ended? ({path} is left from it)") from exc
        if resp.status_code != 503 or time.monotonic() + wait_s > deadline:
            break
        time.sleep(wait_s)
        wait_s = min(2 * wait_s, 2.0)
    body = _json_or_none(resp)
    if resp.status_code != 200 or not isinstance(body, dict):
        detail = body.get("detail") if isinstance(body, dict) else resp.text.strip() or "(no body)"
        busy = " (every connection slot stayed taken)" if resp.status_code == 503 else ""
        raise ConfigError(f"the controller of {run_dir} refused the request: HTTP {resp.status_code}{busy} {detail}")
    return body


def _json_or_none(resp: Any) -> Any:
    """The response's JSON body, or None when it has none (a 503 has an empty body)."""
    try:
        return resp.json()
    except ValueError:
        return None
