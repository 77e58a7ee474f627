"""AgentDriver (``rollout.driver: agent``): the agent runs as a subprocess against the endpoint; its
episode becomes a trajectory scored by the env or by the agent; failures and timeouts are records,
and a timed-out agent leaves no process and no generation running."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401
from relax_agent.config import AgentConfig, ModelConfig
from relax_agent.models import load_tokenizer
from relax_agent.rollout.agent_driver import AgentDriver
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.parsers import build_parser
from tests.unit.test_endpoint_openai import ScriptedEngine

REPO = Path(__file__).resolve().parents[2]
make_env = functools.partial(gymnasium.make, "relax/Calculator-v0", difficulty=1, num_tasks=20)
TASK = make_env().unwrapped.tasks("train")[0]

ONE_CALL = """
import json, os
from openai import OpenAI
task = json.load(open(os.environ["RELAX_TASK_FILE"]))
reply = OpenAI().chat.completions.create(model="policy", messages=task["messages"], tools=task["tools"])
"""


@pytest.fixture
def tmp_path(open_dir):
    """pytest's own tmp_path is reachable by root only: the agents here run as an unprivileged uid."""
    return open_dir


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [2]


def _driver(tok, engine, tmp_path, script: str | None = None, command=None, **cfg):
    if script is not None:
        (tmp_path / "agent.py").write_text(textwrap.dedent(script))
        command = ["{python}", str(tmp_path / "agent.py")]
    return AgentDriver(make_env, engine, ChatRenderer(tok), build_parser("hermes"),
                       AgentConfig(command=command, **{"timeout_s": 60.0, **cfg}))


def _play(driver, seed=0, **spec):
    spec = EpisodeSpec("s/0", "s", TASK["id"], TASK, seed=seed, **spec)
    try:
        return asyncio.run(driver.play(spec, SamplingParams(max_new_tokens=64)))
    finally:
        driver.close()


def test_the_example_agent_solves_a_calculator_task_through_tools(tok, tmp_path):
    a, op, b = TASK["expression"].split()
    name = {"+": "add", "-": "subtract"}[op]
    call = f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    replies = [_ids(tok, call), _ids(tok, f"Answer: {TASK['answer']}")]
    engine = ScriptedEngine(lambda prompt: replies[len(engine.prompts) - 1])
    driver = _driver(tok, engine, tmp_path, command=["{python}", str(REPO / "examples/agents/openai_sdk_agent.py")])
    traj = _play(driver)
    assert traj.error is None, traj.error
    assert traj.reward == 1.0 and traj.metrics["correct"] == 1.0
    assert [list(t.token_ids) for t in traj.turns] == replies
    assert traj.metrics["agent/requests"] == 2.0 and traj.metrics["agent/branches"] == 0.0
    tool_result = [m for m in traj.messages if m["role"] == "tool"]
    assert tool_result and tool_result[0]["content"] == str(TASK["answer"])  # the agent ran the tool itself


def test_the_streaming_example_agent_gives_the_same_trajectory(tok, tmp_path):
    replies = [_ids(tok, f"Answer: {TASK['answer']}")]
    engine = ScriptedEngine(lambda prompt: replies[0], delay_s=0.001)
    driver = _driver(tok, engine, tmp_path, command=["{python}", str(REPO / "examples/agents/streaming_agent.py")])
    traj = _play(driver)
    assert traj.error is None, traj.error
    assert traj.reward == 1.0 and [list(t.token_ids) for t in traj.turns] == replies


def test_the_agent_can_score_itself(tok, tmp_path):
    """Also: ``{python}`` in the command is the interpreter running relax-agent."""
    script = ONE_CALL + ('import sys\nok = sys.executable == ' + repr(sys.executable) + '\n'
                         'json.dump({"reward": 0.25 if ok else -1.0, "metrics": {"steps": 3}}, '
                         'open(os.environ["RELAX_OUTPUT_FILE"], "w"))\n')
    driver = _driver(tok, ScriptedEngine(_ids(tok, "hi")), tmp_path, script, reward="agent")
    traj = _play(driver)
    assert traj.error is None and traj.reward == 0.25 and traj.metrics["agent/steps"] == 3.0


