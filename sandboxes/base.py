"""The Sandbox contract and the implementation every backend shares (config: :mod:`.config`; limits: :mod:`.limits`).

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
import os
import time
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from relax_agent.errors import SandboxError
from relax_agent.sandboxes.config import SandboxConfig
from relax_agent.sandboxes.limits import check_arg_sizes, check_env, unencodable

T = TypeVar("T")
Command = str | Sequence[str]

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


def _as_bytes(data: bytes | str | None) -> bytes | None:
    if data is None or isinstance(data, bytes):
        return data
    if isinstance(data, str):
        try:
            return data.encode()
        except UnicodeEncodeError:
            raise SandboxError(f"stdin={data!r:.80} holds {unencodable(data)}") from None
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise SandboxError(f"stdin={data!r:.80}: expected bytes, str or None, got {type(data).__name__}")


def _argv(cmd: Command) -> list[str]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise SandboxError("empty command")
        cmd = ["/bin/sh", "-c", cmd]
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
        why = unencodable(arg)
        if why is not None:
            raise SandboxError(f"argument {arg!r:.80} of cmd contains {why}")
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
        if not isinstance(path, str) or not path or unencodable(path) is not None:
            raise SandboxError(f"bad sandbox path {path!r}: expected a non-empty str without NUL bytes or lone surrogates")
        return path if path.startswith("/") else f"{self.workdir.rstrip('/')}/{path}"

    async def _raw(self, cmd: Command, timeout_s: float | None, stdin: bytes | str | None,
                   env: Mapping[str, str] | None, cwd: str | None, max_output_bytes: int) -> RawResult:
        self._check_usable()
        argv = _argv(cmd)
        full_env = {**self.base_env(), **check_env(self.config.env), **check_env(env or {})}
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
