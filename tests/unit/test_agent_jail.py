"""The agent jail (``rollout.agent.isolation: namespace``), escape by escape, with real agent
processes: each agent tries the escape and reports through its output file's ``metrics`` (1: it got
through); the same agent without a jail (``none``) gets through, so each test can fail."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import socket
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from typing import Literal

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401
from relax_agent.config import AgentConfig, ModelConfig
from relax_agent.errors import ConfigError, SandboxError
from relax_agent.models import load_tokenizer
from relax_agent.rollout import agent_jail
from relax_agent.rollout.agent_cgroups import build_agent_cgroups
from relax_agent.rollout.agent_driver import AgentDriver
from relax_agent.rollout.agent_jail import UID_BASE, UidPool, namespace_refusal, resolve_isolation
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.parsers import build_parser
from tests.unit.test_endpoint_openai import ScriptedEngine

REPO = Path(__file__).resolve().parents[2]
make_env = functools.partial(gymnasium.make, "relax/Calculator-v0", difficulty=1, num_tasks=20)
TASK = make_env().unwrapped.tasks("train")[0]  # type: ignore[attr-defined]

jailed = pytest.mark.skipif(namespace_refusal() is not None, reason=f"no jail here: {namespace_refusal()}")

REPORT = """
import json, os
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
OpenAI().chat.completions.create(model="policy", messages=task["messages"], tools=task["tools"])
json.dump({"reward": 0.0, "metrics": got}, open(os.environ["RELAX_OUTPUT_FILE"], "w"))
"""
"""Appended to each escape: one request through the endpoint (the episode's own service stays
reachable), then the report."""


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


def _driver(tok, folder: Path, escape: str, isolation: Literal["namespace", "none"],
            env: dict[str, str]) -> AgentDriver:
    (folder / "agent.py").write_text(textwrap.dedent(escape) + REPORT)
    ids = tok("hi", add_special_tokens=False)["input_ids"] + [2]
    return AgentDriver(make_env, ScriptedEngine(ids), ChatRenderer(tok), build_parser("hermes"),
                       AgentConfig(command=["{python}", str(folder / "agent.py")], timeout_s=120.0,
                                   isolation=isolation, reward="agent", env=env))


def _play_all(driver: AgentDriver, n: int = 1):
    specs = [EpisodeSpec(f"s/{i}", "s", TASK["id"], TASK, seed=i) for i in range(n)]

    async def run():
        return await asyncio.gather(*(driver.play(s, SamplingParams(max_new_tokens=8)) for s in specs))

    try:
        trajs = asyncio.run(run())
    finally:
        driver.close()
    assert [t.error for t in trajs] == [None] * n
    return [{k.removeprefix("agent/"): v for k, v in t.metrics.items() if k.removeprefix("agent/") in GOT} for t in trajs]


GOT = ("repo", "venv", "run", "ray", "other_key", "other_dir", "service", "shm_other")

WRITES = """
import os
got = {}
for name, path in [("repo", os.environ["REPO_FILE"]), ("venv", os.environ["VENV_FILE"]),
                   ("run", os.environ["RUN_FILE"]), ("ray", os.environ["RAY_FILE"])]:
    try:
        open(path, "a").close()  # opened for writing, nothing written
        got[name] = 1.0
    except (PermissionError, FileNotFoundError):
        got[name] = 0.0
"""


@jailed
@pytest.mark.parametrize("isolation", ["namespace", "none"])
def test_a_jailed_agent_cannot_write_the_code_the_venv_or_the_run_directory(tok, open_dir, isolation):
    """Also a file in a world-writable directory under /tmp, as Ray's session directories are
    (``/tmp/ray/session_*``, mode 0777, its sockets in them): the jail's /tmp does not show it."""
    run_dir = open_dir / "run"  # root-owned, mode 0755, as a run's output directory
    run_dir.mkdir(mode=0o755)
    (run_dir / "metrics.jsonl").write_text("")
    venv_file = Path(sys.executable).resolve().parents[1] / "pyvenv.cfg"
    if not venv_file.exists():
        venv_file = Path(os.__file__)
    ray_dir = Path(tempfile.mkdtemp(prefix="relax-jail-test-session-"))
    ray_dir.chmod(0o777)
    env = {"REPO_FILE": str(REPO / "pyproject.toml"), "VENV_FILE": str(venv_file),
           "RUN_FILE": str(run_dir / "metrics.jsonl"), "RAY_FILE": str(ray_dir / "planted.py")}
    try:
        [got] = _play_all(_driver(tok, open_dir, WRITES, isolation, env))
    finally:
        shutil.rmtree(ray_dir)
    expected = 0.0 if isolation == "namespace" else 1.0
    assert got == {"repo": expected, "venv": expected, "run": expected, "ray": expected}