def test_an_answer_in_the_output_file_is_what_the_env_scores(tok, tmp_path):
    script = ONE_CALL + ('json.dump({"answer": "Answer: " + str(task["metadata"]["answer"])}, '
                         'open(os.environ["RELAX_OUTPUT_FILE"], "w"))\n')
    traj = _play(_driver(tok, ScriptedEngine(_ids(tok, "no idea")), tmp_path, script, task_keys=["answer"]))
    assert traj.error is None and traj.reward == 1.0


@pytest.mark.parametrize("script, cause", [
    (ONE_CALL + "import sys; sys.stderr.write('boom at line 7'); sys.exit(3)\n", "agent exited with code 3; its stderr ends: boom at line 7"),
    ("pass\n", "the agent made no chat completion requests"),
    (ONE_CALL + 'open(os.environ["RELAX_OUTPUT_FILE"], "w").write("[1, 2")\n', "RELAX_OUTPUT_FILE is not valid JSON"),
])
def test_agent_failures_are_failed_records(tok, tmp_path, script, cause):
    traj = _play(_driver(tok, ScriptedEngine(_ids(tok, "hi")), tmp_path, script))
    assert traj.reward_status == "error" and not traj.trainable
    assert cause in traj.error


def test_agent_reward_mode_without_a_reward_is_a_failed_record(tok, tmp_path):
    traj = _play(_driver(tok, ScriptedEngine(_ids(tok, "hi")), tmp_path, ONE_CALL, reward="agent"))
    assert traj.reward_status == "error" and "needs a finite number 'reward'" in traj.error


def test_a_command_that_cannot_start_is_a_failed_record(tok, tmp_path):
    traj = _play(_driver(tok, ScriptedEngine(_ids(tok, "hi")), tmp_path, command=[str(tmp_path / "missing")]))
    assert traj.reward_status == "error" and "could not start" in traj.error


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _marked(marker: str) -> list[int]:
    """Live host pids whose command line holds ``marker`` (a jailed agent sees other pids)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace") and _alive(int(entry.name)):
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def test_a_timed_out_agent_leaves_no_process_and_no_generation(tok, tmp_path):
    marker = f"300.{os.getpid()}{time.monotonic_ns() % 10**6}"
    started = tmp_path / "started"
    script = ("import json, os, subprocess\n"
              f"child = subprocess.Popen(['sleep', {marker!r}])\n"
              f"open({str(started)!r}, 'w').write('1')\n") + ONE_CALL
    engine = ScriptedEngine(_ids(tok, "never finished " * 20), delay_s=5.0)
    driver = _driver(tok, engine, tmp_path, script, timeout_s=10.0, kill_grace_s=0.5)
    traj = _play(driver)
    assert len(engine.prompts) == 1, "the agent did not reach its request within timeout_s"
    assert traj.reward_status == "timeout" and "rollout.agent.timeout_s=10.0" in traj.error, traj.error
    assert engine.cancelled == 1  # the generation in flight was aborted before play() returned
    assert started.exists()
    deadline = time.monotonic() + 10
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked(marker) == [] and _marked(str(tmp_path / "agent.py")) == []


def test_the_session_key_dies_with_the_episode(tok, tmp_path):
    keys = tmp_path / "key"
    script = ONE_CALL + f'open({str(keys)!r}, "w").write(os.environ["OPENAI_API_KEY"] + " " + os.environ["OPENAI_BASE_URL"])\n'
    driver = _driver(tok, ScriptedEngine(_ids(tok, "hi")), tmp_path, script)
    spec = EpisodeSpec("s/0", "s", TASK["id"], TASK, seed=0)

    async def main():
        await driver.play(spec, SamplingParams(max_new_tokens=8))
        import httpx

        key, url = keys.read_text().split()
        async with httpx.AsyncClient() as client:
            r = await client.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        return r

    try:
        r = asyncio.run(main())
    finally:
        driver.close()
    assert r.status_code == 401


def test_the_agent_gets_no_ground_truth_and_a_clean_private_environment(tok, tmp_path, monkeypatch):
    seen = tmp_path / "seen.json"
    script = ONE_CALL + f"""
import stat, tempfile
mode = stat.S_IMODE(os.stat(os.environ["TMPDIR"]).st_mode)
json.dump({{"task": open(os.environ["RELAX_TASK_FILE"]).read(), "env": dict(os.environ),
           "tmp": tempfile.gettempdir(), "mode": mode}}, open({str(seen)!r}, "w"))
