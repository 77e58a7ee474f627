"""Local OpenEnv servers for :mod:`relax_agent.envs.bridges.openenv`: one uvicorn process per target,
shared by every env object of this process that names it, and always stopped.

A target is ``"<module>:<attr>"``: a FastAPI app (``create_app(...)``) or an ``Environment``
subclass, which the server wraps with openenv-core's own ``create_app`` (its Action and Observation
classes are read from ``step``'s type hints, else from ``Environment[Action, Observation, State]``).
An installed environment package ``openenv-<name>`` is the target ``"<name>.server.app:app"``.

Life cycle of a server (:class:`LocalServer`):

* started on the first :func:`acquire` of its target: this process binds a free port on 127.0.0.1
  and hands the listening socket to a ``python -c`` child (:data:`BOOTSTRAP`), so no other program
  can take the port in between; ready when ``GET /health`` answers, within ``start_timeout_s``;
* shared: every env object that acquired it holds one reference until it calls :func:`release`;
* stopped (SIGTERM to its process group, SIGKILL after 5 s) when the last reference is released and
  ``keep_alive_s`` is 0; with ``keep_alive_s > 0`` an unused server waits that long for the next
  episode: this process tells it ``busy`` / ``idle`` on its stdin, and it exits by itself once it
  has been idle, with no session open, for ``keep_alive_s`` + :data:`GRACE_S` seconds (this process
  replaces a server idle for ``keep_alive_s`` instead of reusing it, so it never connects to one that
  is quitting); a held server never times out;
* at interpreter exit every server this process started is stopped (``atexit``); when this process
  dies without running it (SIGKILL, ``os._exit``), the server reads the end of its stdin (or sees
  its parent change) and exits at once.

The server's stdout and stderr go to an unlinked temporary file (nothing is left on disk, even
after a crash); its tail is quoted in the error when the server fails to start.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from relax_agent.errors import ConfigError, EnvError

GRACE_S = 10.0
"""Seconds a server with no open session outlives ``keep_alive_s`` before it exits by itself."""

LOG_TAIL_BYTES = 4000
"""How much of a failed server's output an error quotes."""

BOOTSTRAP = r'''
import asyncio, importlib, inspect, os, socket, sys, threading, time, typing, warnings
warnings.resetwarnings()  # a foreign server's warnings go to its log, whatever the parent's filters
fd, target, idle_exit, parent, max_sessions = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
activity = {"busy": True, "since": time.monotonic(), "open": 0}

def read_parent():  # "busy" / "idle" from the parent; end of input: the parent is gone or stops us
    for line in sys.stdin:
        activity["busy"] = line.strip() == "busy"
        activity["since"] = time.monotonic()
    os._exit(0)

def watch_parent():  # a parent killed while a forked child of it still holds our stdin open
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)

threading.Thread(target=read_parent, name="relax-parent-pipe", daemon=True).start()
threading.Thread(target=watch_parent, name="relax-parent-watch", daemon=True).start()
sock = socket.socket(fileno=fd)
module, _, attr = target.rpartition(":")
obj = getattr(importlib.import_module(module), attr)
from openenv.core.env_server.interfaces import Environment
if isinstance(obj, type) and issubclass(obj, Environment):
    try:
        hints = typing.get_type_hints(obj.step)
    except Exception:
        hints = {}
    act, obs = hints.get("action"), hints.get("return")
    if act is None or obs is None:
        for base in getattr(obj, "__orig_bases__", ()):
            args = typing.get_args(base)
            if len(args) >= 2:
                act, obs = args[0], args[1]
    if not (isinstance(act, type) and isinstance(obs, type)):
        sys.exit(f"{target}: cannot tell the Action and Observation classes of {obj.__name__}: annotate "
                 "step(self, action: MyAction, ...) -> MyObservation or subclass Environment[MyAction, MyObservation, State]")
    from openenv.core.env_server.http_server import create_app
    sessions = max_sessions if getattr(obj, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
    app = create_app(obj, act, obs, env_name=obj.__name__, max_concurrent_envs=sessions)
elif inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(getattr(type(obj), "__call__", None)):
    app = obj  # an ASGI app: create_app(...)'s FastAPI app, or the user's own
else:
    sys.exit(f"{target}: expected a FastAPI app or an openenv Environment subclass, got {type(obj).__name__}")

async def tracked(scope, receive, send):
    if scope["type"] != "websocket":
        return await app(scope, receive, send)
    activity["open"] += 1
    try:
        await app(scope, receive, send)
    finally:
        activity["open"] -= 1
        activity["since"] = max(activity["since"], time.monotonic())

import uvicorn, uvicorn.config
ws = "websockets-sansio" if "websockets-sansio" in uvicorn.config.WS_PROTOCOLS else "auto"
server = uvicorn.Server(uvicorn.Config(tracked, log_level="warning", ws=ws))

async def main():
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not serving.done():
        await asyncio.sleep(0.5)
        idle = not activity["busy"] and activity["open"] == 0
        if idle and time.monotonic() - activity["since"] > idle_exit:
            server.should_exit = True
    await serving

asyncio.run(main())
'''
"""The server process's program (``python -c BOOTSTRAP fd target idle_exit_s parent_pid max_sessions``).

It reads ``busy`` / ``idle`` lines on stdin from this process and exits by itself once it has been
idle, with no WebSocket open, for ``idle_exit_s``; at the end of stdin (this process died or stops
it) or when its parent changes, it exits at once."""


