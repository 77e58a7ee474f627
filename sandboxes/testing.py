"""The sandbox contract suite: run it against any backend, ours or yours.

With pytest, subclass :class:`SandboxContract` in a ``test_*.py`` file::

    class TestMySandbox(SandboxContract):
        async def make_sandbox(self):
            return await MyBackend(SandboxConfig(max_output_bytes=1024)).create()

Without pytest: ``failures = asyncio.run(run_contract(make_sandbox))`` returns
``{check_name: error}`` for every check that failed.

Each check gets a fresh sandbox and closes it. ``check_large_stdin_and_file`` stores 50 MB:
give the sandbox ``workdir_mb`` (and on Docker ``memory_mb``) of 64 or more. Checks that need an isolated file system
(writes outside the work dir must fail) are skipped when ``isolated = False`` (the unsafe
``subprocess`` backend). Every check finishes in a few seconds on a real backend.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

from relax_agent.errors import SandboxError
from relax_agent.sandboxes.base import ExecResult, Sandbox

Factory = Callable[[], Awaitable[Sandbox]]
Check = Callable[[Sandbox], Awaitable[None]]
CHECKS: dict[str, Check] = {}
NEEDS_ISOLATION: set[str] = set()
HOST_SECRET_ENV = "RELAX_CONTRACT_HOST_SECRET"


def _check(isolated: bool = False) -> Callable[[Check], Check]:
    def deco(fn: Check) -> Check:
        name = fn.__name__.removeprefix("check_")
        CHECKS[name] = fn
        if isolated:
            NEEDS_ISOLATION.add(name)
        return fn

    return deco


def _expect(cond: bool, what: str, result: ExecResult | None = None) -> None:
    if not cond:
        raise AssertionError(f"{what}" + (f"; got {result}" if result is not None else ""))


@_check()
async def check_echo(sb: Sandbox) -> None:
    """A shell string runs under /bin/sh; stdout is captured; the flags are all false."""
    r = await sb.exec("echo hello sandbox")
    _expect(r.stdout == "hello sandbox\n" and r.stderr == "" and r.exit_code == 0, "echo output", r)
    _expect(r.ok and not (r.timed_out or r.oom_killed or r.truncated) and r.duration_s > 0, "flags", r)


@_check()
async def check_exit_code_and_stderr(sb: Sandbox) -> None:
    """The exit code propagates and stderr is captured separately from stdout."""
    r = await sb.exec("echo out; echo err >&2; exit 3")
    _expect(r.exit_code == 3 and r.stdout == "out\n" and r.stderr == "err\n" and not r.ok, "exit 3 with err", r)


@_check()
async def check_argv_is_not_split(sb: Sandbox) -> None:
    """An argv list runs without a shell: spaces inside an argument stay."""
    r = await sb.exec(["printf", "%s|", "a b", "c"])
    _expect(r.stdout == "a b|c|" and r.exit_code == 0, "printf argv", r)


@_check()
async def check_stdin(sb: Sandbox) -> None:
    """``stdin`` bytes reach the command; without stdin the command sees an empty input."""
    r = await sb.exec(["cat"], stdin=b"line 1\nline 2\n")
    _expect(r.stdout == "line 1\nline 2\n", "cat echoes stdin", r)
    r = await sb.exec(["cat"], timeout_s=5)
    _expect(r.stdout == "" and r.exit_code == 0 and not r.timed_out, "cat without stdin ends at once", r)


@_check()
async def check_env(sb: Sandbox) -> None:
    """``env`` is passed in; the host's environment is not."""
    r = await sb.exec(["printenv", "RELAX_CONTRACT_VAR"], env={"RELAX_CONTRACT_VAR": "v 1"})
    _expect(r.stdout == "v 1\n", "env var passed", r)
    os.environ[HOST_SECRET_ENV] = "leaked"
    try:
        r = await sb.exec(["printenv", HOST_SECRET_ENV])
    finally:
        os.environ.pop(HOST_SECRET_ENV, None)
    _expect(r.exit_code != 0 and "leaked" not in r.stdout, "host env hidden", r)


