"""The OpenEnv bridge (``relax/OpenEnv-v0``, env.id ``"openenv:<target>"``) against real openenv-core servers.

The servers are local processes on 127.0.0.1 serving ``tests/e2e/data/openenv_guess.py`` (a guessing game built
with openenv-core's ``create_app``): rewards through the bridge equal openenv's own client's, episodes are
separate WebSocket sessions, closing an env closes its session on the server, and the server processes the
bridge starts are stopped (last close, keep-alive expiry, interpreter exit, a killed parent)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

import relax_agent.envs as envs
from relax_agent.envs.bridges import openenv_server
from relax_agent.envs.bridges.openenv import available, target_kind
from relax_agent.envs.bridges.openenv_wire import action_tool, observation_text, text_field_of
from relax_agent.errors import ConfigError, EnvError
from tests.e2e.data.openenv_guess import score, secret_for

REPO = Path(__file__).resolve().parents[2]
TEXT = "tests.e2e.data.openenv_guess:app"
TOOL = "tests.e2e.data.openenv_guess:tool_app"
CLASS = "tests.e2e.data.openenv_guess:GuessToolEnvironment"
FAST = {"keep_alive_s": 0.0, "num_tasks": 50}
server_test = pytest.mark.slow


def _make(target: str, **kwargs):
    return envs.make(f"openenv:{target}", **{**FAST, **kwargs})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(") ", 1)[1][0] != "Z"


def _wait(cond, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.1)


def _sessions(url: str) -> dict:
    return httpx.get(f"{url}/debug/sessions", timeout=30, trust_env=False).json()


def _secret_seed(tasks: list[dict], secret: int) -> int:
    return next(t["seed"] for t in tasks if secret_for(t["seed"]) == secret)


@pytest.fixture(scope="module")
def text_server():
    server = openenv_server.acquire(TEXT, max_sessions=64, keep_alive_s=0.0, start_timeout_s=300)
    yield server
    openenv_server.release(server)


@pytest.fixture(scope="module")
def tool_server():
    server = openenv_server.acquire(TOOL, max_sessions=64, keep_alive_s=0.0, start_timeout_s=300)
    yield server
    openenv_server.release(server)


# -- no server needed ---------------------------------------------------------------------------
def test_targets_parse_into_url_module_or_installed_name():
    assert target_kind("http://127.0.0.1:8000/") == ("url", "http://127.0.0.1:8000")
    assert target_kind("ws://127.0.0.1:9/") == ("url", "http://127.0.0.1:9")
    assert target_kind("my_envs.guess:app") == ("module", "my_envs.guess:app")
    assert target_kind("echo-env") == ("name", "echo")
    with pytest.raises(ConfigError, match="expected an OpenEnv server URL"):
        target_kind(" ")
    with pytest.raises(ConfigError, match=r"expected http://HOST:PORT"):
        target_kind("http://")


def test_bad_targets_and_arguments_are_config_errors():
    with pytest.raises(ConfigError, match=r"no installed OpenEnv environment 'nope' \(installed: .*\)"):
        envs.make("openenv:nope")
    with pytest.raises(ConfigError, match=r"module 'no_such_pkg.envs' is not importable \(ModuleNotFoundError: No module named 'no_such_pkg'"):
        envs.make("openenv:no_such_pkg.envs:app")
    with pytest.raises(ConfigError, match=r"expected '<module>:<app or Environment class>'"):
        envs.make("openenv:my envs:app")
    for kwargs, match in (({"num_tasks": 0}, r"num_tasks=0; expected an integer >= 1"),
                          ({"timeout_s": 0}, r"timeout_s=0; expected a number of seconds > 0"),
                          ({"keep_alive_s": -1}, r"keep_alive_s=-1; expected a number >= 0"),
                          ({"tool_name": "a b"}, r"tool_name='a b'"),
                          ({"num_tasks": 1, "split": "heldout"}, r"leaves no 'heldout' task")):
        with pytest.raises(ConfigError, match=match):
            _make(TEXT, **kwargs)


def test_a_missing_package_names_the_extra_for_local_targets(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv", None)
    for target in (TEXT, "echo"):
        with pytest.raises(ConfigError, match=r"pip install 'relax-agent\[openenv\]'"):
            envs.make(f"openenv:{target}")
    with pytest.raises(ConfigError, match=r"relax-agent\[openenv\]"):
        available()
    envs.make("openenv:http://127.0.0.1:9").close()  # a URL needs only websockets: made without openenv


def test_tasks_are_seeds_split_disjointly_and_deterministically():
    env = _make(TEXT)
    try:
        train, heldout = env.unwrapped.tasks("train"), env.unwrapped.tasks("heldout")
        assert sorted(t["seed"] for t in train + heldout) == list(range(50))
        assert {t["id"] for t in train}.isdisjoint(t["id"] for t in heldout) and heldout
        assert all(t["id"] == f"seed-{t['seed']}" for t in train)
        assert _make(TEXT).unwrapped.tasks("heldout") == heldout
        assert env.unwrapped.server_pid is None  # listing tasks starts no server
    finally:
        env.close()


def test_observations_and_actions_map_by_their_schema():
    assert observation_text({"echoed_message": "hi", "message_length": 2}) == "hi"  # the echo env
    assert observation_text({"board": [[0, 1]], "turn": 2}) == '{"board": [[0, 1]], "turn": 2}'
    assert observation_text({"a": "x", "b": "y"}) == '{"a": "x", "b": "y"}'
    assert observation_text({"a": "x", "b": 3}, ["b"]) == "3" and observation_text({"a": "x", "b": 3}, ["a"]) == "x"
    assert observation_text({"a": "x", "b": 3, "c": 1}, ["b", "a"]) == '{"a": "x", "b": 3}'
    message = {"properties": {"metadata": {"type": "object"}, "message": {"type": "string"}}, "required": ["message"]}
    assert text_field_of(message) == "message"
    structured = {"title": "GuessToolAction", "description": "Guess.", "required": ["guess"],
                  "properties": {"metadata": {"type": "object"}, "guess": {"type": "integer"}, "note": {"type": "string"}}}
    assert text_field_of(structured) is None
    assert action_tool(structured, "act") == {"type": "function", "function": {
        "name": "act", "description": "Guess.", "parameters": {
            "type": "object", "properties": {"guess": {"type": "integer"}, "note": {"type": "string"}},
            "required": ["guess"]}}}


def _fake_install(site: Path) -> None:
    """An ``openenv-guess-env`` distribution (a ``guess_env`` package with ``server/app.py``), as pip would install it."""
    (site / "guess_env" / "server").mkdir(parents=True)
    (site / "guess_env" / "__init__.py").write_text("")
    (site / "guess_env" / "server" / "__init__.py").write_text("")
    (site / "guess_env" / "server" / "app.py").write_text(f"from {TEXT.split(':')[0]} import app  # noqa: F401\n")
    info = site / "openenv_guess_env-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: openenv-guess-env\nVersion: 0.1.0\n")
    (info / "RECORD").write_text("guess_env/__init__.py,,\nguess_env/server/__init__.py,,\nguess_env/server/app.py,,\n")


def test_installed_environment_packages_are_listed_by_name(tmp_path, monkeypatch):
    assert "guess" not in available()  # openenv-core itself ships no environment
    _fake_install(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "guess" in available()


@server_test
def test_an_installed_environment_starts_by_name(tmp_path, monkeypatch):
    _fake_install(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = envs.make("openenv:guess-env", keep_alive_s=0.0)
    try:
        obs, _ = env.reset(options={"task": {"id": "seed-3", "seed": 3}})
        assert "between 1 and 20" in obs[0]["content"]
        assert env.step({"role": "assistant", "content": str(secret_for(3))})[1:3] == (1.0, True)
    finally:
        env.close()


# -- real servers -------------------------------------------------------------------------------
@server_test
@pytest.mark.parametrize("guesses", [["10", "I say 4", "no idea"], ["7", "7", "19", "3"], [None]])
def test_text_rewards_equal_openenvs_own_client(text_server, guesses):
    from openenv.core import GenericEnvClient

    seed = 11
    guesses = [str(secret_for(seed))] if guesses == [None] else guesses
    env = _make(TEXT)
    try:
        assert env.unwrapped.server_pid is None
        env.reset(options={"task": {"id": f"seed-{seed}", "seed": seed}})
        assert env.unwrapped.server_pid == text_server.pid  # the bridge shares the running server
        ours = []
        for text in guesses:
            obs, reward, terminated, truncated, _ = env.step({"role": "assistant", "content": text})
            ours.append((obs[0]["content"], reward, terminated))
            if terminated:
                break
    finally:
        env.close()
    with GenericEnvClient(base_url=text_server.url).sync() as client:
        client.reset(seed=seed)
        theirs = []
        for text in guesses[:len(ours)]:
            result = client.step({"message": text})
            theirs.append((result.observation["text"], float(result.reward), result.done))
    assert ours == theirs
    secret = secret_for(seed)
    from tests.e2e.data.openenv_guess import last_int

    assert [r for _, r, _ in ours] == [score(secret, last_int(g))[0] for g in guesses[:len(ours)]]


@server_test
def test_a_structured_action_is_a_tool_and_scores_as_the_servers_client(tool_server):
    from openenv.core import GenericEnvClient

    seed = 5
    secret = secret_for(seed)
    env = _make(TOOL)
    try:
        _, info = env.reset(options={"task": {"id": f"seed-{seed}", "seed": seed}})
        (tool,) = info["tools"]
        assert tool["function"]["name"] == "act" and tool["function"]["parameters"]["required"] == ["guess"]
        assert set(tool["function"]["parameters"]["properties"]) == {"guess", "note"}

        def call(args, name="act", cid="c1"):
            return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}

        obs, reward, done, _, info = env.step({"role": "assistant", "content": "", "tool_calls": [call({"guess": "x"})]})
        assert obs[0]["content"].startswith("error: the environment refused the action") and reward == 0.0
        assert not done and info["refused"] == 1.0
        wrong = 20 if secret != 20 else 1
        obs, reward, done, _, _ = env.step({"role": "assistant", "content": "", "tool_calls": [
            call({"guess": wrong}), call({"guess": secret}, cid="c2"), call({}, name="other", cid="c3")]})
        assert [m["tool_call_id"] for m in obs] == ["c1", "c2", "c3"]
        assert obs[1]["content"] == "error: one action per turn; this call was not run"
        assert obs[2]["content"] == "error: one action per turn; this call was not run"
        ours = [(obs[0]["content"], reward, done)]
        obs, reward, done, _, _ = env.step({"role": "assistant", "content": "", "tool_calls": [
            call({"guess": secret, "note": "sure"})]})
        ours.append((obs[0]["content"], reward, done))
    finally:
        env.close()
    with GenericEnvClient(base_url=tool_server.url).sync() as client:
        client.reset(seed=seed)
        theirs = [(r.observation["text"], float(r.reward), r.done)
                  for r in (client.step({"guess": wrong}), client.step({"guess": secret, "note": "sure"}))]
    assert ours == theirs and ours[-1][1:] == (1.0, True)

    env = _make(TOOL)
    try:
        env.reset(seed=0)
        assert env.step({"role": "assistant", "content": "no call"})[1:4] == (0.0, True, False)  # gives up
    finally:
        env.close()


@server_test
def test_concurrent_episodes_on_one_server_do_not_mix(text_server):
    tasks = _make(TEXT).unwrapped.tasks("train")
    secrets = [3, 17, 9, 12]
    seeds = [_secret_seed(tasks, s) for s in secrets]
    pairs = [_make(TEXT) for _ in range(2)]
    try:
        for env, seed in zip(pairs, seeds, strict=False):
            env.reset(options={"task": {"id": f"seed-{seed}", "seed": seed}})
        live = _sessions(text_server.url)["live"]
        assert sorted(v["secret"] for v in live.values() if v["secret"] is not None) == [3, 17]
        # each env hears about its own secret: guess 10 is "higher" for 17 and "lower" for 3
        assert pairs[0].step({"role": "assistant", "content": "10"})[0][0]["content"].endswith("lower.")
        assert pairs[1].step({"role": "assistant", "content": "10"})[0][0]["content"].endswith("higher.")
        assert pairs[1].step({"role": "assistant", "content": "17"})[1:3] == (1.0, True)
        assert pairs[0].step({"role": "assistant", "content": "17"})[1] == score(3, 17)[0]
    finally:
        for env in pairs:
            env.close()

    results: dict[int, list[float]] = {}

    def play(secret: int, seed: int) -> None:
        env = _make(TEXT)
        try:
            env.reset(options={"task": {"id": f"seed-{seed}", "seed": seed}})
            low, high, rewards = 1, 20, []
            while True:
                guess = (low + high) // 2
                obs, reward, done, _, _ = env.step({"role": "assistant", "content": str(guess)})
                rewards.append(reward)
                if done:
                    break
                low, high = (guess + 1, high) if "higher" in obs[0]["content"] else (low, guess - 1)
            results[secret] = rewards
        finally:
            env.close()

    threads = [threading.Thread(target=play, args=(s, seed)) for s, seed in zip(secrets, seeds, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for secret in secrets:  # each episode's rewards are those of a binary search for its own secret
        low, high, expected = 1, 20, []
        for _ in range(3):
            guess = (low + high) // 2
            reward, correct, _ = score(secret, guess)
            expected.append(reward)
            if correct:
                break
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)
        assert results[secret] == expected


@server_test
def test_closing_mid_episode_closes_the_session_on_the_server(text_server):
    env = _make(TEXT)
    env.reset(seed=0)
    env.step({"role": "assistant", "content": "1"})
    live = _sessions(text_server.url)["live"]
    (instance,) = [k for k, v in live.items() if v["steps"] == 1]
    env.close()
    _wait(lambda: instance not in _sessions(text_server.url)["live"], "the server to close the session")
    closed = {c["instance"]: c for c in _sessions(text_server.url)["closed"]}
    assert closed[instance]["steps"] == 1
    with pytest.raises(EnvError, match="call reset"):
        env.unwrapped.step({"role": "assistant", "content": "2"})
    env.close()  # idempotent
    with pytest.raises(EnvError, match="is closed; make a new env"):
        env.reset(seed=0)


@server_test
def test_the_last_close_stops_the_server_and_keep_alive_lets_it_expire(monkeypatch):
    first, second = _make(CLASS, max_sessions=2), _make(CLASS, max_sessions=2)
    _, info = first.reset(seed=0)  # an Environment class, served with openenv's create_app
    second.reset(seed=1)
    pid = first.unwrapped.server_pid
    assert pid and second.unwrapped.server_pid == pid and info["tools"][0]["function"]["name"] == "act"
    first.close()
    assert _alive(pid)
    second.close()
    _wait(lambda: not _alive(pid), "the server to stop at the last close", 30)

    monkeypatch.setattr(openenv_server, "GRACE_S", 1.0)
    env = _make(CLASS, keep_alive_s=5.0)
    env.reset(seed=0)
    pid = env.unwrapped.server_pid
    env.close()
    again = _make(CLASS, keep_alive_s=5.0)
    again.reset(seed=0)
    assert again.unwrapped.server_pid == pid  # kept for the next episode
    again.close()
    _wait(lambda: not _alive(pid), "the unused server to exit by itself", 60)


@server_test
def test_a_full_server_makes_reset_wait_for_a_free_session():
    holder = _make(CLASS, max_sessions=1)
    holder.reset(seed=0)
    waiter = _make(CLASS, max_sessions=1, session_wait_s=1.0)
    with pytest.raises(EnvError, match=r"had no free session for 1.0s"):
        waiter.reset(seed=1)
    patient = _make(CLASS, max_sessions=1, session_wait_s=120.0)
    out: list = []
    thread = threading.Thread(target=lambda: out.append(patient.reset(seed=1)))
    thread.start()
    cancelled = _make(CLASS, max_sessions=1, session_wait_s=120.0)
    errors: list[str] = []

    def wait_for_a_session() -> None:
        try:
            cancelled.reset(seed=2)
        except EnvError as exc:
            errors.append(str(exc))

    waiting = threading.Thread(target=wait_for_a_session)
    waiting.start()
    time.sleep(1.0)
    assert not out and not errors  # both still waiting
    cancelled.close()  # an abandoned episode: its reset stops waiting
    waiting.join(60)
    assert errors and "closed" in errors[0]  # "was closed before it opened" (or "is closed", had it not begun yet)
    holder.close()
    thread.join(120)
    assert out and "between 1 and 20" in out[0][0][0]["content"]
    for env in (waiter, patient):
        env.close()


@server_test
def test_dead_slow_or_broken_servers_are_env_errors_naming_the_url(text_server, monkeypatch):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    env = envs.make(f"openenv:{dead}", timeout_s=5)
    with pytest.raises(EnvError, match=rf"OpenEnv server {dead}: GET /schema failed"):
        env.reset(seed=0)
    env.close()
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        env = envs.make(f"openenv:{url}", timeout_s=1)
        with pytest.raises(EnvError, match=rf"OpenEnv server {url} did not answer GET /schema within timeout_s=1"):
            env.reset(seed=0)
        env.close()
    env = envs.make(f"openenv:{text_server.url}", timeout_s=1, num_tasks=50)
    env.reset(seed=0)
    with pytest.raises(EnvError, match=rf"OpenEnv server {text_server.url} did not answer step within timeout_s=1"):
        env.step({"role": "assistant", "content": "sleep:3"})
    env.reset(seed=0)
    with pytest.raises(EnvError, match=r"step failed: the guessing game broke \(code EXECUTION_ERROR\)"):
        env.step({"role": "assistant", "content": "raise"})
    with pytest.raises(EnvError, match="call reset"):  # the failed episode is over
        env.unwrapped.step({"role": "assistant", "content": "1"})
    env.close()
    broken = _make("tests.e2e.data.openenv_guess:no_such_app", start_timeout_s=300)
    with pytest.raises(EnvError, match=r"exited with code 1 before it was ready; its output:\n(.|\n)*AttributeError"):
        broken.reset(seed=0)
    broken.close()


@server_test
def test_a_url_target_works_without_the_openenv_package(text_server, monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv", None)
    env = envs.make(f"openenv:{text_server.url}", num_tasks=50)
    try:
        seed = env.unwrapped.tasks("train")[0]["seed"]
        env.reset(options={"task": {"id": f"seed-{seed}", "seed": seed}})
        assert env.step({"role": "assistant", "content": str(secret_for(seed))})[1:3] == (1.0, True)
    finally:
        env.close()


SCRIPT = """
import os, signal, sys, time
import relax_agent.envs as envs
env = envs.make("openenv:{target}", keep_alive_s=0.0)
env.reset(seed=0)
print(env.unwrapped.server_pid, flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@server_test
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_interpreter_exit_or_a_killed_parent_stops_the_server(how):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT.format(target=TEXT)), how], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == (-9 if how == "kill" else 0), proc.stderr[-2000:]
    pid = int(proc.stdout.split()[0])
    _wait(lambda: not _alive(pid), f"the server of a parent that did {how!r} to stop", 60)