@dataclass
class LocalServer:
    """One local OpenEnv server process and the env objects using it.

    Attributes:
        target: ``"<module>:<attr>"`` it serves.
        max_sessions: concurrent sessions an ``Environment`` target is served with (when it
            declares ``SUPPORTS_CONCURRENT_SESSIONS``; else 1).
        keep_alive_s: seconds an unused server is kept for the next episode.
        url: ``http://127.0.0.1:<port>`` once started.
        proc: the server process (None when stopped).
        refs: env objects holding it.
    """

    target: str
    max_sessions: int
    keep_alive_s: float
    url: str = ""
    proc: subprocess.Popen | None = None
    refs: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    log_fd: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    starts: int = 0

    @property
    def pid(self) -> int | None:
        """The server process id while it runs."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def running(self) -> bool:
        """Whether the server process is alive."""
        return self.pid is not None

    def log_tail(self) -> str:
        """The last :data:`LOG_TAIL_BYTES` of the server's output."""
        if self.log_fd is None:
            return ""
        with contextlib.suppress(OSError):
            size = os.fstat(self.log_fd).st_size
            return os.pread(self.log_fd, LOG_TAIL_BYTES, max(0, size - LOG_TAIL_BYTES)).decode(errors="replace").strip()
        return ""

    def ensure(self, start_timeout_s: float, replace_idle: bool = False) -> str:
        """Start the server unless it runs.

        Args:
            start_timeout_s: bound on a start.
            replace_idle: replace a running server that nobody used for ``keep_alive_s`` (it may be
                about to exit by itself).

        Returns:
            its base URL.

        Raises:
            EnvError: it did not answer ``/health`` within ``start_timeout_s`` (its output quoted).
        """
        with self.lock:
            expired = replace_idle and time.monotonic() - self.idle_since >= self.keep_alive_s
            if self.running() and not expired:
                return self.url
            self._stop()
            self._start(start_timeout_s)
            return self.url

    def stop(self) -> None:
        """Stop the server process (its whole process group) and close its log; idempotent."""
        with self.lock:
            self._stop()

    def _start(self, start_timeout_s: float) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            port = sock.getsockname()[1]
            log = tempfile.TemporaryFile(prefix="relax-openenv-")
            self.log_fd = os.dup(log.fileno())
            log.close()
            flags = fcntl.fcntl(self.log_fd, fcntl.F_GETFL)
            fcntl.fcntl(self.log_fd, fcntl.F_SETFL, flags | os.O_APPEND)
            path = os.pathsep.join(dict.fromkeys([os.getcwd(), *(p for p in sys.path if p)]))
            env = {**os.environ, "PYTHONPATH": path}
            idle_exit = self.keep_alive_s + GRACE_S
            self.proc = subprocess.Popen(
                [sys.executable, "-c", BOOTSTRAP, str(sock.fileno()), self.target, str(idle_exit), str(os.getpid()),
                 str(self.max_sessions)],
                pass_fds=(sock.fileno(),), stdin=subprocess.PIPE, stdout=self.log_fd, stderr=self.log_fd,
                start_new_session=True, env=env, text=True)
        finally:
            sock.close()
        self.url = f"http://127.0.0.1:{port}"
        self.starts += 1
        _STARTED[id(self)] = (self, os.getpid())
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self._stop()
            raise

    def _wait_ready(self, start_timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + start_timeout_s
        last = "no answer yet"
        while True:
            assert self.proc is not None
            code = self.proc.poll()
            if code is not None:
                raise EnvError(f"the OpenEnv server for {self.target!r} exited with code {code} before it was ready; "
                               f"its output:\n{self.log_tail() or '(none)'}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise EnvError(f"the OpenEnv server for {self.target!r} at {self.url} did not answer GET /health within "
                               f"start_timeout_s={start_timeout_s} ({last}); its output:\n{self.log_tail() or '(none)'}")
            try:
                res = httpx.get(f"{self.url}/health", timeout=min(2.0, max(left, 0.1)), trust_env=False)
                if res.status_code == 200:
                    self.idle_since = time.monotonic()
                    return
                last = f"HTTP {res.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)

    def tell(self) -> None:
        """Tell the server whether it is held (``busy``) or not (``idle``: its keep-alive clock starts),
        as the reference count says at the time of writing (so concurrent calls end on the truth)."""
        with self.lock:
            proc = self.proc
            if proc is None or proc.stdin is None:
                return
            with contextlib.suppress(OSError, ValueError):  # it exited: the next ensure() restarts it
                proc.stdin.write("busy\n" if self.refs else "idle\n")
                proc.stdin.flush()

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError, ValueError):
                    proc.stdin.close()
            stop_process_group(proc)
        if self.log_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.log_fd)
            self.log_fd = None
        _STARTED.pop(id(self), None)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM ``proc``'s process group (it leads one), SIGKILL after ``grace_s``; reaps ``proc``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything the server started in its group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)