@_check()
async def check_cwd(sb: Sandbox) -> None:
    """Commands start in ``workdir``; a relative ``cwd`` resolves under it."""
    r = await sb.exec(["pwd"])
    _expect(r.stdout.strip() == sb.workdir, f"default cwd {sb.workdir}", r)
    await sb.write_file("sub/marker.txt", "x")
    r = await sb.exec(["pwd"], cwd="sub")
    _expect(r.stdout.strip() == sb.workdir.rstrip("/") + "/sub", "relative cwd", r)
    r = await sb.exec(["cat", "marker.txt"], cwd="sub")
    _expect(r.stdout == "x", "file visible from cwd", r)


@_check()
async def check_files_roundtrip(sb: Sandbox) -> None:
    """``write_file`` / ``read_file`` keep bytes exactly (binary, nested, 1 MiB); exec sees them."""
    blob = bytes(range(256)) * 4
    await sb.write_file("d1/d2/blob.bin", blob)
    _expect(await sb.read_file("d1/d2/blob.bin") == blob, "binary roundtrip")
    await sb.write_file("text.txt", "héllo\n")
    r = await sb.exec(["cat", "text.txt"])
    _expect(r.stdout == "héllo\n", "exec sees written file", r)
    big = os.urandom(1 << 20)
    await sb.write_file(f"{sb.workdir}/big.bin", big)
    _expect(await sb.read_file("big.bin") == big, "1 MiB roundtrip by absolute and relative path")
    await sb.exec("echo made > made.txt")
    _expect(await sb.read_file("made.txt") == b"made\n", "read a file the command wrote")


@_check()
async def check_read_missing_raises(sb: Sandbox) -> None:
    """Reading a missing file raises SandboxError."""
    try:
        await sb.read_file("does/not/exist.txt")
    except SandboxError:
        return
    raise AssertionError("read_file of a missing file did not raise SandboxError")


@_check()
async def check_timeout(sb: Sandbox) -> None:
    """A command past ``timeout_s`` is killed promptly, flagged, and the sandbox still works."""
    t0 = time.monotonic()
    r = await sb.exec(["sleep", "30"], timeout_s=0.5)
    _expect(r.timed_out and not r.ok and r.exit_code != 0, "sleep 30 timed out", r)
    _expect(time.monotonic() - t0 < 8, "killed within a few seconds of the timeout", r)
    r = await sb.exec("echo still here")
    _expect(r.stdout == "still here\n", "sandbox usable after a timeout", r)


@_check()
async def check_timeout_kills_children(sb: Sandbox) -> None:
    """A timeout kills the command's background children too."""
    r = await sb.exec("sleep 1.5 && echo late > late.txt & sleep 30", timeout_s=0.3)
    _expect(r.timed_out, "timed out", r)
    await asyncio.sleep(2.0)
    r = await sb.exec(["cat", "late.txt"])
    _expect(r.exit_code != 0, "the background child was killed (late.txt never written)", r)


@_check()
async def check_output_truncated(sb: Sandbox) -> None:
    """Output past ``max_output_bytes`` is dropped and flagged; what is kept is the start."""
    cap = sb.config.max_output_bytes
    r = await sb.exec(["head", "-c", str(4 * cap + 7), "/dev/zero"])
    _expect(r.truncated and len(r.stdout) == cap and set(r.stdout) <= {"\0"}, f"stdout capped at {cap}", r)
    r = await sb.exec("echo short")
    _expect(not r.truncated and r.stdout == "short\n", "next command not truncated", r)


@_check()
async def check_run_python(sb: Sandbox) -> None:
    """``run_python`` runs source with the sandbox's interpreter; errors show as exit code + stderr."""
    r = await sb.run_python("x = 6\nprint(x * 7)")
    _expect(r.stdout == "42\n" and r.ok, "print(6*7)", r)
    r = await sb.run_python("print(1 // 0)")
    _expect(r.exit_code != 0 and "ZeroDivisionError" in r.stderr, "exception -> non-zero exit + traceback", r)


@_check()
async def check_concurrent_execs(sb: Sandbox) -> None:
    """Several commands may run on one sandbox at once."""
    results = await asyncio.gather(*[sb.exec(f"echo {i}") for i in range(4)])
    _expect([r.stdout for r in results] == [f"{i}\n" for i in range(4)], "4 concurrent echos")


