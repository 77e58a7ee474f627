"""The Sandbox contract, its config and the pieces every backend shares.

A sandbox runs untrusted, model-written commands with limits on by default::

    async with await SandboxConfig(backend="docker").build().create() as sb:
        result = await sb.exec("echo hi", timeout_s=5)
        assert result.stdout == "hi\\n" and result.ok

**Why async.** Rollouts run hundreds of episodes at once and an exec mostly waits (on a
container, a process, a socket). The protocol is ``async`` so the rollout driver can
drive all of them from one event loop, cancel an episode cleanly (a cancelled ``exec`` kills
its command before re-raising), and bound concurrency with ordinary asyncio primitives.
Synchronous callers (gymnasium ``step``) use :func:`run_sync`, which runs the coroutine on a
background event-loop thread and turns Ctrl-C into a cancellation so cleanup still runs.

Backends implement :class:`BaseSandbox._run` (one command, raw bytes) and ``_close``; this
module turns that into ``exec`` / ``run_python`` / ``write_file`` / ``read_file`` / ``reset``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from pydantic import Field, model_validator

from relax_agent.configbase import Section
from relax_agent.errors import SandboxError

T = TypeVar("T")
Command = str | Sequence[str]
BackendName = Literal["docker", "bubblewrap", "subprocess", "fake"]

EXEC_MARKER_ENV = "RELAX_SANDBOX_EXEC"
"""Environment variable set on every command; its value identifies the exec so that a
timed-out or cancelled command's processes can be found and killed."""


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command in a sandbox.

    ``exit_code`` follows the shell convention: 128 + N when killed by signal N (so a timed-out
    or OOM-killed command usually reports 137). ``stdout`` / ``stderr`` are decoded as UTF-8
    (invalid bytes replaced) and hold at most ``max_output_bytes`` bytes each.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    """The command ran past ``timeout_s`` and was killed."""
    oom_killed: bool = False
    """A process of the command was killed by the kernel's OOM killer (memory limit)."""
    truncated: bool = False
    """stdout or stderr produced more than ``max_output_bytes``; the rest was dropped."""
    duration_s: float = 0.0
    """Wall-clock seconds from start to the end of the command, as seen by the host."""

    @property
    def ok(self) -> bool:
        """Exit code 0 and neither timed out nor OOM-killed."""
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed


@dataclass(frozen=True)
class RawResult:
    """What a backend's ``_run`` returns: :class:`ExecResult` with undecoded output."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False
    duration_s: float = 0.0

    def decode(self) -> ExecResult:
        """The :class:`ExecResult` with UTF-8 decoded output."""
        return ExecResult(
            exit_code=self.exit_code,
            stdout=self.stdout.decode("utf-8", "replace"),
            stderr=self.stderr.decode("utf-8", "replace"),
            timed_out=self.timed_out,
            oom_killed=self.oom_killed,
            truncated=self.truncated,
            duration_s=self.duration_s,
        )


@runtime_checkable
class Sandbox(Protocol):
    """An isolated place to run commands. All methods are coroutines; ``close`` is idempotent.

    Errors: operations on a closed or broken sandbox raise :class:`SandboxError`; a command that
    fails, times out or runs out of memory is *not* an error (see :class:`ExecResult`).
    """

    config: SandboxConfig
    id: str
    workdir: str

    async def exec(self, cmd: Command, timeout_s: float | None = None, stdin: bytes | str | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | None = None) -> ExecResult:
        """Run ``cmd`` (a shell string or an argv list) in the sandbox (see :meth:`BaseSandbox.exec`).

        Raises:
            SandboxError: the sandbox is closed or broken, or an argument is invalid.
        """

    async def run_python(self, code: str, timeout_s: float | None = None,
                         stdin: bytes | str | None = None) -> ExecResult:
        """Run Python source ``code`` with ``config.python`` in the work directory."""

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` to ``path`` (relative to ``workdir``), creating parent folders.

        Raises:
            SandboxError: the file could not be written.
        """

    async def read_file(self, path: str) -> bytes:
        """The bytes of ``path`` (relative to ``workdir``).

        Raises:
            SandboxError: the file is missing, not a regular file, unreadable, or over
                ``config.max_file_bytes``.
        """

    async def reset(self) -> None:
        """Kill every process the sandbox's commands started and empty the work directory and /tmp.

        Raises:
            SandboxError: the reset failed (the sandbox should then be closed and replaced).
        """
        raise NotImplementedError

    async def health(self) -> bool:
        """True when the sandbox answers a trivial command in time."""

    async def close(self) -> None:
        """Release everything the sandbox holds (idempotent)."""