STEAL = """
import json, os, time
me, shared = os.environ["OPENAI_API_KEY"], os.environ["SHARED"]
open(os.path.join(os.environ["TMPDIR"], "key"), "w").write(me)
mine = os.path.join(shared, "dir-" + me[-8:])
open(mine, "w").write(os.environ["TMPDIR"])
os.chmod(mine, 0o644)  # the path is shared on purpose: the directory must hold by itself
deadline = time.time() + 60
while len(os.listdir(shared)) < 2 and time.time() < deadline:
    time.sleep(0.1)
[other] = [open(os.path.join(shared, f)).read() for f in os.listdir(shared) if f != os.path.basename(mine)]
got = {}
try:
    got["other_key"] = float(open(os.path.join(other, "key")).read().startswith("relax-"))
except OSError:
    got["other_key"] = 0.0
try:
    got["other_dir"] = float(len(os.listdir(other)) > 0)
except OSError:
    got["other_dir"] = 0.0
time.sleep(1.0)  # both read before either leaves
"""


@jailed
@pytest.mark.parametrize("isolation", ["namespace", "none"])
def test_an_agent_cannot_read_another_episodes_private_directory_or_key_file_even_knowing_its_path(
        tok, open_dir, isolation):
    shared = open_dir / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    got = _play_all(_driver(tok, open_dir, STEAL, isolation, {"SHARED": str(shared)}), n=2)
    expected = 0.0 if isolation == "namespace" else 1.0
    assert got == [{"other_key": expected, "other_dir": expected}] * 2


REACH = """
import os, socket
got = {}
try:
    socket.create_connection(("127.0.0.1", int(os.environ["SERVICE_PORT"])), timeout=10).close()
    got["service"] = 1.0
except OSError:
    got["service"] = 0.0
"""


@jailed
@pytest.mark.parametrize("isolation", ["namespace", "none"])
def test_a_jailed_agent_reaches_its_endpoint_and_no_other_loopback_service(tok, open_dir, isolation):
    """A listener on 127.0.0.1 stands for the run's other services (the trainer's weight port, Ray's
    GCS, the control endpoint); the agent's own request goes through (the episode has its turn)."""
    with socket.create_server(("127.0.0.1", 0)) as service:
        port = service.getsockname()[1]
        driver = _driver(tok, open_dir, REACH, isolation, {"SERVICE_PORT": str(port)})
        [got] = _play_all(driver)
    assert got == {"service": 0.0 if isolation == "namespace" else 1.0}


SHM = """
import os
got = {}
try:
    open("/dev/shm/" + os.environ["SHM_NAME"]).close()
    got["shm_other"] = 1.0
except FileNotFoundError:
    got["shm_other"] = 0.0
"""


@jailed
@pytest.mark.parametrize("isolation", ["namespace", "none"])
def test_a_jailed_agent_has_a_dev_shm_of_its_own(tok, open_dir, isolation):
    name = f"relax-jail-test-{uuid.uuid4().hex}"
    planted = Path("/dev/shm") / name
    planted.write_text("left by another process")
    planted.chmod(0o644)
    try:
        [got] = _play_all(_driver(tok, open_dir, SHM, isolation, {"SHM_NAME": name}))
    finally:
        planted.unlink()
    assert got == {"shm_other": 0.0 if isolation == "namespace" else 1.0}