@_check()
async def check_cancellation(sb: Sandbox) -> None:
    """Cancelling ``exec`` raises CancelledError quickly and kills the command; the sandbox survives."""
    task = asyncio.ensure_future(sb.exec("sleep 1.5 && echo late > cancelled.txt & sleep 30", timeout_s=60))
    await asyncio.sleep(0.3)
    task.cancel()
    t0 = time.monotonic()
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("exec swallowed the cancellation")
    _expect(time.monotonic() - t0 < 8, "cancellation finished within a few seconds")
    await asyncio.sleep(2.0)
    r = await sb.exec(["cat", "cancelled.txt"])
    _expect(r.exit_code != 0, "the cancelled command's children were killed", r)


@_check()
async def check_reset(sb: Sandbox) -> None:
    """``reset`` empties the work dir and leaves the sandbox usable."""
    await sb.write_file("keep.txt", "x")
    await sb.reset()
    r = await sb.exec(["cat", "keep.txt"])
    _expect(r.exit_code != 0, "file gone after reset", r)
    r = await sb.exec("echo ok")
    _expect(r.stdout == "ok\n", "usable after reset", r)


@_check()
async def check_health_and_close(sb: Sandbox) -> None:
    """Healthy while open; ``close`` is idempotent; using a closed sandbox raises SandboxError."""
    _expect(await sb.health(), "healthy when open")
    await sb.close()
    await sb.close()
    _expect(not await sb.health(), "unhealthy when closed")
    try:
        await sb.exec("echo nope")
    except SandboxError:
        return
    raise AssertionError("exec on a closed sandbox did not raise SandboxError")


BAD_ARGUMENTS: list[tuple[str, dict]] = [
    ("empty shell string", {"cmd": ""}),
    ("empty argv", {"cmd": []}),
    ("zero timeout", {"cmd": "echo", "timeout_s": 0}),
    ("negative timeout", {"cmd": "echo", "timeout_s": -1}),
    ("bool timeout", {"cmd": "echo", "timeout_s": True}),
    ("str timeout", {"cmd": "echo", "timeout_s": "5"}),
    ("NaN timeout", {"cmd": "echo", "timeout_s": float("nan")}),
    ("NUL in argv", {"cmd": ["echo", "a\0b"]}),
    ("None in argv", {"cmd": ["echo", None]}),
    ("bytes in argv", {"cmd": ["echo", b"x"]}),
    ("int stdin", {"cmd": ["cat"], "stdin": 5}),
    ("list stdin", {"cmd": ["cat"], "stdin": [b"x"]}),
    ("missing cwd", {"cmd": ["pwd"], "cwd": "no/such/dir"}),
    ("cwd is a file", {"cmd": ["pwd"], "cwd": "cwd-file.txt"}),
    ("NUL in cwd", {"cmd": ["pwd"], "cwd": "a\0b"}),
    ("NUL in env", {"cmd": ["true"], "env": {"A": "x\0y"}}),
    ("lone surrogate in argv", {"cmd": ["echo", "a\udc80b"]}),
    ("lone surrogate in a shell string", {"cmd": "echo \ud800"}),
    ("lone surrogate in cwd", {"cmd": ["pwd"], "cwd": "a\udc80"}),
    ("lone surrogate in env", {"cmd": ["true"], "env": {"A": "x\udc80"}}),
    ("lone surrogate in stdin", {"cmd": ["cat"], "stdin": "x\udc80"}),
]
"""Arguments every backend must refuse with :class:`SandboxError` before running anything."""


@_check()
async def check_bad_arguments(sb: Sandbox) -> None:
    """Bad commands, timeouts, stdin, cwd and env raise SandboxError on every backend (never a result)."""
    await sb.write_file("cwd-file.txt", "x")
    for what, bad in BAD_ARGUMENTS:
        try:
            r = await sb.exec(**bad)
        except SandboxError as exc:
            _expect(str(exc) != "", f"{what}: the error names the problem")
            continue
        raise AssertionError(f"{what}: exec({bad}) returned {r} instead of raising SandboxError")
    r = await sb.exec(["pwd"], cwd=".")
    _expect(r.ok, "the sandbox still works after refusing bad arguments", r)


