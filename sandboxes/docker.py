"""Docker sandboxes (docker-py): one container per sandbox, limits on by default.

Each container runs ``sleep TTL`` under ``docker-init`` as uid 65533 (the *keeper*) with
``--rm``; commands run through ``docker exec`` as ``config.user`` (default 65534, nobody),
which cannot signal the keeper. Defaults: ``network_mode="none"``, memory == memory + swap,
CPU quota, pids limit, ``nofile`` ulimit, read-only root with tmpfs ``workdir`` and ``/tmp``,
``cap_drop=ALL``, ``no-new-privileges``, labels for the reaper (:mod:`.reaper`).

Every exec runs under a small launcher shell (:data:`~relax_agent.sandboxes.docker_scripts.LAUNCHER`; one more process per exec
counts against ``pids_limit``): it checks ``cwd``, runs the command under ``timeout -s KILL`` in
its own process group and, when the command ends for any reason, kills that group, every
process carrying the exec's marker variable and every process still holding the exec's output,
so nothing an exec started outlives it (a detached fork bomb, a daemon that left the group).
Timeouts are enforced inside first; ``kill_grace_s`` later the host kills the exec's marked
processes (as on cancellation); if the output stream is still open ``kill_grace_s`` after that
kill has *finished*, the container is removed and the sandbox marked broken. Only that exec
gets a result then; other execs in flight, and execs in flight when the sandbox is closed or
its container disappears, raise SandboxError naming why. Stdin is fed from the same thread
that reads output (poll on the exec's socket), so stdin of any size streams while output
drains. Output is read from the exec's raw socket as it streams (``demux`` buffering is
avoided), ``max_output_bytes`` per stream is kept and a command producing more than
``max_drain_bytes`` is killed. ``oom_killed`` comes from the container's memory cgroup
(``oom_kill`` counter; on cgroup v1 Docker's ``State.OOMKilled`` only covers the main process,
measured with Docker 20.10).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from relax_agent.errors import SandboxError
from relax_agent.sandboxes import reaper
from relax_agent.sandboxes.base import EXEC_MARKER_ENV, BaseSandbox, RawResult, check_launch, launch_tag
from relax_agent.sandboxes.config import SandboxConfig
from relax_agent.sandboxes.docker_scripts import KILL_MARKED, LAUNCHER, OOM_PROBE, timeout_arg
from relax_agent.sandboxes.limits import OutputCap

T = TypeVar("T")
KEEPER_USER = "65533:65533"
"""uid:gid of the container's main process (``sleep TTL``); must differ from ``config.user``."""
_shared_lock = threading.Lock()
_shared: dict[str | None, tuple[Any, ThreadPoolExecutor]] = {}
_started: set[str | None] = set()


def _transport_errors() -> tuple[type[Exception], ...]:
    """Exceptions meaning "the daemon failed or is unreachable" (docker-py's and requests')."""
    import docker.errors
    import requests

    return docker.errors.DockerException, requests.exceptions.RequestException


def docker_client(config: SandboxConfig) -> tuple[Any, ThreadPoolExecutor]:
    """The process-wide Docker client and worker threads for ``config.docker_host``.

    The client's connection pool and the executor are both sized ``config.max_workers`` (the
    first config seen for a daemon decides).

    Raises:
        SandboxError: the daemon cannot be reached.
    """
    import docker
    import docker.errors

    with _shared_lock:
        if config.docker_host not in _shared:
            kwargs: dict[str, Any] = {"max_pool_size": config.max_workers, "timeout": 120}
            try:
                if config.docker_host:
                    client = docker.DockerClient(base_url=config.docker_host, **kwargs)
                else:
                    client = docker.from_env(**kwargs)
                client.ping()
            except docker.errors.DockerException as exc:
                where = config.docker_host or "DOCKER_HOST or /var/run/docker.sock"
                raise SandboxError(
                    f"Docker daemon not reachable at {where} ({exc}); start it with scripts/setup_docker.sh "
                    "or choose sandbox.backend: bubblewrap"
                ) from exc
            pool = ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="relax-docker")
            _shared[config.docker_host] = (client, pool)
        return _shared[config.docker_host]


