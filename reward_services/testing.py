"""Helpers to run reward services in tests: a subprocess service and an in-thread server.

    with ServiceProcess("my_rewards.py:score", "--token-env", "TOKEN", env={"TOKEN": "t"}) as svc:
        client = RewardClient(svc.url, token="t")

Both bind 127.0.0.1 on a free port and wait for ``/healthz`` before returning.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

from relax_agent.errors import RewardServiceError
from relax_agent.reward_services.protocol import HEALTH_PATH


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float, alive: Any = None) -> None:
    """Poll ``url/healthz`` until it answers 200.

    Raises:
        RewardServiceError: ``alive()`` returned False, or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RewardServiceError(f"reward service for {url} exited during start-up")
        try:
            if httpx.get(url + HEALTH_PATH, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RewardServiceError(f"reward service at {url} not healthy after {timeout_s}s")


class ServiceProcess:
    """``relax-agent serve-reward TARGET ARGS...`` in a subprocess on 127.0.0.1.

    Args:
        target: the reward function (``module:function`` or ``file.py:function``).
        *args: more command-line options (``--token-env``, ``--timeout-s``...).
        port: fixed port (for restarts on the same address); default a free one.
        env: extra environment variables for the service.
        startup_timeout_s: how long :meth:`start` waits for ``/healthz``.
    """

    def __init__(self, target: str, *args: str, port: int | None = None, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 30.0):
        self.target, self.args = target, list(args)
        self.port = port or free_port()
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` of the service."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServiceProcess:
        """Start the process and wait until it is healthy.

        Raises:
            RewardServiceError: it exited or did not become healthy (its log is in the message).
        """
        cmd = [sys.executable, "-m", "relax_agent.cli", "serve-reward", self.target, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", *self.args]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, self.startup_timeout_s, alive=lambda: self.proc.poll() is None)
        except RewardServiceError as exc:
            self.kill()
            raise RewardServiceError(f"{exc}; output:\n{self.output()[-3000:]}") from None
        return self

    def output(self) -> str:
        """Everything the process wrote so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL (a crash: no graceful shutdown) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()


class ThreadServer:
    """Any ASGI app served by uvicorn in a background thread on 127.0.0.1 (a context manager)."""

    def __init__(self, app: Any, port: int | None = None):
        import uvicorn

        self.port = port or free_port()
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` of the server."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RewardServiceError(f"in-thread server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