@_check()
async def check_argument_list_too_long_raises(sb: Sandbox) -> None:
    """An argument list the kernel would refuse (one 200 KB argument, 3 MB of arguments, a 200 KB
    environment value) raises SandboxError saying "argument list too long" on every backend (never
    a raw OSError, never a result); the same data through stdin works."""
    big = "x" * 200_000
    for what, bad in (("one 200 KB argument", {"cmd": ["echo", big]}), ("a 200 KB shell string", {"cmd": f"echo {big}"}),
                      ("3 MB of arguments", {"cmd": ["true", *["y" * 100_000] * 30]}),
                      ("a 200 KB environment value", {"cmd": ["true"], "env": {"BIG": big}})):
        try:
            r = await sb.exec(**bad)
        except SandboxError as exc:
            _expect("argument list too long" in str(exc), f"{what}: the error says argument list too long; got {exc}")
            continue
        raise AssertionError(f"{what}: exec returned {r} instead of raising SandboxError")
    r = await sb.exec(["cat"], stdin=big)
    _expect(r.ok and r.stdout == big[:len(r.stdout)] and len(r.stdout) > 0, "the same data through stdin", r)


@_check()
async def check_large_stdin_and_file(sb: Sandbox) -> None:
    """50 MB of stdin and a 50 MB ``write_file`` arrive whole (no cut-off, no hang to the timeout)."""
    blob = b"0123456789abcdef" * (50 * 2**16)
    r = await sb.exec("sleep 1; cat > in.bin && echo stored", stdin=blob, timeout_s=60)  # a late reader
    _expect(r.ok and r.stdout == "stored\n", "50 MB stdin stored by cat", r)
    r = await sb.exec(["head", "-c", "1000", "in.bin"])
    _expect(r.ok and r.stdout == blob[:1000].decode(), "the stored stdin starts right", r)
    await sb.exec(["rm", "-f", "in.bin"])
    await sb.write_file("file.bin", blob)
    r = await sb.exec(["head", "-c", "1000", "file.bin"])
    _expect(r.ok and r.stdout == blob[:1000].decode(), "the written file starts right", r)
    r = await sb.exec(["true"], stdin=blob, timeout_s=30)
    _expect(r.ok and not r.timed_out, "a command that never reads its 50 MB stdin still ends normally", r)


@_check()
async def check_read_special_files_raise(sb: Sandbox) -> None:
    """``read_file`` of a device, a directory or a FIFO raises SandboxError saying so (never hangs)."""
    for path, why in (("/dev/zero", "not a regular file"), (sb.workdir, "directory")):
        try:
            await sb.read_file(path)
        except SandboxError as exc:
            _expect(why in str(exc), f"read_file({path!r}) error says {why!r}; got {exc}")
            continue
        raise AssertionError(f"read_file({path!r}) did not raise SandboxError")
    made = await sb.exec(["mkfifo", "fifo"])
    if made.exit_code != 0:
        return  # no mkfifo here (the fake): nothing more to check
    t0 = time.monotonic()
    try:
        await sb.read_file("fifo")
    except SandboxError as exc:
        _expect("not a regular file" in str(exc), f"FIFO error says so; got {exc}")
    else:
        raise AssertionError("read_file of a FIFO did not raise SandboxError")
    _expect(time.monotonic() - t0 < 8, "read_file of a FIFO fails at once, not at the io timeout")


@_check()
async def check_cancel_some_of_many(sb: Sandbox) -> None:
    """Cancelling some of many concurrent execs kills only those; the others finish normally."""
    tasks = [asyncio.ensure_future(sb.exec(f"sleep 2; echo done {i}", timeout_s=60)) for i in range(12)]
    await asyncio.sleep(0.5)
    for task in tasks[::2]:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i, r in enumerate(results):
        if i % 2 == 0:
            _expect(isinstance(r, asyncio.CancelledError), f"exec {i} was cancelled; got {r!r}")
        else:
            _expect(isinstance(r, ExecResult) and r.ok and r.stdout == f"done {i}\n", f"innocent exec {i} finished", r)