@jailed
def test_an_agent_program_the_jail_cannot_read_is_a_failed_record_naming_the_directory(tok, tmp_path):
    """pytest's own ``tmp_path`` is reachable by root only."""
    (tmp_path / "agent.py").write_text("print('never runs')")
    ids = tok("hi", add_special_tokens=False)["input_ids"] + [2]
    driver = AgentDriver(make_env, ScriptedEngine(ids), ChatRenderer(tok), build_parser("hermes"),
                         AgentConfig(command=["{python}", str(tmp_path / "agent.py")], isolation="namespace"))
    try:
        traj = asyncio.run(driver.play(EpisodeSpec("s/0", "s", TASK["id"], TASK, seed=0),
                                       SamplingParams(max_new_tokens=8)))
    finally:
        driver.close()
    blocked = next(str(p) for p in reversed(tmp_path.parents) if not p.stat().st_mode & 0o001)
    assert (f"cannot read {tmp_path / 'agent.py'}: it runs as an unprivileged uid and {blocked} is not open to "
            "others: make it readable by all; or set rollout.agent.isolation=none") in traj.error


@jailed
def test_an_agent_program_directly_in_tmp_is_a_failed_record_saying_to_move_it(tok):
    program = Path(tempfile.mkstemp(prefix="relax-jail-test-", suffix=".py")[1])
    program.chmod(0o644)
    ids = tok("hi", add_special_tokens=False)["input_ids"] + [2]
    driver = AgentDriver(make_env, ScriptedEngine(ids), ChatRenderer(tok), build_parser("hermes"),
                         AgentConfig(command=["{python}", str(program)], isolation="namespace"))
    try:
        traj = asyncio.run(driver.play(EpisodeSpec("s/0", "s", TASK["id"], TASK, seed=0),
                                       SamplingParams(max_new_tokens=8)))
    finally:
        driver.close()
        program.unlink()
    assert f"cannot read {program}: its /tmp of its own shows only directories under /tmp" in traj.error


def test_auto_falls_back_with_a_warning_naming_what_is_missing(monkeypatch, caplog):
    monkeypatch.setattr(agent_jail, "namespace_refusal", lambda: "setpriv not found (util-linux)")
    with caplog.at_level(logging.WARNING, logger="relax_agent.rollout"):
        assert resolve_isolation("auto") == "none"
    assert "setpriv not found (util-linux)" in caplog.text
    with pytest.raises(ConfigError, match="isolation='namespace' cannot run here: setpriv not found"):
        resolve_isolation("namespace")


def test_running_episodes_hold_distinct_uids_and_a_released_uid_comes_back_last():
    pool = UidPool(base=UID_BASE, count=3)
    held = [pool.acquire() for _ in range(3)]
    assert held == [UID_BASE, UID_BASE + 1, UID_BASE + 2]
    with pytest.raises(RuntimeError, match="more than 3 jailed agents at once: no free uid"):
        pool.acquire()
    pool.release(held[1])
    pool.release(held[0])
    assert [pool.acquire(), pool.acquire()] == [held[1], held[0]]

    fresh = UidPool(base=UID_BASE, count=3)
    first = fresh.acquire()
    fresh.release(first)
    assert [fresh.acquire(), fresh.acquire(), fresh.acquire()] == [UID_BASE + 1, UID_BASE + 2, first]


def _limited(tok, folder: Path, escape: str, isolation: Literal["namespace", "none"], **limits) -> AgentDriver:
    (folder / "agent.py").write_text(textwrap.dedent(escape))
    ids = tok("hi", add_special_tokens=False)["input_ids"] + [2]
    return AgentDriver(make_env, ScriptedEngine(ids), ChatRenderer(tok), build_parser("hermes"),
                       AgentConfig(command=["{python}", str(folder / "agent.py")], timeout_s=120.0,
                                   isolation=isolation, reward="agent", **limits))


def _no_limits() -> str | None:
    try:
        build_agent_cgroups(64, 64).close()
    except SandboxError as exc:
        return str(exc)
    return None


limited = pytest.mark.skipif(namespace_refusal() is not None or _no_limits() is not None,
                             reason=f"no jail or no cgroups here: {namespace_refusal() or _no_limits()}")

HOG = """
import json, os
json.dump({"reward": 0.0}, open(os.environ["RELAX_OUTPUT_FILE"], "w"))
hog = bytearray(512 * 2**20)  # 512 MiB, every page touched
"""