"""
    monkeypatch.setenv("OPENAI_API_BASE", "http://127.0.0.9:1/v1")
    monkeypatch.setenv("RUN_SECRET_TOKEN", "s3cret")
    traj = _play(_driver(tok, ScriptedEngine(_ids(tok, "hi")), tmp_path, script, env={"AGENT_MODE": "x"}))
    assert traj.error is None, traj.error
    got = json.loads(seen.read_text())
    task = json.loads(got["task"])
    assert task["metadata"] == {} and "answer" not in got["task"]  # the env keeps the ground truth
    assert "OPENAI_API_BASE" not in got["env"] and "RUN_SECRET_TOKEN" not in got["env"]
    assert got["env"]["AGENT_MODE"] == "x" and got["env"]["PATH"] == os.environ["PATH"]
    assert got["tmp"] == got["env"]["TMPDIR"] != tempfile.gettempdir() and got["mode"] == 0o700


@pytest.mark.parametrize("isolation", ["none", "auto"])
def test_a_child_that_left_the_process_group_is_gone_with_the_episode(tok, tmp_path, isolation):
    pids = tmp_path / "pids.json"
    marker = f"300.{os.getpid()}{time.monotonic_ns() % 10**6}"
    script = ONE_CALL + ("import subprocess\n"
                         f"child = subprocess.Popen(['sleep', {marker!r}], start_new_session=True)\n"  # escapes killpg
                         f"json.dump([child.pid, os.getpgid(child.pid) != os.getpgid(0)], open({str(pids)!r}, 'w'))\n")
    traj = _play(_driver(tok, ScriptedEngine(_ids(tok, "hi")), tmp_path, script, isolation=isolation))
    assert traj.error is None, traj.error
    _, escaped = json.loads(pids.read_text())
    assert escaped  # it really left the agent's process group
    deadline = time.monotonic() + 5
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _marked(marker)
    for pid in alive:
        os.kill(pid, 9)
    assert alive == []


STEAL = """
import glob, json, os, time
from pathlib import Path
shared = Path({shared!r})
me = json.load(open(os.environ["RELAX_TASK_FILE"]))["sample_id"].replace("/", "_")
(shared / ("ready-" + me)).write_text("1")
deadline = time.time() + 20
while len(list(shared.glob("ready-*"))) < 2 and time.time() < deadline:  # both agents alive at once
    time.sleep(0.05)
mine = os.environ["OPENAI_API_KEY"]
keys = set()
for f in glob.glob("/proc/[0-9]*/environ"):
    try:
        for var in open(f, "rb").read().split(b"\\0"):
            if var.startswith(b"OPENAI_API_KEY=") and var[15:].decode() != mine:
                keys.add(var[15:].decode())
    except OSError:
        pass
try:
    others = [d for d in os.listdir(os.path.dirname(os.environ["TMPDIR"])) if d != os.path.basename(os.environ["TMPDIR"])]
except OSError:
    others = None
(shared / ("seen-" + me)).write_text(json.dumps({{"keys": sorted(keys), "others": others}}))
time.sleep(0.5)
""" + ONE_CALL


@pytest.mark.parametrize("isolation", ["namespace", "none"])
def test_an_agent_cannot_read_another_agents_key_or_find_its_private_directory(tok, tmp_path, isolation):
    """Two agents run at once; each scans /proc for another episode's key and lists the directory
    above its TMPDIR. Jailed (``namespace``), neither finds anything; without a jail both steal the
    other's key (what the jail is for)."""
    from relax_agent.rollout.agent_jail import namespace_refusal

    if isolation == "namespace" and namespace_refusal() is not None:
        pytest.skip(f"namespace isolation cannot run here: {namespace_refusal()}")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    driver = _driver(tok, ScriptedEngine(_ids(tok, "hi")), tmp_path, STEAL.format(shared=str(shared)),
                     isolation=isolation)
    specs = [EpisodeSpec(f"s/{i}", "s", TASK["id"], TASK, seed=i) for i in range(2)]

    async def both():
        return await asyncio.gather(*(driver.play(s, SamplingParams(max_new_tokens=8)) for s in specs))

    try:
        trajs = asyncio.run(both())
    finally:
        driver.close()
    assert [t.error for t in trajs] == [None, None]
    seen = [json.loads((shared / f"seen-s_{i}").read_text()) for i in range(2)]
    if isolation == "namespace":
        assert seen == [{"keys": [], "others": None}] * 2
    else:
        assert all(len(s["keys"]) >= 1 and len(s["others"]) >= 1 for s in seen), seen