@_check()
async def check_exec_during_close_raises(sb: Sandbox) -> None:
    """An exec in flight when the sandbox is closed raises SandboxError (never an ordinary result)."""
    task = asyncio.ensure_future(sb.exec("sleep 5; echo late", timeout_s=60))
    await asyncio.sleep(0.5)
    await sb.close()
    try:
        r = await asyncio.wait_for(task, 15)
    except SandboxError as exc:
        _expect("closed" in str(exc), f"the error says the sandbox was closed; got {exc}")
        return
    raise AssertionError(f"exec in flight during close() returned {r} instead of raising SandboxError")


@_check(isolated=True)
async def check_writes_outside_workdir_fail(sb: Sandbox) -> None:
    """The root file system is read-only: only the work dir and /tmp are writable."""
    r = await sb.exec("echo x > /etc/relax-contract-probe")
    _expect(r.exit_code != 0, "shell write to /etc fails", r)
    try:
        await sb.write_file("/usr/relax-contract-probe", "x")
    except SandboxError:
        pass
    else:
        raise AssertionError("write_file outside the work dir did not raise SandboxError")
    r = await sb.exec("echo tmp > /tmp/t.txt && cat /tmp/t.txt")
    _expect(r.stdout == "tmp\n", "/tmp is writable", r)


async def run_check(factory: Factory, name: str) -> None:
    """Run one named check on a fresh sandbox from ``factory`` (closed afterwards)."""
    sb = await factory()
    try:
        await CHECKS[name](sb)
    finally:
        await sb.close()


async def run_contract(factory: Factory, *, isolated: bool = True) -> dict[str, BaseException]:
    """Run every check; returns ``{name: error}`` for the failures (empty when all pass)."""
    failures: dict[str, BaseException] = {}
    for name in CHECKS:
        if name in NEEDS_ISOLATION and not isolated:
            continue
        try:
            await run_check(factory, name)
        except Exception as exc:  # noqa: BLE001 - collected for the report
            failures[name] = exc
    return failures


class SandboxContract:
    """Pytest mixin: subclass it in a ``Test*`` class and implement :meth:`make_sandbox`."""

    isolated: bool = True
    """False for backends without file-system isolation (skips :data:`NEEDS_ISOLATION` checks)."""

    async def make_sandbox(self) -> Sandbox:
        """A fresh sandbox for one check (small ``max_output_bytes`` keeps the checks fast)."""
        raise NotImplementedError

    def test_contract(self, contract_check: str) -> None:
        """Run one contract check (parametrized by the ``contract_check`` fixture) on :meth:`make_sandbox`;
        the isolation checks skip for a backend that does not isolate the file system."""
        if contract_check in NEEDS_ISOLATION and not self.isolated:
            import pytest

            pytest.skip("backend does not isolate the file system")
        asyncio.run(run_check(self.make_sandbox, contract_check))

    def pytest_generate_tests(self, metafunc) -> None:  # noqa: ANN001 - pytest hook
        """Parametrize ``contract_check`` with every check name (pytest calls class-level hooks)."""
        if "contract_check" in metafunc.fixturenames:
            metafunc.parametrize("contract_check", list(CHECKS))


def backend_unavailable(backend: str, image: str = "relax-agent/python:bookworm") -> str | None:
    """Why ``backend`` cannot run on this machine, or None when it can."""
    import shutil

    if backend == "bubblewrap":
        return None if shutil.which("bwrap") else "bubblewrap (bwrap) is not installed"
    if backend != "docker":
        return None
    try:
        import docker

        client = docker.from_env(timeout=10)
        client.ping()
        client.images.get(image)
    except Exception as exc:  # noqa: BLE001 - any failure means: not available
        return f"Docker or image {image!r} unavailable ({type(exc).__name__}: {exc}); run scripts/setup_docker.sh"
    return None


def require_backend(backend: str, image: str = "relax-agent/python:bookworm") -> None:
    """Skip the calling test when ``backend`` is unavailable — but fail it when ``CI=true``,
    so CI can never silently skip the Docker and bubblewrap tests."""
    import pytest

    reason = backend_unavailable(backend, image)
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"CI=true but the {backend} sandbox backend is unavailable: {reason}")
    pytest.skip(reason)