@limited
def test_a_memory_hog_is_killed_and_its_episode_fails_naming_the_limit(tok, open_dir):
    [traj] = [_play_once(_limited(tok, open_dir, HOG, "namespace", memory_limit_mb=128))]
    assert traj.error is not None and "rollout.agent.memory_limit_mb=128: the kernel killed 1 of its" in traj.error


FORK_BOMB = """
import json, os, signal, time
kids, refused = [], 0.0
while len(kids) < 200:
    try:
        pid = os.fork()
    except BlockingIOError:
        refused = 1.0
        break
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    kids.append(pid)
n = len(kids)
for pid in kids:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
OpenAI().chat.completions.create(model="policy", messages=task["messages"], tools=task["tools"])
json.dump({"reward": 0.0, "metrics": {"forked": n, "refused": refused}}, open(os.environ["RELAX_OUTPUT_FILE"], "w"))
"""
"""Forks until refused (or 200 children), kills them, makes its request and reports."""


@limited
@pytest.mark.parametrize("isolation", ["namespace", "none"])
def test_a_fork_bomb_stops_at_max_processes(tok, open_dir, isolation):
    traj = _play_once(_limited(tok, open_dir, FORK_BOMB, isolation, max_processes=32))
    got = {k: v for k, v in traj.metrics.items() if k in ("agent/forked", "agent/refused")}
    if isolation == "namespace":  # the jail's first process and the agent count too
        assert got["agent/refused"] == 1.0 and 16 <= got["agent/forked"] <= 30, got
    else:
        assert got == {"agent/forked": 200.0, "agent/refused": 0.0}


def _play_once(driver: AgentDriver):
    try:
        return asyncio.run(driver.play(EpisodeSpec("s/0", "s", TASK["id"], TASK, seed=0),
                                       SamplingParams(max_new_tokens=8)))
    finally:
        driver.close()


def test_cgroup_v2_without_delegated_controllers_is_refused_naming_them(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cgroup.subtree_control").write_text("cpu\n")
    membership = tmp_path / "self-cgroup"
    membership.write_text("0::/job\n")
    with pytest.raises(SandboxError, match=r"job does not delegate memory and pids to its children "
                                           r"\(cgroup.subtree_control: cpu\)"):
        build_agent_cgroups(64, 64, root=tmp_path, self_cgroup=str(membership))


HANG_UP = """
import json, os, time
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
OpenAI().chat.completions.create(model="policy", messages=task["messages"], max_tokens=1)
try:
    OpenAI(timeout=2.0, max_retries=0).chat.completions.create(model="policy", messages=task["messages"])
except Exception:  # timed out: hung up mid-reply
    pass
time.sleep(40)  # still running while the endpoint sees the hang-up
json.dump({"reward": 0.0}, open(os.environ["RELAX_OUTPUT_FILE"], "w"))
"""


@jailed
def test_a_jailed_agent_that_hangs_up_aborts_its_generation_while_it_still_runs(tok, open_dir):
    """The endpoint sees the hang-up of a non-streamed request through the jail's forwarder: the reply
    (300 tokens, 0.1 s each) is aborted after the endpoint's 10 s grace while the agent sleeps, not
    at its end nor when the episode ends."""
    (open_dir / "agent.py").write_text(HANG_UP)
    engine = ScriptedEngine(tok("word " * 300, add_special_tokens=False)["input_ids"], delay_s=0.1)
    driver = AgentDriver(make_env, engine, ChatRenderer(tok), build_parser("hermes"),
                         AgentConfig(command=["{python}", str(open_dir / "agent.py")], timeout_s=120.0,
                                     isolation="namespace", reward="agent"))

    async def run():
        play = asyncio.ensure_future(driver.play(EpisodeSpec("s/0", "s", TASK["id"], TASK, seed=0),
                                                 SamplingParams(max_new_tokens=300)))
        while engine.cancelled == 0 and not play.done():
            await asyncio.sleep(0.05)
        aborted_while_running = not play.done()
        return aborted_while_running, await play

    try:
        aborted_while_running, traj = asyncio.run(run())
    finally:
        driver.close()
    assert aborted_while_running and engine.cancelled == 1 and traj.error is None
