"""Bubblewrap isolation and limits (real bwrap; fails instead of skipping when CI=true)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import textwrap

import pytest

from relax_agent.sandboxes import SandboxConfig
from relax_agent.sandboxes.testing import require_backend


def _run(code: str, **cfg):
    require_backend("bubblewrap")

    async def body():
        async with await SandboxConfig(backend="bubblewrap", **cfg).build().create() as sb:
            return await sb.run_python(textwrap.dedent(code), timeout_s=10), sb.host_dir

    return asyncio.run(body())


def test_no_network_no_host_secrets_not_root():
    r, host_dir = _run("""
        import os, socket
        print(os.getuid(), sorted(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') else ['lo'])
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=2)
            print("CONNECTED")
        except OSError as exc:
            print("blocked", exc.errno)
        print(os.path.exists('/etc/shadow'), os.path.exists('/root'), os.path.exists('/home'))
        print(sorted(os.listdir('/')))
    """)
    assert r.ok, r
    uid_line, net_line, paths_line, root_line = r.stdout.splitlines()
    assert uid_line.startswith("65534") and net_line.startswith("blocked")
    assert paths_line == "False False False"
    assert "home" not in root_line and "root" not in root_line
    assert not os.path.exists(host_dir), "the host work dir is removed on close"


def test_process_limit_bounds_forks():
    r, _ = _run("""
        import os, time
        n = 0
        try:
            for _ in range(200):
                if os.fork() == 0:
                    time.sleep(2)
                    os._exit(0)
                n += 1
        except OSError as exc:
            print("fork failed after", n, exc.errno)
    """, pids_limit=16)
    assert "fork failed after" in r.stdout, r
    assert int(r.stdout.split()[3]) < 16


def test_memory_and_file_size_limits():
    r, _ = _run("x = bytearray(400 * 2**20)", memory_mb=128)
    assert r.exit_code == 1 and "MemoryError" in r.stderr, r
    r, _ = _run("open('big', 'wb').write(b'x' * (3 * 2**20))", workdir_mb=1)
    assert r.exit_code != 0 and ("File too large" in r.stderr or r.exit_code == 128 + 25), r


def test_processes_do_not_outlive_their_command():
    require_backend("bubblewrap")

    async def body():
        async with await SandboxConfig(backend="bubblewrap").build().create() as sb:
            r = await sb.exec("(sleep 1 && echo late > late.txt) > /dev/null 2>&1 &\necho started")
            await asyncio.sleep(1.5)
            return r, await sb.exec(["cat", "late.txt"])

    started, late = asyncio.run(body())
    assert started.stdout == "started\n" and late.exit_code != 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start processes as another uid")
def test_process_limit_is_per_sandbox_not_per_host_uid():
    import subprocess

    require_backend("bubblewrap")
    uid, gid = SandboxConfig().uid_gid
    others = [subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "sleep", "30"])
              for _ in range(40)]
    try:
        r, _ = _run("print('ok')", pids_limit=16)
        assert r.stdout == "ok\n", "40 other processes of the same host uid do not eat this sandbox's budget"
    finally:
        for p in others:
            p.kill()
            p.wait()


DETACHED_BOMB = """
    import os, time
    for escape in (False, True):
        if os.fork() == 0:
            os.close(1); os.close(2)
            if escape:
                os.setsid()
            while True:
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.05)
    print("parent done")
"""


def test_detached_fork_bomb_ends_with_its_exec():
    require_backend("bubblewrap")

    async def body():
        async with await SandboxConfig(backend="bubblewrap", pids_limit=32).build().create() as sb:
            bomb = await sb.run_python(textwrap.dedent(DETACHED_BOMB), timeout_s=10)
            await asyncio.sleep(1.0)
            alive = await sb.exec("echo alive")
            return bomb, alive, sb.host_dir

    bomb, alive, host_dir = asyncio.run(body())
    assert bomb.stdout == "parent done\n" and alive.stdout == "alive\n", (bomb, alive)
    leftovers = subprocess.run(["pgrep", "-f", "os.fork"], capture_output=True, text=True).stdout.split()
    assert leftovers == [], f"fork-bomb processes outlived their exec on the host: {leftovers}"


def test_caller_env_never_reaches_host_side_helpers(tmp_path):
    require_backend("bubblewrap")
    evil, ld_out = tmp_path / "evil-bin", tmp_path / "ld-debug"
    evil.mkdir()
    ld_out.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(ld_out, 0o777)  # writable for bwrap after setpriv drops to nobody
    ran = tmp_path / "host-helper-ran"
    for name in ("setpriv", "bwrap", "prlimit", "timeout"):
        script = evil / name
        script.write_text(f"#!/bin/sh\ntouch {ran}\nexec /usr/bin/{name} \"$@\"\n")
        script.chmod(0o755)
    env = {"PATH": f"{evil}:/usr/bin:/bin", "LD_DEBUG": "files", "LD_DEBUG_OUTPUT": str(ld_out / "ld")}

    async def body():
        async with await SandboxConfig(backend="bubblewrap").build().create() as sb:
            return await sb.exec(["printenv", "PATH", "LD_DEBUG"], env=env)

    r = asyncio.run(body())
    assert not ran.exists(), "a caller's PATH chose a host-side helper binary"
    assert sorted(os.listdir(ld_out)) == [], "a caller's LD_* variables reached host-side processes"
    assert r.ok and "needed by /usr/bin/bwrap" not in r.stdout + r.stderr, r
    assert f"{env['PATH']}\nfiles\n" in r.stdout, "the jail still gets the caller's env"


KEEPER = """
import asyncio, sys, time
from relax_agent.sandboxes import SandboxConfig

async def main():
    sb = await SandboxConfig(backend="bubblewrap").build().create()
    await sb.write_file("x.txt", "x")
    print(sb.host_dir, flush=True)
    time.sleep(60)

asyncio.run(main())
"""


def test_work_dirs_left_by_a_sigkilled_process_are_reaped():
    import signal
    import sys

    require_backend("bubblewrap")
    dead = subprocess.Popen([sys.executable, "-c", KEEPER], stdout=subprocess.PIPE, text=True)
    alive = subprocess.Popen([sys.executable, "-c", KEEPER], stdout=subprocess.PIPE, text=True)
    try:
        dead_dir, alive_dir = dead.stdout.readline().strip(), alive.stdout.readline().strip()
        assert os.path.isdir(dead_dir) and os.path.isdir(alive_dir)
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert os.path.isdir(dead_dir), "nothing in the killed process could remove its work dir"
        SandboxConfig(backend="bubblewrap").build()  # a new backend reaps work dirs of dead owners
        assert not os.path.exists(dead_dir), "the work dir of a SIGKILLed owner was not reaped"
        assert os.path.isdir(alive_dir), "a live owner's work dir was removed"
    finally:
        for proc in (dead, alive):
            proc.kill()
            proc.wait(10)
        import shutil

        shutil.rmtree(dead_dir if "dead_dir" in locals() else "/nonexistent", ignore_errors=True)
        shutil.rmtree(alive_dir if "alive_dir" in locals() else "/nonexistent", ignore_errors=True)