@runtime_checkable
class ReportsState(Protocol):
    """A :class:`Sandbox` that says when it can no longer be used (every :class:`BaseSandbox`): a
    pool replaces a closed or broken one instead of resetting it for the next episode.

    Attributes:
        closed: ``close`` was called.
        broken: why the sandbox cannot run commands any more (its container is gone, it expired,
            a command would not die); None while it can.
    """

    closed: bool
    broken: str | None


class SandboxBackend(Protocol):
    """Makes sandboxes of one kind (holds shared runtime state such as a Docker client)."""

    config: SandboxConfig

    async def create(self) -> Sandbox:
        """Start one sandbox and return it.

        Raises:
            SandboxError: the sandbox could not be started.
        """


class PoolConfig(Section):
    """A pool of pre-started sandboxes (see :class:`relax_agent.sandboxes.SandboxPool`)."""

    size: int = Field(default=0, ge=0)
    """Sandboxes kept started and idle, ready to hand out; 0 creates one per acquire."""
    max_size: int = Field(default=32, ge=1)
    """Most sandboxes alive at once (idle + in use); ``acquire`` waits beyond it."""
    acquire_timeout_s: float = Field(default=60.0, gt=0)
    """How long ``acquire`` waits for a free slot before raising SandboxTimeoutError."""
    on_release: Literal["reset", "replace"] = "reset"
    """"reset": kill processes and wipe the work dir, then reuse; "replace": close and start anew."""
    health_check_idle_s: float = Field(default=30.0, ge=0)
    """An idle sandbox older than this is health-checked before it is handed out."""
    max_uses: int = Field(default=256, ge=1)
    """Episodes one sandbox serves before it is replaced."""

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if self.size > self.max_size:
            raise ValueError(f"pool.size={self.size} exceeds pool.max_size={self.max_size}")
        return self


