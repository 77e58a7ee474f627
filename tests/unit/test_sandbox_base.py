"""Config validation, Docker hardening defaults, output caps, run_sync, the fake's Python."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

import relax_agent.sandboxes as sandboxes
from relax_agent.errors import SandboxError
from relax_agent.sandboxes import ExecResult, FakeSandbox, SandboxConfig, run_sync
from relax_agent.sandboxes.limits import OutputCap, signal_exit_code


def test_public_api_is_pinned():
    assert sorted(sandboxes.__all__) == [
        "BaseSandbox", "ExecResult", "FakeBackend", "FakeSandbox", "PoolConfig", "PoolStats", "ReportsState",
        "Sandbox", "SandboxBackend", "SandboxConfig", "SandboxPool", "portal_loop", "reap", "run_sync", "shared_pool",
    ]


@pytest.mark.parametrize("kwargs, match", [
    ({"backend": "subprocess"}, "unsafe: true"),
    ({"user": "nobody"}, "numeric 'uid:gid'"),
    ({"workdir": "work"}, "absolute path"),
    ({"timeout_s": 700}, "exceeds sandbox.max_timeout_s"),
    ({"memory_mb": 1}, "memory_mb"),
    ({"bogus": 1}, "bogus"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SandboxConfig(**kwargs)


def test_build_picks_the_backend():
    from relax_agent.sandboxes.fake import FakeBackend
    from relax_agent.sandboxes.local_unsafe import SubprocessBackend

    assert isinstance(SandboxConfig(backend="fake").build(), FakeBackend)
    assert isinstance(SandboxConfig(backend="subprocess", unsafe=True).build(), SubprocessBackend)
    cfg = SandboxConfig(backend="subprocess", unsafe=True)
    object.__setattr__(cfg, "unsafe", False)  # bypass validation: the backend checks again
    with pytest.raises(SandboxError, match="unsafe: true"):
        SubprocessBackend(cfg)


def test_docker_containers_are_hardened_and_labelled():
    from relax_agent.sandboxes.docker import KEEPER_USER, DockerBackend
    from relax_agent.sandboxes.reaper import LABEL_CREATED, LABEL_EXPIRES, LABEL_OWNER, LABEL_SANDBOX, owner_token

    cfg = SandboxConfig(memory_mb=256, cpus=0.5, pids_limit=50, nofile=128, workdir_mb=20, tmp_mb=5, ttl_s=90,
                        run_id="run-7")
    kw = DockerBackend(cfg).container_kwargs("relax-sb-x", now=1000.0)
    assert kw["network_mode"] == "none" and kw["mem_limit"] == kw["memswap_limit"] == "256m"
    assert kw["nano_cpus"] == 500_000_000 and kw["pids_limit"] == 50
    assert kw["ulimits"][0]["Name"] == "nofile" and kw["ulimits"][0]["Hard"] == 128
    assert kw["read_only"] and kw["cap_drop"] == ["ALL"] and kw["security_opt"] == ["no-new-privileges"]
    assert kw["init"] and kw["auto_remove"] and kw["user"] == KEEPER_USER and kw["command"] == ["sleep", "90"]
    assert kw["tmpfs"] == {"/work": "size=20m,uid=65534,gid=65534,mode=0700",
                           "/tmp": "size=5m,uid=65534,gid=65534,mode=1777"}
    assert kw["labels"] == {LABEL_SANDBOX: "run-7", LABEL_OWNER: owner_token(), LABEL_CREATED: "1000",
                            LABEL_EXPIRES: "1090"}
    with pytest.raises(SandboxError, match="keeper"):
        DockerBackend(SandboxConfig(user=KEEPER_USER))


def test_output_cap_and_exit_codes():
    cap = OutputCap(5)
    for chunk in (b"abc", b"def", b"ghi"):
        cap.feed(chunk)
    assert bytes(cap.kept) == b"abcde" and cap.dropped == 4 and cap.truncated
    assert signal_exit_code(-9) == 137 and signal_exit_code(3) == 3
    assert ExecResult(0, "", "").ok and not ExecResult(0, "", "", timed_out=True).ok


def test_run_sync_returns_raises_and_refuses_its_own_loop():
    async def add(a, b):
        await asyncio.sleep(0)
        return a + b

    async def boom():
        raise SandboxError("inner")

    assert run_sync(add(2, 3)) == 5
    with pytest.raises(SandboxError, match="inner"):
        run_sync(boom())

    async def nested():
        return run_sync(add(1, 1), loop=asyncio.get_running_loop())

    with pytest.raises(SandboxError, match="inside its own event loop"):
        asyncio.run(nested())


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_ctrl_c_during_run_sync_cancels_and_cleans_up():
    # Python's own SIGINT handler, whatever earlier tests (Ray, uvicorn) installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    closed = threading.Event()

    async def episode():
        sb = FakeSandbox()
        try:
            await sb.exec(["sleep", "30"], timeout_s=60)
        finally:
            await sb.close()
            closed.set()

    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_sync(episode())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert closed.wait(5) and time.monotonic() - t0 < 5


@pytest.mark.parametrize("code, out", [
    ("print(6 * 7)", "42\n"),
    ("n = 10\nprint(sum(i * i for i in range(1, n + 1)))", "385\n"),
    ("print(max([x % 7 for x in range(20) if x > 3]), 2 ** 10)", "6 1024\n"),
    ("print(factorial(5), gcd(12, 18))", "120 6\n"),
])
def test_fake_python_arithmetic(code, out):
    r = asyncio.run(FakeSandbox().run_python(code))
    assert r.ok and r.stdout == out


def test_fake_python_refuses_what_it_cannot_run():
    r = asyncio.run(FakeSandbox().run_python("import os\nos.system('rm -rf /')"))
    assert r.exit_code == 1 and "FakeSandbox cannot run this Python" in r.stderr
    r = asyncio.run(FakeSandbox().run_python("print(2 ** 10 ** 9)"))
    assert r.exit_code == 1 and "exponent too large" in r.stderr