async def in_thread(executor: ThreadPoolExecutor, fn: Callable[[], T], on_abandon: Callable[[T], None] | None = None) -> T:
    """Run blocking ``fn`` on ``executor``; if the caller is cancelled, wait for ``fn`` to finish
    and pass its result to ``on_abandon`` (e.g. remove a container created meanwhile)."""
    fut = asyncio.get_running_loop().run_in_executor(executor, fn)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if on_abandon is not None:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or on_abandon(f.result()))
        raise


class DockerBackend:
    """Creates :class:`DockerSandbox` containers from one :class:`SandboxConfig`."""

    def __init__(self, config: SandboxConfig):
        if config.user == KEEPER_USER:
            raise SandboxError(f"sandbox.user={config.user!r} must differ from the keeper user {KEEPER_USER}")
        self.config = config
        self.run_id = config.run_id or reaper.default_run_id()

    def _start_once(self, client: Any) -> None:
        import docker.errors

        with _shared_lock:
            if self.config.docker_host in _started:
                return
            _started.add(self.config.docker_host)
        reaper.register_cleanup(f"docker-reap-own:{self.config.docker_host}", lambda: reaper.reap_own(client))
        try:
            if self.config.reap_on_start:
                reaper.reap(client)
            client.images.get(self.config.image)
        except docker.errors.ImageNotFound:
            with _shared_lock:
                _started.discard(self.config.docker_host)
            raise SandboxError(
                f"sandbox image {self.config.image!r} not found; build it with `relax-agent sandbox build-image "
                f"--image {self.config.image}`"
            ) from None
        except _transport_errors() as exc:
            with _shared_lock:
                _started.discard(self.config.docker_host)
            raise SandboxError(f"Docker daemon failed while starting up sandboxes: {exc}") from exc

    def container_kwargs(self, name: str, now: float) -> dict[str, Any]:
        """Keyword arguments of ``containers.create`` for one sandbox (limits, labels, mounts)."""
        import docker.types

        cfg = self.config
        uid, gid = cfg.uid_gid
        ttl = max(1, int(cfg.ttl_s))
        return dict(
            image=cfg.image, command=["sleep", str(ttl)], name=name, hostname="sandbox",
            detach=True, init=True, auto_remove=True, network_mode="none",
            mem_limit=f"{cfg.memory_mb}m", memswap_limit=f"{cfg.memory_mb}m", shm_size=f"{cfg.tmp_mb}m",
            nano_cpus=int(cfg.cpus * 1e9), pids_limit=cfg.pids_limit,
            ulimits=[docker.types.Ulimit(name="nofile", soft=cfg.nofile, hard=cfg.nofile)],
            read_only=True,
            tmpfs={cfg.workdir: f"size={cfg.workdir_mb}m,uid={uid},gid={gid},mode=0700",
                   "/tmp": f"size={cfg.tmp_mb}m,uid={uid},gid={gid},mode=1777"},
            cap_drop=["ALL"], security_opt=["no-new-privileges"], user=KEEPER_USER, working_dir=cfg.workdir,
            labels={reaper.LABEL_SANDBOX: self.run_id, reaper.LABEL_OWNER: reaper.owner_token(),
                    reaper.LABEL_CREATED: str(int(now)), reaper.LABEL_EXPIRES: str(int(now + ttl))},
        )

    def _create_blocking(self) -> DockerSandbox:
        import docker.errors

        client, executor = docker_client(self.config)
        self._start_once(client)
        name = f"relax-sb-{uuid.uuid4().hex[:12]}"
        try:
            container = client.containers.create(**self.container_kwargs(name, time.time()))
        except docker.errors.ImageNotFound as exc:
            raise SandboxError(f"sandbox image {self.config.image!r} not found; run `relax-agent sandbox build-image`") from exc
        except _transport_errors() as exc:
            raise SandboxError(f"could not create sandbox container: {exc}") from exc
        try:
            container.start()
        except _transport_errors() as exc:
            with contextlib.suppress(*_transport_errors()):
                reaper.remove_container(client, container.id)
            raise SandboxError(f"could not start sandbox container {name}: {exc}") from exc
        return DockerSandbox(self.config, client, executor, container.id, name)

    async def create(self) -> DockerSandbox:
        """Start one container and return its sandbox (~0.5 s here).

        Raises:
            SandboxError: daemon unreachable, image missing, or the container failed to start.
        """
        _, executor = docker_client(self.config)
        reaper.install_sigterm_handler()  # signal handlers can only be set from the main thread
        return await in_thread(executor, self._create_blocking, on_abandon=lambda sb: sb.close_blocking())