class SandboxConfig(Section):
    """Which sandbox backend to use and its limits (all limits apply per sandbox)."""

    backend: BackendName = "docker"
    """"docker" (default, strongest), "bubblewrap" (no daemon, light tools), "subprocess"
    (no isolation; development only, needs ``unsafe: true``), "fake" (in-memory, tests)."""
    unsafe: bool = False
    """Must be true to use the "subprocess" backend, which does not isolate anything."""
    image: str = "relax-agent/python:bookworm"
    """Docker image; build it offline with ``relax-agent sandbox build-image``."""
    memory_mb: int = Field(default=512, ge=16)
    """Memory limit (Docker: RAM == RAM + swap; bubblewrap/subprocess: address space per process)."""
    cpus: float = Field(default=1.0, gt=0)
    """CPU quota in cores (Docker only)."""
    pids_limit: int = Field(default=128, ge=8)
    """Most processes/threads at once (Docker: cgroup; bubblewrap/subprocess: RLIMIT_NPROC)."""
    nofile: int = Field(default=256, ge=16)
    """Most open file descriptors per process."""
    workdir: str = "/work"
    """Work directory inside the sandbox (a tmpfs in Docker); relative paths resolve here."""
    workdir_mb: int = Field(default=128, ge=1)
    """Size of the work directory (Docker tmpfs; bubblewrap/subprocess: largest file)."""
    tmp_mb: int = Field(default=32, ge=1)
    """Size of the /tmp tmpfs (Docker and bubblewrap)."""
    max_output_bytes: int = Field(default=65536, ge=1)
    """Bytes of stdout and of stderr kept per command; the rest is dropped (``truncated``)."""
    max_drain_bytes: int = Field(default=16 * 2**20, ge=1)
    """Output read past ``max_output_bytes`` before the command is killed to spare the host."""
    max_file_bytes: int = Field(default=16 * 2**20, ge=1)
    """Largest file ``read_file`` returns."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Default per-command timeout."""
    max_timeout_s: float = Field(default=600.0, gt=0)
    """Largest ``timeout_s`` a caller may ask for."""
    kill_grace_s: float = Field(default=2.0, gt=0)
    """After ``timeout_s``, how long the host waits for the in-sandbox kill before killing harder."""
    ttl_s: float = Field(default=3600.0, gt=0)
    """Longest life of a sandbox: a Docker container exits (and is removed) after this even if
    the trainer was SIGKILLed, and the reaper removes it once this has passed."""
    user: str = "65534:65534"
    """Numeric ``uid:gid`` that commands run as (65534 is ``nobody``)."""
    python: str = "python3"
    """Python interpreter inside the sandbox, used by ``run_python``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for every command (the host environment never leaks in)."""
    run_id: str | None = None
    """Label for this run's containers; defaults to ``<host>-<pid>``."""
    docker_host: str | None = None
    """Docker daemon URL; None uses DOCKER_HOST or the local socket."""
    max_workers: int = Field(default=64, ge=1)
    """Threads (and Docker connections) for blocking Docker calls; bounds concurrent execs."""
    reap_on_start: bool = True
    """Remove containers of dead runs when the first Docker sandbox of this process starts."""
    pool: PoolConfig = Field(default_factory=PoolConfig)

    @model_validator(mode="after")
    def _check(self) -> SandboxConfig:
        if self.backend == "subprocess" and not self.unsafe:
            raise ValueError(
                "sandbox backend 'subprocess' runs commands on the host without isolation; "
                "set sandbox.unsafe: true to allow it (development only)"
            )
        uid, sep, gid = self.user.partition(":")
        if not (uid.isdigit() and gid.isdigit() and sep):
            raise ValueError(f"sandbox.user={self.user!r} must be numeric 'uid:gid', e.g. '65534:65534'")
        if not self.workdir.startswith("/"):
            raise ValueError(f"sandbox.workdir={self.workdir!r} must be an absolute path")
        if self.timeout_s > self.max_timeout_s:
            raise ValueError(f"sandbox.timeout_s={self.timeout_s} exceeds sandbox.max_timeout_s={self.max_timeout_s}")
        return self

    @property
    def uid_gid(self) -> tuple[int, int]:
        """``user`` as two ints."""
        uid, _, gid = self.user.partition(":")
        return int(uid), int(gid)

    def build(self) -> SandboxBackend:
        """The backend that creates sandboxes with this config (imports its dependencies lazily)."""
        if self.backend == "docker":
            from relax_agent.sandboxes.docker import DockerBackend

            return DockerBackend(self)
        if self.backend == "bubblewrap":
            from relax_agent.sandboxes.bubblewrap import BubblewrapBackend

            return BubblewrapBackend(self)
        if self.backend == "subprocess":
            from relax_agent.sandboxes.local_unsafe import SubprocessBackend

            return SubprocessBackend(self)
        from relax_agent.sandboxes.fake import FakeBackend

        return FakeBackend(self)


class OutputCap:
    """Keeps the first ``limit`` bytes of a stream and counts the rest."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept = bytearray()
        self.dropped = 0

    def feed(self, chunk: bytes) -> None:
        """Append ``chunk``, keeping at most ``limit`` bytes in total."""
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    @property
    def truncated(self) -> bool:
        """True when bytes were dropped."""
        return self.dropped > 0


def signal_exit_code(returncode: int) -> int:
    """Map a Python ``returncode`` (negative N for signal N) to the shell's 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _as_bytes(data: bytes | str | None) -> bytes | None:
    if data is None or isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise SandboxError(f"stdin={data!r:.80}: expected bytes, str or None, got {type(data).__name__}")


def _argv(cmd: Command) -> list[str]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise SandboxError("empty command")
        return ["/bin/sh", "-c", cmd]
    if isinstance(cmd, (bytes, bytearray)) or not isinstance(cmd, Sequence):
        raise SandboxError(f"cmd={cmd!r:.80}: expected a shell string or a list of str arguments")
    argv = []
    for arg in cmd:
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            arg = str(arg)
        elif isinstance(arg, os.PathLike):
            arg = os.fspath(arg)
        if not isinstance(arg, str):
            raise SandboxError(f"argument {arg!r:.80} of cmd: expected str (or int, float, path), got {type(arg).__name__}")
        if "\0" in arg:
            raise SandboxError(f"argument {arg!r:.80} of cmd contains a NUL byte")
        argv.append(arg)
    if not argv:
        raise SandboxError("empty command (argv list has no program)")
    return argv


def launch_tag() -> str:
    """A fresh token a launcher prints (alone, to stderr, exit :data:`LAUNCH_ERROR_EXIT`) when the
    command could not be started because ``cwd`` is not a directory (see :data:`CD_OR_FAIL`)."""
    return f"relax-sandbox-launch-error-{uuid.uuid4().hex}"


