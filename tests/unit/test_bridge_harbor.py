"""The Harbor task-folder bridge without Docker: reading task folders (and the ConfigErrors naming the bad
file), dataset splits, the verifier's reward files, and the env's plumbing on the in-memory sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium
import pytest

import relax_agent.envs
from relax_agent.envs.bfcl.data import heldout_score
from relax_agent.envs.bridges import BRIDGES, offered, resolve
from relax_agent.envs.bridges.harbor import TOOL_SCHEMA, HarborEnv, available
from relax_agent.envs.bridges.harbor_task import (
    dockerfile_bases,
    find_tasks,
    folder_digest,
    parse_reward,
    parse_size_mb,
    read_task,
    resolve_env,
)
from relax_agent.errors import ConfigError, DataError, EnvError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "harbor" / "sum-numbers"
FAKE = {"backend": "fake"}
TOML = '[verifier]\ntimeout_sec = 30.0\n[agent]\ntimeout_sec = 60.0\n[environment]\ncpus = 1\nmemory_mb = 256\n'


def make_task(folder: Path, toml: str = TOML, instruction: str = "Do the thing.", test_sh: str | None = "exit 0\n",
              dockerfile: str | None = "FROM relax-agent/python:bookworm\n", solve: str | None = None) -> Path:
    """A task folder with the given files (None: the file is left out)."""
    folder.mkdir(parents=True)
    (folder / "task.toml").write_text(toml)
    if instruction is not None:
        (folder / "instruction.md").write_text(instruction)
    if test_sh is not None:
        (folder / "tests").mkdir()
        (folder / "tests" / "test.sh").write_text(test_sh)
    if dockerfile is not None:
        (folder / "environment").mkdir()
        (folder / "environment" / "Dockerfile").write_text(dockerfile)
    if solve is not None:
        (folder / "solution").mkdir()
        (folder / "solution" / "solve.sh").write_text(solve)
    return folder


def call(command: object, call_id: str = "c0", name: str = "bash") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps({"command": command})}}


# -- task folders ------------------------------------------------------------------------------
def test_the_example_task_reads_as_written():
    task = read_task(EXAMPLE)
    assert task.name == "sum-numbers" and task.path == EXAMPLE
    assert task.instruction.startswith("The file `numbers.txt`") and task.instruction.endswith("followed by a newline.")
    assert (task.agent_timeout_s, task.verifier_timeout_s, task.build_timeout_s) == (120.0, 60.0, 300.0)
    assert (task.cpus, task.memory_mb, task.storage_mb, task.workdir, task.docker_image) == (1.0, 256, 16, None, None)
    assert task.solution == EXAMPLE / "solution" / "solve.sh"
    assert task.metadata["difficulty"] == "easy" and task.verifier_env == {}


def test_harbor_defaults_and_legacy_sizes(tmp_path):
    toml = ('[environment]\nmemory = "2G"\nstorage = "512M"\nworkdir = "/srv/"\nallow_internet = false\n'
            '[environment.env]\nMODE = "x"\n[verifier.env]\nKEY = "${HOME}"\n')
    task = read_task(make_task(tmp_path / "t", toml=toml))
    assert (task.agent_timeout_s, task.verifier_timeout_s, task.build_timeout_s) == (600.0, 600.0, 600.0)
    assert (task.memory_mb, task.storage_mb, task.workdir, task.allow_internet) == (2048, 512, "/srv", False)
    assert task.environment_env == {"MODE": "x"} and task.verifier_env == {"KEY": "${HOME}"}
    assert [parse_size_mb(v, "k", "f") for v in (300, "4G", "1.5GiB", "256mb", "2048", "1T")] == [
        300, 4096, 1536, 256, 2048, 1024 * 1024]
    for bad in ("lots", "-1G", 0, True, "4 X"):
        with pytest.raises(ConfigError, match=r"f: k="):
            parse_size_mb(bad, "k", "f")


@pytest.mark.parametrize(("case", "names"), [
    ("no task.toml", "task.toml: missing"),
    ("bad toml", "task.toml: not valid TOML"),
    ("no instruction", "instruction.md: missing"),
    ("empty instruction", "instruction.md: empty"),
    ("no test.sh", "tests/test.sh: missing"),
    ("no Dockerfile", "environment/Dockerfile: missing"),
    ("timeout a string", r"task.toml: \[verifier\].timeout_sec='soon'"),
    ("negative cpus", r"task.toml: \[environment\].cpus=-2"),
    ("gpus", r"task.toml: \[environment\].gpus=1"),
    ("relative workdir", r"task.toml: \[environment\].workdir='app'"),
    ("steps", r"task.toml: multi-step tasks \(\[\[steps\]\]\)"),
    ("separate verifier", "task.toml: a separate verifier environment"),
    ("compose", "docker-compose.yaml: multi-container"),
    ("env not a table", r"task.toml: \[verifier\].env must map names to strings"),
])
def test_a_malformed_task_folder_is_a_config_error_naming_the_file(tmp_path, case, names):
    kwargs: dict = {}
    toml = {"bad toml": "[verifier\ntimeout_sec = 1", "timeout a string": '[verifier]\ntimeout_sec = "soon"\n',
            "negative cpus": "[environment]\ncpus = -2\n", "gpus": "[environment]\ngpus = 1\n",
            "relative workdir": '[environment]\nworkdir = "app"\n', "steps": '[[steps]]\nname = "a"\n',
            "separate verifier": '[verifier]\nenvironment_mode = "separate"\n',
            "env not a table": '[verifier]\nenv = "X=1"\n'}.get(case)
    if toml is not None:
        kwargs["toml"] = toml
    kwargs.update({"no instruction": {"instruction": None}, "empty instruction": {"instruction": "  \n"},
                   "no test.sh": {"test_sh": None}, "no Dockerfile": {"dockerfile": None}}.get(case, {}))
    folder = make_task(tmp_path / "task-a", **kwargs)
    if case == "no task.toml":
        (folder / "task.toml").unlink()
    if case == "compose":
        (folder / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    with pytest.raises(ConfigError, match=names) as err:
        read_task(folder)
    assert str(folder) in str(err.value)  # the message names the file, with its folder


def test_a_prebuilt_docker_image_needs_no_dockerfile(tmp_path):
    task = read_task(make_task(tmp_path / "t", toml='[environment]\ndocker_image = "python:3.11"\n', dockerfile=None))
    assert task.docker_image == "python:3.11"


def test_a_dataset_folder_splits_deterministically_and_disjointly(tmp_path):
    for i in range(40):
        make_task(tmp_path / "ds" / f"task-{i:02d}", instruction=f"Task {i}.")
    make_task(tmp_path / "ds" / ".hidden")
    (tmp_path / "ds" / "notes").mkdir()  # a subfolder without task.toml is not a task
    tasks, is_dataset = find_tasks(tmp_path / "ds")
    assert is_dataset and [t.name for t in tasks] == [f"task-{i:02d}" for i in range(40)]
    env = HarborEnv(str(tmp_path / "ds"), sandbox=FAKE, heldout_fraction=0.25)
    train, heldout = env.tasks("train"), env.tasks("heldout")
    assert {t["id"] for t in train}.isdisjoint({t["id"] for t in heldout})
    assert sorted(t["id"] for t in train + heldout) == [f"task-{i:02d}" for i in range(40)]
    assert {t["id"] for t in heldout} == {f"task-{i:02d}" for i in range(40) if heldout_score(f"task-{i:02d}") < 0.25}
    assert 0 < len(heldout) < 20 and train == HarborEnv(str(tmp_path / "ds"), sandbox=FAKE, heldout_fraction=0.25).tasks()
    assert train[0]["task_dir"] == str((tmp_path / "ds" / train[0]["id"]).resolve())
    with pytest.raises(ConfigError, match="heldout_fraction=1.0 puts all 40 tasks"):
        HarborEnv(str(tmp_path / "ds"), sandbox=FAKE, heldout_fraction=1.0)
    make_task(tmp_path / "ds" / "task-broken", instruction=None)
    with pytest.raises(ConfigError, match="task-broken/instruction.md: missing"):
        HarborEnv(str(tmp_path / "ds"), sandbox=FAKE)


def test_a_single_task_folder_is_all_train_and_bad_paths_are_refused(tmp_path):
    env = HarborEnv(str(EXAMPLE), sandbox=FAKE)
    assert env.tasks("train") == [{"id": "sum-numbers", "task_dir": str(EXAMPLE)}] and env.tasks("heldout") == []
    with pytest.raises(DataError, match="unknown split 'test'"):
        env.tasks("test")
    with pytest.raises(ConfigError, match="is not a folder"):
        HarborEnv(str(tmp_path / "nowhere"), sandbox=FAKE)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no task.toml in it or in any of its subfolders"):
        HarborEnv(str(tmp_path / "empty"), sandbox=FAKE)


def test_env_arguments_are_checked():
    for sandbox, match in (({"backend": "bubblewrap"}, "sandbox.backend='bubblewrap'"),
                           ({"backend": "fake", "pool": {"size": 2}}, "sandbox.pool.size must be 0"),
                           ({"backend": "fake", "memory_mb": 1}, "env.kwargs.sandbox is invalid")):
        with pytest.raises(ConfigError, match=match):
            HarborEnv(str(EXAMPLE), sandbox=sandbox)
    with pytest.raises(ConfigError, match="split='dev'"):
        HarborEnv(str(EXAMPLE), sandbox=FAKE, split="dev")
    with pytest.raises(ConfigError, match="need max_turns >= 1"):
        HarborEnv(str(EXAMPLE), sandbox=FAKE, max_turns=0)


# -- reward files ------------------------------------------------------------------------------
@pytest.mark.parametrize(("json_text", "txt", "reward", "status", "source"), [
    (None, "1\n", 1.0, "ok", "reward.txt"),
    (None, " 0.25 ", 0.25, "ok", "reward.txt"),
    (None, "-2", -2.0, "ok", "reward.txt"),
    (None, "passed", 0.0, "malformed", None),
    (None, "", 0.0, "malformed", None),
    (None, "nan", 0.0, "malformed", None),
    (None, "inf", 0.0, "malformed", None),
    (None, None, 0.0, "missing", None),
    ('{"reward": 0.75, "tests_passed": 3, "note": "x"}', "0", 0.75, "ok", "reward.json"),  # json wins
    ('{"tests_passed": 3}', "1", 1.0, "ok", "reward.txt"),  # no 'reward' key: reward.txt
    ('{"tests_passed": 3}', None, 0.0, "malformed", None),
    ('{"reward": true}', None, 0.0, "malformed", None),
    ('{"reward": "1"}', "1", 0.0, "malformed", None),
    ("[1]", None, 0.0, "malformed", None),
    ("{not json", "1", 0.0, "malformed", None),
])
def test_reward_files_are_read_as_harbor_reads_them(json_text, txt, reward, status, source):
    verdict = parse_reward(json_text, txt)
    assert (verdict.reward, verdict.status, verdict.source) == (reward, status, source)
    assert verdict.reason and (status != "malformed" or "reward." in verdict.reason)
    if json_text and "tests_passed" in json_text:
        assert verdict.extras == {"tests_passed": 3.0}


def test_verifier_env_templates_resolve_from_the_environment(monkeypatch):
    monkeypatch.setenv("HARBOR_TEST_KEY", "k1")
    monkeypatch.delenv("HARBOR_TEST_UNSET", raising=False)
    assert resolve_env({"A": "${HARBOR_TEST_KEY}", "B": "x-${HARBOR_TEST_UNSET:-dflt}", "C": "plain"}, "w") == {
        "A": "k1", "B": "x-dflt", "C": "plain"}
    with pytest.raises(ConfigError, match=r"w: \$\{HARBOR_TEST_UNSET\} is not set"):
        resolve_env({"A": "${HARBOR_TEST_UNSET}"}, "w")


def test_dockerfile_bases_and_the_environment_hash(tmp_path):
    text = ("ARG V=3\nFROM --platform=linux/amd64 python:3.11-slim AS build\nRUN x\nFROM build\n"
            "FROM scratch\nFROM debian:${V}\nFROM relax-agent/python:bookworm\n")
    assert dockerfile_bases(text) == ["python:3.11-slim", "relax-agent/python:bookworm"]
    a = make_task(tmp_path / "a") / "environment"
    b = make_task(tmp_path / "b") / "environment"
    assert folder_digest(a, "s") == folder_digest(b, "s") != folder_digest(b, "t")
    (b / "data.txt").write_text("1")
    assert folder_digest(a, "s") != folder_digest(b, "s")


# -- the env on the in-memory sandbox ----------------------------------------------------------
def test_the_scheme_resolves_and_the_policy_sees_the_instruction_never_the_solution():
    assert BRIDGES["harbor"].package is None
    assert resolve("harbor:examples/harbor/sum-numbers") == ("relax/Harbor-v0", {"task_dir": "examples/harbor/sum-numbers"})
    env = relax_agent.envs.make(f"harbor:{EXAMPLE}", sandbox=FAKE)
    try:
        assert isinstance(env.unwrapped, HarborEnv)
        obs, info = env.reset(seed=0)
        assert obs[0]["role"] == "user" and obs[0]["content"].startswith(read_task(EXAMPLE).instruction)
        assert info == {"tools": [TOOL_SCHEMA], "task_id": "sum-numbers"}
        solution = (EXAMPLE / "solution" / "solve.sh").read_text()
        assert "python3 -c" in solution and "python3 -c" not in json.dumps([obs, info, env.unwrapped.tasks("train")])
        oracle = env.unwrapped.oracle_actions(env.unwrapped.tasks("train")[0])
        assert json.loads(oracle[0]["tool_calls"][0]["function"]["arguments"]) == {"command": solution}
        assert oracle[1] == {"role": "assistant", "content": "Done."}
    finally:
        env.close()
        env.close()


def test_tool_calls_run_in_the_sandbox_and_bad_calls_are_messages(tmp_path):
    env = HarborEnv(str(EXAMPLE), sandbox=FAKE, max_tool_calls_per_turn=2)
    with pytest.raises(EnvError, match="call reset"):
        env.step({"role": "assistant", "content": "hi"})
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step({"role": "assistant", "content": "", "tool_calls": [
        call("echo 42 > out.txt; cat out.txt; pwd"), call("x", "c1", "python"), call("echo never", "c2")]})
    assert [m["content"] for m in obs] == ["42\n/app", "error: unknown tool 'python'; the only tool is bash",
                                           "error: at most 2 tool calls per turn; this call was not run"]
    assert [m["tool_call_id"] for m in obs] == ["c0", "c1", "c2"]
    assert (reward, terminated, truncated, info) == (0.0, False, False, {"tool_calls": 1.0})
    obs, *_ = env.step({"role": "assistant", "content": "", "tool_calls": [call(""), call(3)],
                        "parse_errors": ["unclosed <tool_call>"]})
    assert [m["content"] for m in obs] == ['error: arguments must be a JSON object {"command": "<bash command>"}'] * 2 + [
        "error: could not parse a tool call: unclosed <tool_call>"]
    env.close()
    with pytest.raises(DataError, match="has no solution/solve.sh"):
        HarborEnv(str(make_task(tmp_path / "t")), sandbox=FAKE).oracle_actions({"id": "t"})


def test_the_final_reply_runs_the_verifier_and_a_fake_sandbox_records_why_it_scored_0():
    env = HarborEnv(str(EXAMPLE), sandbox=FAKE)
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step({"role": "assistant", "content": "All done."})
    assert (obs, reward, terminated, truncated) == ([], 0.0, True, False)
    assert info["verifier_status"] == "error" and info["verifier_ok"] == 0.0 and info["verifier_exit_code"] == -1.0
    assert info["reason"].startswith("could not copy tests/ into the container") and "/tests/test.sh" in info["reason"]
    with pytest.raises(EnvError, match="call reset"):
        env.step({"role": "assistant", "content": "again"})
    env.close()


def test_max_turns_and_the_agent_time_end_the_episode_with_the_verifier(tmp_path):
    env = HarborEnv(str(EXAMPLE), sandbox=FAKE, max_turns=2)
    env.reset(seed=0)
    assert env.step({"role": "assistant", "content": "", "tool_calls": [call("true")]})[2:4] == (False, False)
    _, reward, terminated, truncated, info = env.step({"role": "assistant", "content": "", "tool_calls": [call("true")]})
    assert (reward, terminated, truncated, info["tool_calls"], info["verifier_status"]) == (0.0, False, True, 2.0, "error")
    env.close()
    quick = make_task(tmp_path / "quick", toml="[agent]\ntimeout_sec = 0.2\n")
    env = HarborEnv(str(quick), sandbox=FAKE, command_timeout_s=30)
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step({"role": "assistant", "content": "", "tool_calls": [call("sleep 5")]})
    assert "[killed: timed out after 0.2 s]" in obs[0]["content"]  # the command got what was left of [agent] timeout_sec
    assert (terminated, truncated, info["agent_timed_out"]) == (False, True, 1.0)
    env.close()


def test_available_lists_the_task_folders_under_the_conventional_path(tmp_path, monkeypatch):
    monkeypatch.delenv("RELAX_HARBOR_PATH", raising=False)
    monkeypatch.chdir(REPO)
    assert "examples/harbor/sum-numbers" in available() and offered("harbor") == available()
    make_task(tmp_path / "ds" / "b-task")
    make_task(tmp_path / "ds" / "a-task")
    single = make_task(tmp_path / "single")
    monkeypatch.setenv("RELAX_HARBOR_PATH", f"{tmp_path / 'ds'}:{single}:{tmp_path / 'missing'}")
    assert available() == [str(tmp_path / "ds" / "a-task"), str(tmp_path / "ds" / "b-task"), str(single)]
    monkeypatch.setenv("RELAX_HARBOR_PATH", str(tmp_path / "missing"))
    assert available() == []


def test_the_registered_id_takes_the_task_dir():
    env = gymnasium.make("relax/Harbor-v0", task_dir=str(EXAMPLE), sandbox=FAKE)
    assert env.unwrapped.task_dir == str(EXAMPLE) and env.unwrapped.reward_description.startswith("the task's own")
    env.close()