_POOL: dict[tuple[str, int, float], LocalServer] = {}
_POOL_LOCK = threading.Lock()
_STARTED: dict[int, tuple[LocalServer, int]] = {}


def acquire(target: str, *, max_sessions: int, keep_alive_s: float, start_timeout_s: float) -> LocalServer:
    """The running server of ``target`` (started when needed), with one more reference held.

    Raises:
        EnvError: the server did not start (see :meth:`LocalServer.ensure`); no reference is kept.
    """
    key = (target, max_sessions, keep_alive_s)
    with _POOL_LOCK:
        server = _POOL.setdefault(key, LocalServer(target, max_sessions, keep_alive_s))
        unused = server.refs == 0
        server.refs += 1
    try:
        server.ensure(start_timeout_s, replace_idle=unused)
    except BaseException:
        release(server)
        raise
    if unused:
        server.tell()
    return server


def release(server: LocalServer) -> None:
    """Drop one reference; the last one stops the server now when ``keep_alive_s`` is 0."""
    with _POOL_LOCK:
        server.refs = max(0, server.refs - 1)
        if server.refs:
            return
        server.idle_since = time.monotonic()
    if server.keep_alive_s <= 0:
        server.stop()
    else:
        server.tell()


def servers() -> list[LocalServer]:
    """The servers of this process (running or not)."""
    with _POOL_LOCK:
        return list(_POOL.values())


def stop_all() -> None:
    """Stop every server this process started (``atexit``; a forked child leaves its parent's alone)."""
    for server, owner in list(_STARTED.values()):
        if owner == os.getpid():
            server.stop()


atexit.register(stop_all)


def installed() -> dict[str, str]:
    """``{name: target}`` of the installed OpenEnv environment packages that ship a server app
    (a distribution ``openenv-<name>`` with ``<module>/server/app.py``), found without importing them."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").strip()
        if not name.lower().startswith("openenv-") or name.lower() in ("openenv-core", "openenv-cli"):
            continue
        module = re.sub(r"[-.]", "_", name[len("openenv-"):])
        files = {str(f).replace("\\", "/") for f in dist.files or ()}
        if f"{module}/server/app.py" in files:
            found[module.removesuffix("_env")] = f"{module}.server.app:app"
    return dict(sorted(found.items()))


def normalize_name(name: str) -> str:
    """An installed environment's name as :func:`installed` spells it (``echo-env`` -> ``echo``)."""
    return re.sub(r"[-_]env$", "", name.strip()).replace("-", "_")


def check_module(target: str) -> None:
    """Check that the module of ``"<module>:<attr>"`` can be found (from the working directory too),
    without importing it.

    Raises:
        ConfigError: malformed target or a module that cannot be found.
    """
    module, _, attr = target.rpartition(":")
    if not module or not attr.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
        raise ConfigError(f"openenv target {target!r}: expected '<module>:<app or Environment class>', "
                          "e.g. 'my_envs.guess:app'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        spec, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = "not found"
    if spec is None:
        raise ConfigError(f"openenv target {target!r}: module {module!r} is not importable ({why}; it must be importable from the "
                          f"working directory {os.getcwd()} or the installed packages)")


__all__ = ["BOOTSTRAP", "GRACE_S", "LocalServer", "acquire", "check_module", "installed", "normalize_name", "release",
           "servers", "stop_all", "stop_process_group"]