LAUNCH_ERROR_EXIT = 126
CD_OR_FAIL = f'cd -- "$1" 2>/dev/null || {{ printf \'%s\\n\' "$2" >&2; exit {LAUNCH_ERROR_EXIT}; }}'
"""Shell prologue of the in-sandbox launchers: ``$1`` is the cwd, ``$2`` the :func:`launch_tag`."""


def check_launch(raw: RawResult, tag: str, cwd: str, sandbox_id: str) -> RawResult:
    """``raw`` unchanged, unless it is the launcher's report that ``cwd`` is not a directory.

    Raises:
        SandboxError: ``cwd`` does not exist (or is not a directory) in the sandbox.
    """
    if raw.exit_code == LAUNCH_ERROR_EXIT and raw.stderr == f"{tag}\n".encode():
        raise SandboxError(f"cwd={cwd!r} does not exist or is not a directory in sandbox {sandbox_id}")
    return raw


MAX_ARG_BYTES = 128 * 1024 - 1
"""Longest single argument or ``NAME=value`` environment entry (UTF-8 bytes): Linux's
``MAX_ARG_STRLEN`` (32 pages, the NUL included) caps each one, on the host and in a container."""
MAX_EXEC_ARG_BYTES = 1024 * 1024
"""Most UTF-8 bytes of a command's arguments and environment together (each with its NUL). Below
Linux's ``ARG_MAX`` (a quarter of the 8 MiB default stack, 2 MiB) with room for the launchers'
own arguments, so a command every backend can start; larger data goes through ``stdin`` or
``write_file``."""


