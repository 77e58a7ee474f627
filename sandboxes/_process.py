"""Run one host process with a timeout, output caps and cancellation (bubblewrap and subprocess backends)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from typing import Any

from relax_agent.errors import SandboxError
from relax_agent.sandboxes.base import RawResult
from relax_agent.sandboxes.limits import OutputCap, signal_exit_code


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def _pump(stream: asyncio.StreamReader, cap: OutputCap, overflow: asyncio.Event, budget: int) -> None:
    while chunk := await stream.read(1 << 16):
        cap.feed(chunk)
        if cap.dropped > budget:
            overflow.set()


async def _feed(proc: asyncio.subprocess.Process, data: bytes | None) -> None:
    if proc.stdin is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(data or b"")
        await proc.stdin.drain()
    proc.stdin.close()


async def run_process(argv: list[str], *, timeout_s: float, stdin: bytes | None, env: dict[str, str], cwd: str,
                      max_output_bytes: int, max_drain_bytes: int, kill_grace_s: float,
                      pass_fds: tuple[int, ...] = ()) -> RawResult:
    """Run ``argv`` in a new session; kill its whole process group on timeout, overflow or cancellation.

    The command ends when its main process has exited and its output pipes have closed (a
    background child holding them counts as part of it); leftover members of its process
    group are then killed. ``max_drain_bytes`` of output past the caps is read before the
    command is killed and reported ``truncated``. ``pass_fds`` stay open in the child.

    Raises:
        SandboxError: the process could not be started (its ``OSError``'s reason).
    """
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd, start_new_session=True,
            pass_fds=pass_fds,
        )
    except OSError as exc:  # E2BIG past the checks, ENOMEM, a missing launcher: never a raw OSError
        raise SandboxError(f"could not start {argv[0]!r}: {exc.strerror or exc}") from exc
    out, err, overflow = OutputCap(max_output_bytes), OutputCap(max_output_bytes), asyncio.Event()
    assert proc.stdout is not None and proc.stderr is not None
    work = asyncio.gather(_pump(proc.stdout, out, overflow, max_drain_bytes),
                          _pump(proc.stderr, err, overflow, max_drain_bytes), _feed(proc, stdin), proc.wait())
    stop = asyncio.ensure_future(overflow.wait())
    timed_out = False
    waiters: set[asyncio.Future[Any]] = {work, stop}
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            timed_out = stop not in done
            _killpg(proc.pid)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(work), kill_grace_s)
    except asyncio.CancelledError:
        _killpg(proc.pid)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(work), kill_grace_s)
        raise
    finally:
        stop.cancel()
        _killpg(proc.pid)
        if not work.done():
            work.cancel()
            for pipe in (proc.stdout, proc.stderr):
                transport = getattr(pipe, "_transport", None)
                if transport is not None:
                    transport.close()
        with contextlib.suppress(BaseException):
            await work
    if proc.returncode is None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), kill_grace_s)
    code = signal_exit_code(proc.returncode) if proc.returncode is not None else 137
    return RawResult(code, bytes(out.kept), bytes(err.kept), timed_out=timed_out,
                     truncated=overflow.is_set() or out.truncated or err.truncated,
                     duration_s=time.monotonic() - start)


def wipe_dir(path: str) -> None:
    """Delete everything inside ``path`` (symlinks are removed, never followed)."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
