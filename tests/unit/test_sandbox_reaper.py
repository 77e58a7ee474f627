"""Reaper decisions, owner liveness, exit-time cleanups and the CLI, with a fake Docker client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import docker.errors
import pytest
from typer.testing import CliRunner

from relax_agent.sandboxes import cli, reaper
from relax_agent.sandboxes.reaper import (
    LABEL_CREATED,
    LABEL_EXPIRES,
    LABEL_OWNER,
    LABEL_SANDBOX,
    owner_alive,
    owner_token,
    reap,
    reap_own,
)

NOW = 1_000_000.0


def _dead_pid_token() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    token = owner_token(proc.pid)
    proc.wait()
    return token


class FakeAPI:
    def __init__(self, containers):
        self.items = containers
        self.removed: list[str] = []
        self.fail: dict[str, Exception] = {}

    def containers(self, all=False, filters=None):  # noqa: A002 - docker-py's name
        label = (filters or {}).get("label", "")
        key, _, value = label.partition("=")
        out = [c for c in self.items if key in c["Labels"] and (not value or c["Labels"][key] == value)]
        return [c for c in out if c["Id"] not in self.removed]

    def remove_container(self, cid, force=False):
        assert force
        if cid in self.fail:
            raise self.fail[cid]
        self.removed.append(cid)


class FakeClient:
    def __init__(self, containers):
        self.api = FakeAPI(containers)


def container(cid, run="r1", owner=None, expires=NOW + 100, state="running"):
    labels = {LABEL_SANDBOX: run, LABEL_OWNER: owner or owner_token(), LABEL_CREATED: str(int(NOW - 10)),
              LABEL_EXPIRES: str(int(expires))}
    return {"Id": cid, "Names": [f"/relax-sb-{cid}"], "Labels": labels, "State": state}


def test_owner_liveness():
    assert owner_alive(owner_token()) is True
    assert owner_alive(_dead_pid_token()) is False
    host, pid, ticks, namespace = owner_token().split(":")
    assert owner_alive(f"{host}:{pid}:{int(ticks) + 1}") is False, "a reused pid (other start time) is dead"
    assert owner_alive(f"{host}:{pid}:{ticks}") is True, "a token without a namespace (older label) still works"
    assert owner_alive(f"not-{socket.gethostname()}:1:1") is None, "other hosts are unknown, not dead"
    assert owner_alive("garbage") in (None, False)


def test_reap_removes_dead_expired_and_stopped_only():
    dead = _dead_pid_token()
    client = FakeClient([
        container("live"),
        container("expired", expires=NOW - 1),
        container("dead", owner=dead),
        container("stopped", state="exited"),
        container("elsewhere", owner="other-host:1:1"),
    ])
    reaped = reap(client, now=NOW, dry_run=True)
    assert {r.id: r.reason for r in reaped} == {"expired": "expired", "dead": "owner-dead", "stopped": "stopped"}
    assert client.api.removed == []
    reap(client, now=NOW)
    assert sorted(client.api.removed) == ["dead", "expired", "stopped"]


def test_reap_by_run_id_and_everything():
    client = FakeClient([container("a", run="r1"), container("b", run="r2")])
    assert [r.id for r in reap(client, run_id="r2", now=NOW)] == ["b"]
    assert [r.id for r in reap(client, everything=True, now=NOW)] == ["a"]


def test_reap_own_and_removal_races():
    client = FakeClient([container("mine"), container("theirs", owner="other-host:1:1"), container("gone"),
                         container("busy")])
    client.api.fail["gone"] = docker.errors.NotFound("gone")
    client.api.fail["busy"] = docker.errors.APIError("in progress", response=type("R", (), {"status_code": 409})())
    assert reap_own(client) == 3
    assert client.api.removed == ["mine"]
    client.api.fail["x"] = docker.errors.APIError("boom", response=type("R", (), {"status_code": 500})())
    with pytest.raises(docker.errors.APIError):
        reaper.remove_container(client, "x")


def test_cleanups_run_once_and_swallow_errors():
    calls = []
    reaper.register_cleanup("test-a", lambda: calls.append("a"))
    reaper.register_cleanup("test-b", lambda: 1 / 0)
    reaper.register_cleanup("test-c", lambda: calls.append("c"))
    reaper.unregister_cleanup("test-c")
    reaper.run_cleanups()
    assert calls == ["a"]
    reaper.run_cleanups()
    assert calls == ["a"]


def test_sigterm_handler_respects_an_existing_handler():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert reaper.install_sigterm_handler() is True
        with pytest.raises(SystemExit) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler interrupts this
        assert info.value.code == 128 + signal.SIGTERM

        def mine(signum, frame):
            pass

        signal.signal(signal.SIGTERM, mine)
        assert reaper.install_sigterm_handler() is False
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_cli_reap_lists_and_removes(monkeypatch):
    client = FakeClient([container("old", expires=0), container("live", expires=time.time() + 3600)])
    monkeypatch.setattr(cli, "_client", lambda docker_host: client)
    runner = CliRunner()
    res = runner.invoke(cli.app, ["reap", "--dry-run"])
    assert res.exit_code == 0 and "would remove relax-sb-old (run r1: expired)" in res.output
    assert client.api.removed == []
    res = runner.invoke(cli.app, ["reap"])
    assert res.exit_code == 0 and "removed 1 sandbox container(s)" in res.output and client.api.removed == ["old"]
    res = runner.invoke(cli.app, ["reap", "--all"])
    assert "removed 1" in res.output and client.api.removed == ["old", "live"]


def test_cli_build_image_skips_existing_and_rejects_bad_method(monkeypatch):
    class Images:
        def get(self, name):
            return object()

    client = type("C", (), {"images": Images()})()
    monkeypatch.setattr(cli, "_client", lambda docker_host: client)
    runner = CliRunner()
    res = runner.invoke(cli.app, ["build-image", "--image", "x/y:z"])
    assert res.exit_code == 0 and "x/y:z already exists" in res.output
    res = runner.invoke(cli.app, ["build-image", "--method", "magic"])
    assert res.exit_code != 0 and "magic" in res.output


def test_cli_reap_also_removes_the_work_dirs_of_dead_bubblewrap_owners(monkeypatch, tmp_path):
    import subprocess
    import sys
    import tempfile

    from relax_agent.sandboxes.bubblewrap import WORK_DIR_PREFIX

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    ticks = reaper.start_ticks(proc.pid)
    proc.kill()
    proc.wait(10)  # dead: its pid no longer runs the process that started at those ticks
    dead = tmp_path / f"{WORK_DIR_PREFIX}{proc.pid}-{ticks}-abc"
    alive = tmp_path / f"{WORK_DIR_PREFIX}{os.getpid()}-{reaper.start_ticks(os.getpid())}-def"
    for d in (dead, alive):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "f.txt").write_text("x")
    client = FakeClient([])
    monkeypatch.setattr(cli, "_client", lambda docker_host: client)
    runner = CliRunner()
    res = runner.invoke(cli.app, ["reap", "--dry-run"])
    assert res.exit_code == 0 and f"would remove {dead} (bubblewrap work dir of a dead process)" in res.output
    assert "would remove 1 bubblewrap work dir(s)" in res.output and dead.is_dir()
    res = runner.invoke(cli.app, ["reap", "--all"])
    assert res.exit_code == 0 and "removed 1 bubblewrap work dir(s)" in res.output
    assert not dead.exists() and alive.is_dir()  # a live owner's dir is kept, also with --all
    dead.mkdir()
    res = runner.invoke(cli.app, ["reap", "--backend", "docker"])
    assert res.exit_code == 0 and "bubblewrap" not in res.output and dead.is_dir()
    monkeypatch.setattr(cli, "_client", lambda docker_host: (_ for _ in ()).throw(AssertionError("no Docker")))
    res = runner.invoke(cli.app, ["reap", "--backend", "bubblewrap"])
    assert res.exit_code == 0 and "removed 1 bubblewrap work dir(s)" in res.output and not dead.exists()


def test_an_owner_in_another_pid_namespace_is_unknown_not_dead(tmp_path):
    """A run in a container or sandbox with this hostname has its own pids: another process there with a
    pid that is dead here deleted a live run's bubblewrap work dir and marked its containers for removal."""
    from relax_agent.sandboxes.bubblewrap import reap_work_dirs
    from relax_agent.sandboxes.reaper import pid_namespace

    here = pid_namespace()
    assert here.isdigit() and here != "0"
    host, pid, ticks, _ = _dead_pid_token().split(":")
    other = str(int(here) + 1)
    assert owner_alive(f"{host}:{pid}:{ticks}:{here}") is False
    assert owner_alive(f"{host}:{pid}:{ticks}:{other}") is None
    client = FakeClient([container("theirs", owner=f"{host}:{pid}:{ticks}:{other}"),
                         container("ours-dead", owner=f"{host}:{pid}:{ticks}:{here}")])
    reap(client, now=NOW)
    assert client.api.removed == ["ours-dead"]
    theirs = tmp_path / f"relax-bwrap-{pid}-{ticks}-n{other}-abc"
    ours = tmp_path / f"relax-bwrap-{pid}-{ticks}-n{here}-abc"
    old = tmp_path / f"relax-bwrap-{pid}-{ticks}-xyz"
    for d in (theirs, ours, old):
        d.mkdir()
    assert sorted(reap_work_dirs(str(tmp_path))) == sorted([str(ours), str(old)])
    assert theirs.is_dir() and not ours.exists() and not old.exists()