def check_arg_sizes(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Refuse an argument list the kernel would refuse (``E2BIG``): the same :class:`SandboxError`
    on every backend, before anything runs (bubblewrap raised a raw ``OSError``, Docker returned
    exit 1 with "argument list too long").

    Raises:
        SandboxError: an argument or ``NAME=value`` entry over :data:`MAX_ARG_BYTES`, or all of them
            over :data:`MAX_EXEC_ARG_BYTES`; names the item, its size and the limit.
    """
    total = 0
    for i, arg in enumerate(argv):
        n = len(arg.encode(errors="surrogateescape"))
        if n > MAX_ARG_BYTES:
            raise SandboxError(f"argument {i} of cmd ({arg[:40]!r}...) is {n} bytes, over the {MAX_ARG_BYTES}-byte "
                               "limit of one argument (argument list too long); pass large data through stdin or "
                               "write_file")
        total += n + 1
    for key, value in env.items():
        n = len(key.encode(errors="surrogateescape")) + 1 + len(value.encode(errors="surrogateescape"))
        if n > MAX_ARG_BYTES:
            raise SandboxError(f"environment variable {key!r} is {n} bytes, over the {MAX_ARG_BYTES}-byte limit of "
                               "one entry (argument list too long); pass large data through stdin or write_file")
        total += n + 1
    if total > MAX_EXEC_ARG_BYTES:
        raise SandboxError(f"cmd's {len(argv)} arguments and {len(env)} environment variables are {total} bytes, over "
                           f"the {MAX_EXEC_ARG_BYTES}-byte limit (argument list too long); pass large data through "
                           "stdin or write_file")


def _check_env(env: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or not isinstance(value, str) or "\0" in value:
            raise SandboxError(f"bad environment variable {key!r}={value!r}: names need no '=' or NUL, values must be str")
        out[key] = value
    return out


_READ_REGULAR = (
    'if [ -d "$1" ]; then echo "$1: is a directory, not a regular file" >&2; exit 1; fi; '
    'if [ -e "$1" ] && [ ! -f "$1" ]; then echo "$1: not a regular file (device, FIFO or socket)" >&2; exit 1; fi; '
    'exec cat -- "$1"'
)
"""``read_file``'s command: refuses anything but a regular file (a FIFO would block, a device never end)."""


class BaseSandbox:
    """Shared implementation of :class:`Sandbox` on top of one primitive, :meth:`_run`.

    Subclasses implement ``_run`` (run ``argv`` with a timeout, output caps and the exec
    marker), ``reset`` and ``_close``; they may override ``health``.
    """

    def __init__(self, config: SandboxConfig, sandbox_id: str, workdir: str):
        self.config = config
        self.id = sandbox_id
        self.workdir = workdir
        self.closed = False
        self.broken: str | None = None
        self.created_at = time.time()
        self._close_task: asyncio.Future[None] | None = None
        self._running: set[asyncio.Task[Any]] = set()
        self._stopped_by_close: set[asyncio.Task[Any]] = set()

    # -- primitives implemented by backends ------------------------------------------------
    async def _run(self, argv: list[str], *, timeout_s: float, stdin: bytes | None, env: dict[str, str],
                   cwd: str, max_output_bytes: int) -> RawResult:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError

    async def _closable(self, argv: list[str], run: Coroutine[Any, Any, RawResult]) -> RawResult:
        """Await ``run`` (a cancellable ``_run`` body) so that :meth:`_stop_running` can end it:
        an exec stopped because the sandbox closed raises SandboxError instead of a result."""
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            return await run
        except asyncio.CancelledError:
            if task in self._stopped_by_close:
                task.uncancel()
                raise SandboxError(f"sandbox {self.id} was closed while {argv[0]!r} ran; "
                                   "the command was killed") from None
            raise
        finally:
            self._running.discard(task)
            self._stopped_by_close.discard(task)

    def _stop_running(self) -> None:
        """Cancel every exec in flight (for ``_close``); each kills its command and raises SandboxError."""
        for task in list(self._running):
            if not task.cancelling():  # one its caller cancelled stays a plain cancellation
                self._stopped_by_close.add(task)
            task.cancel()

    # -- the contract ----------------------------------------------------------------------
    def base_env(self) -> dict[str, str]:
        """Environment every command starts from (before ``config.env`` and per-exec ``env``)."""
        return {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": self.workdir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "TMPDIR": "/tmp",
        }

    def _check_usable(self) -> None:
        if self.closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self.broken:
            raise SandboxError(f"sandbox {self.id} is broken: {self.broken}")

    def _timeout(self, timeout_s: float | None) -> float:
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))):
            raise SandboxError(f"timeout_s={timeout_s!r}: expected a number of seconds or None, "
                               f"got {type(timeout_s).__name__}")
        t = self.config.timeout_s if timeout_s is None else float(timeout_s)
        if not 0 < t <= self.config.max_timeout_s:
            raise SandboxError(f"timeout_s={timeout_s} must be in (0, {self.config.max_timeout_s}] (sandbox.max_timeout_s)")
        return t

    def _io_timeout_s(self) -> float:
        return min(max(self.config.timeout_s, 30.0), self.config.max_timeout_s)

    def _resolve(self, path: str) -> str:
        if not isinstance(path, str) or not path or "\0" in path:
            raise SandboxError(f"bad sandbox path {path!r}: expected a non-empty str without NUL bytes")
        return path if path.startswith("/") else f"{self.workdir.rstrip('/')}/{path}"

    async def _raw(self, cmd: Command, timeout_s: float | None, stdin: bytes | str | None,
                   env: Mapping[str, str] | None, cwd: str | None, max_output_bytes: int) -> RawResult:
        self._check_usable()
        argv = _argv(cmd)
        full_env = {**self.base_env(), **_check_env(self.config.env), **_check_env(env or {})}
        check_arg_sizes(argv, full_env)
        return await self._run(argv, timeout_s=self._timeout(timeout_s), stdin=_as_bytes(stdin), env=full_env,
                               cwd=self._resolve(cwd) if cwd is not None else self.workdir,
                               max_output_bytes=max_output_bytes)

    async def exec(self, cmd: Command, timeout_s: float | None = None, stdin: bytes | str | None = None,
                   env: Mapping[str, str] | None = None, cwd: str | None = None) -> ExecResult:
        """Run ``cmd`` (a shell string run by ``/bin/sh -c``, or an argv list) in the sandbox.

        Args:
            timeout_s: seconds before the command is killed (default ``config.timeout_s``).
            stdin: bytes (or UTF-8 text) fed to the command; None gives an empty stdin.
            env: extra environment variables; the host environment is never passed in.
            cwd: working directory (relative paths resolve under ``workdir``).

        Raises:
            SandboxError: the sandbox is closed or broken (also when that happens while the command
                runs), or an argument is invalid: an empty command, an argument that is not str
                (int, float and paths are converted) or holds a NUL byte, ``timeout_s`` that is not
                a number in (0, ``max_timeout_s``], ``stdin`` that is not bytes/str/None, a ``cwd``
                that is not a directory in the sandbox, an ``env`` name or value with '=' / NUL, an
                argument list too long for the kernel (:func:`check_arg_sizes`).
        """
        raw = await self._raw(cmd, timeout_s, stdin, env, cwd, self.config.max_output_bytes)
        return raw.decode()

    async def run_python(self, code: str, timeout_s: float | None = None,
                         stdin: bytes | str | None = None) -> ExecResult:
        """Run Python source ``code`` with ``config.python`` in the work directory."""
        if len(code.encode()) < 100_000:
            return await self.exec([self.config.python, "-c", code], timeout_s=timeout_s, stdin=stdin)
        await self.write_file(".relax_run_python.py", code)
        return await self.exec([self.config.python, ".relax_run_python.py"], timeout_s=timeout_s, stdin=stdin)

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` to ``path`` (relative to ``workdir``), creating parent folders.

        Raises:
            SandboxError: the file could not be written (outside the writable area, disk full...).
        """
        target = self._resolve(path)
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        res = await self._raw(["/bin/sh", "-c", script, "sh", target], self._io_timeout_s(),
                              _as_bytes(data) or b"", None, None, 4096)
        if res.exit_code != 0:
            raise SandboxError(f"write_file({path!r}) failed (exit {res.exit_code}): {res.stderr.decode(errors='replace').strip()}")

    async def read_file(self, path: str) -> bytes:
        """The bytes of ``path`` (relative to ``workdir``).

        Raises:
            SandboxError: the file does not exist, is not a regular file (a directory, device, FIFO
                or socket), is unreadable, or exceeds ``config.max_file_bytes``.
        """
        timeout_s = self._io_timeout_s()
        res = await self._raw(["/bin/sh", "-c", _READ_REGULAR, "sh", self._resolve(path)], timeout_s, None, None, None,
                              self.config.max_file_bytes)
        if res.timed_out:
            raise SandboxError(f"read_file({path!r}) timed out after {timeout_s} s")
        if res.exit_code != 0:
            why = res.stderr.decode(errors="replace").strip() or f"no error message (exit {res.exit_code})"
            raise SandboxError(f"read_file({path!r}) failed: {why}")
        if res.truncated:
            raise SandboxError(f"read_file({path!r}): file exceeds sandbox.max_file_bytes={self.config.max_file_bytes}")
        return res.stdout

    async def reset(self) -> None:
        """Kill every process the sandbox's commands started and empty the work directory and /tmp.

        Raises:
            SandboxError: the reset failed (the sandbox should then be closed and replaced).
        """
        raise NotImplementedError

    async def health(self) -> bool:
        """True when the sandbox answers a trivial command in time."""
        if self.closed or self.broken:
            return False
        try:
            res = await self.exec(["true"], timeout_s=10.0)
        except SandboxError:
            return False
        return res.exit_code == 0

    async def close(self) -> None:
        """Release everything the sandbox holds. Idempotent; completes even if the caller is cancelled."""
        if self._close_task is None:
            self.closed = True
            self._close_task = asyncio.ensure_future(self._close())
        if not self._close_task.done():
            await asyncio.shield(self._close_task)

    async def __aenter__(self: T) -> T:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("broken" if self.broken else "open")
        return f"{type(self).__name__}(id={self.id!r}, {state})"


# -- running coroutines from synchronous code ------------------------------------------------

_portal_lock = threading.Lock()
_portal_loop: asyncio.AbstractEventLoop | None = None


def portal_loop() -> asyncio.AbstractEventLoop:
    """The background event loop (daemon thread) that :func:`run_sync` uses by default."""
    global _portal_loop
    with _portal_lock:
        if _portal_loop is None or _portal_loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="relax-sandbox-loop", daemon=True).start()
            _portal_loop = loop
        return _portal_loop


def run_sync(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop | None = None) -> T:
    """Run ``coro`` to completion from synchronous code and return its result.

    The coroutine runs on ``loop`` (default: :func:`portal_loop`). If the caller is interrupted
    (Ctrl-C), the coroutine is cancelled and given 10 s to clean up before the interrupt is
    re-raised, so sandboxes it holds are still closed.

    Raises:
        SandboxError: called from the thread running ``loop`` (use ``await`` there instead).
    """
    loop = loop or portal_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise SandboxError("run_sync called from inside its own event loop; await the coroutine instead")
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result()
    except BaseException:
        if not fut.done():
            fut.cancel()
            try:
                fut.result(timeout=10.0)
            except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError, Exception):
                pass
        raise