class _Frames:
    """Incremental parser of Docker's multiplexed stream (8-byte header: stream, 0, 0, 0, size)."""

    def __init__(self, caps: dict[int, OutputCap]):
        self.caps = caps
        self.buf = b""
        self.total = 0

    def feed(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        self.total += len(data)
        pos = 0
        while len(buf) - pos >= 8:
            stream, size = buf[pos], struct.unpack_from(">I", buf, pos + 4)[0]
            if len(buf) - pos < 8 + size:
                break
            if stream in self.caps:
                self.caps[stream].feed(buf[pos + 8:pos + 8 + size])
            pos += 8 + size
        self.buf = buf[pos:]


class DockerSandbox(BaseSandbox):
    """One running container. Created by :meth:`DockerBackend.create`; close it (or use ``async with``)."""

    def __init__(self, config: SandboxConfig, client: Any, executor: ThreadPoolExecutor, container_id: str, name: str):
        super().__init__(config, name, config.workdir)
        self.client = client
        self.container_id = container_id
        self._executor = executor
        self._oom_seen = 0
        self._oom_lock = threading.Lock()
        reaper.register_cleanup(f"docker:{container_id}", self.close_blocking)

    # -- blocking helpers (run on worker threads) -------------------------------------------
    def _api_exec(self, argv: list[str], *, stdin: bool = False, env: dict[str, str] | None = None,
                  cwd: str | None = None) -> tuple[str, socket.socket]:
        try:
            exec_id = self.client.api.exec_create(
                self.container_id, argv, stdin=stdin, stdout=True, stderr=True, tty=False,
                environment=env, workdir=cwd, user=self.config.user,
            )["Id"]
            sock = self.client.api.exec_start(exec_id, socket=True)
        except _transport_errors() as exc:
            self._mark_broken_if_gone(exc)
            raise SandboxError(f"docker exec in sandbox {self.id} failed: {getattr(exc, 'explanation', None) or exc}") from exc
        return exec_id, getattr(sock, "_sock", sock)

    def _mark_broken_if_gone(self, exc: Exception) -> None:
        if time.time() > self.created_at + self.config.ttl_s:
            self.broken = f"expired (sandbox.ttl_s={self.config.ttl_s})"
        elif getattr(exc, "status_code", None) in (404, 409):
            self.broken = f"container is gone or stopped ({exc})"

    def _quick(self, argv: list[str], timeout_s: float = 10.0) -> bytes:
        """Run a short helper command (no stdin) and return its stdout."""
        _, sock = self._api_exec(["timeout", "-s", "KILL", str(timeout_s), *argv])
        frames = _Frames({1: OutputCap(1 << 16)})
        sock.settimeout(timeout_s + 5)
        try:
            while data := sock.recv(65536):
                frames.feed(data)
        except OSError:
            pass
        finally:
            sock.close()
        return bytes(frames.caps[1].kept)

    def _kill_marked(self, marker: str, tag: str, done: list[float] | None = None) -> None:
        """Kill the exec's processes (its launcher, named by ``tag``, then cleans up and exits);
        append the end time to ``done``."""
        try:
            self._quick(["/bin/sh", "-c", KILL_MARKED, "sh", f"{EXEC_MARKER_ENV}={marker}", tag], timeout_s=5.0)
        except SandboxError:
            pass
        finally:
            if done is not None:
                done.append(time.monotonic())

    def _oom_kills(self) -> int:
        out = self._quick(["/bin/sh", "-c", OOM_PROBE]).decode(errors="replace")
        m = re.search(r"^oom_kill (\d+)$", out, re.M)
        return int(m.group(1)) if m else 0

    def _check_oom(self) -> bool:
        with self._oom_lock:
            try:
                n = self._oom_kills()
            except SandboxError:
                return False
            fresh, self._oom_seen = n > self._oom_seen, max(n, self._oom_seen)
        return fresh

    def _check_alive(self) -> None:
        """Mark the sandbox broken when its container is no longer running (removed, expired, killed)."""
        try:
            state = self.client.api.inspect_container(self.container_id).get("State", {})
        except _transport_errors() as exc:
            if getattr(exc, "status_code", None) == 404:
                self.broken = f"container is gone ({exc})"
            return
        if not state.get("Running") or state.get("Status") in ("removing", "exited", "dead"):
            self.broken = f"container is {state.get('Status', 'not running')}"

    def _exit_code(self, exec_id: str) -> int | None:
        """The exec's exit code once docker reports it ended (None: unknown, e.g. the container is gone)."""
        deadline, pause = time.monotonic() + 15.0, 0.01
        while time.monotonic() < deadline:
            try:
                info = self.client.api.exec_inspect(exec_id)
            except _transport_errors() as exc:
                self._mark_broken_if_gone(exc)
                return None
            if not info.get("Running"):
                return info.get("ExitCode")
            time.sleep(pause)
            pause = min(2 * pause, 0.2)
        return None

    def _exec_blocking(self, argv: list[str], timeout_s: float, stdin: bytes | None, env: dict[str, str],
                       cwd: str, max_output_bytes: int, cancel: threading.Event, wrap: bool = True) -> RawResult:
        cfg = self.config
        marker, tag = uuid.uuid4().hex, launch_tag()
        env = {**env, EXEC_MARKER_ENV: marker}
        if wrap:
            full, workdir = ["/bin/sh", "-c", LAUNCHER, "relax-exec", cwd, tag, timeout_arg(timeout_s), *argv], "/"
        else:
            full, workdir = argv, cwd
        start = time.monotonic()
        exec_id, sock = self._api_exec(full, stdin=stdin is not None, env=env, cwd=workdir)
        caps = {1: OutputCap(max_output_bytes), 2: OutputCap(max_output_bytes)}
        frames = _Frames(caps)
        pending = memoryview(stdin) if stdin is not None else None
        host_kill_at = start + timeout_s + cfg.kill_grace_s
        kill_started: float | None = None
        kill_done: list[float] = []
        timed_out = overflow = removed_here = False
        feed_error: OSError | None = None
        sock.setblocking(False)
        poller = select.poll()
        try:
            while True:
                now = time.monotonic()
                killing = (now > host_kill_at or cancel.is_set() or feed_error is not None
                           or frames.total > max_output_bytes * 2 + cfg.max_drain_bytes)
                if killing and kill_started is None:
                    timed_out = now > host_kill_at
                    overflow = not timed_out and not cancel.is_set() and feed_error is None
                    kill_started = now
                    threading.Thread(target=self._kill_marked, args=(marker, tag, kill_done), daemon=True).start()
                elif kill_started is not None and now > (kill_done[0] if kill_done else kill_started + 60) + cfg.kill_grace_s:
                    # the marker kill has run (or hung for a minute) and the stream is still open: a
                    # process without the marker holds it, and only removing the container ends it
                    self.broken = (f"command did not end {cfg.kill_grace_s} s after being killed "
                                   "(a process without the exec's marker held its output); container removed")
                    removed_here = True
                    with contextlib.suppress(*_transport_errors()):
                        reaper.remove_container(self.client, self.container_id)
                    break
                if pending is not None and not pending:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_WR)
                    pending = None
                poller.register(sock, select.POLLIN | (select.POLLOUT if pending is not None else 0))
                events = poller.poll(100)
                if pending is not None and any(ev & select.POLLOUT for _, ev in events):
                    try:
                        pending = pending[sock.send(pending[:1 << 18]):]
                    except BlockingIOError:
                        pass
                    except (BrokenPipeError, ConnectionResetError):
                        pending = None  # the command exited or closed stdin without reading all of it
                    except OSError as exc:
                        feed_error, pending = exc, None
                if not any(ev & (select.POLLIN | select.POLLHUP | select.POLLERR) for _, ev in events):
                    continue
                try:
                    data = sock.recv(1 << 18)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    break
                if not data:
                    break
                frames.feed(data)
        finally:
            sock.close()
        duration = time.monotonic() - start
        code = None if removed_here else self._exit_code(exec_id)
        oom = False
        if not removed_here and code != 0 and not self.closed and not self.broken:
            oom = self._check_oom()  # runs an exec: marks the sandbox broken if the container stopped
            if code in (None, 137) and not oom and not self.broken:
                # an unexplained SIGKILL: the container may be on its way out (its state changes a
                # moment after its processes die), so look for up to a second
                for _ in range(1 if kill_started is not None else 5):
                    self._check_alive()
                    if self.broken:
                        break
                    time.sleep(0.2)
        if not removed_here and (self.closed or self.broken) and code in (None, 137):
            why = "was closed" if self.closed else f"broke ({self.broken})"
            raise SandboxError(f"sandbox {self.id} {why} while {argv[0]!r} ran; the command did not finish")
        if feed_error is not None:
            raise SandboxError(f"sending stdin to {argv[0]!r} in sandbox {self.id} failed: {feed_error}")
        if code is None and not removed_here:
            raise SandboxError(f"docker did not report the exit status of {argv[0]!r} in sandbox {self.id} within 15 s")
        code = 137 if code is None else code
        raw = RawResult(code, bytes(caps[1].kept), bytes(caps[2].kept))
        if code == 126 and raw.stdout.startswith(b"OCI runtime exec failed"):
            raise SandboxError(f"docker could not start {argv[0]!r} in sandbox {self.id} (at sandbox.pids_limit="
                               f"{cfg.pids_limit} processes?): {raw.stdout.decode(errors='replace').strip()}")
        if wrap:
            check_launch(raw, tag, cwd, self.id)
        timed_out = timed_out or (code in (124, 137) and duration >= timeout_s)
        return RawResult(code, raw.stdout, raw.stderr, timed_out=timed_out and not oom,
                         oom_killed=oom, truncated=overflow or caps[1].truncated or caps[2].truncated,
                         duration_s=duration)

    def close_blocking(self) -> None:
        """Remove the container now (used by ``close`` and at interpreter exit).

        Raises:
            SandboxError: the daemon failed; the container still ends by itself after ``ttl_s``.
        """
        self.closed = True
        reaper.unregister_cleanup(f"docker:{self.container_id}")
        try:
            reaper.remove_container(self.client, self.container_id)
        except _transport_errors() as exc:
            raise SandboxError(f"could not remove sandbox container {self.id} ({exc}); it exits after "
                               f"sandbox.ttl_s={self.config.ttl_s} s, or run `relax-agent sandbox reap`") from exc

    # -- async surface ------------------------------------------------------------------------
    async def _run(self, argv: list[str], *, timeout_s: float, stdin: bytes | None, env: dict[str, str],
                   cwd: str, max_output_bytes: int, wrap: bool = True) -> RawResult:
        cancel = threading.Event()
        call = functools.partial(self._exec_blocking, argv, timeout_s, stdin, env, cwd, max_output_bytes, cancel, wrap)
        fut = asyncio.get_running_loop().run_in_executor(self._executor, call)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancel.set()
            try:
                await asyncio.wait_for(asyncio.shield(fut), 3 * self.config.kill_grace_s + 5)
            except BaseException:  # noqa: BLE001 - the caller's cancellation wins
                pass
            raise

    async def reset(self) -> None:
        """Kill all of ``config.user``'s processes (not the keeper) and wipe the work dir, /tmp, /dev/shm.

        Raises:
            SandboxError: the container is gone or the wipe failed.
        """
        self._check_usable()
        wipe = f"kill -9 -1 2>/dev/null; find '{self.workdir}' /tmp /dev/shm -mindepth 1 -delete 2>/dev/null; true"
        res = await self._run(["/bin/sh", "-c", wipe], timeout_s=30.0, stdin=None, env=self.base_env(), cwd="/",
                              max_output_bytes=4096, wrap=False)
        if res.exit_code != 0:
            raise SandboxError(f"reset of sandbox {self.id} failed (exit {res.exit_code}): {res.stderr!r}")

    async def _close(self) -> None:
        await in_thread(self._executor, self.close_blocking)
