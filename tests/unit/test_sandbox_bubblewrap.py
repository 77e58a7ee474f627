"""Bubblewrap isolation and limits (real bwrap; fails instead of skipping when CI=true)."""

from __future__ import annotations

import asyncio
import os
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
