"""The Harbor bridge in real Docker: the example task's oracle scores 1.0 and doing nothing 0.0; a verifier
past its timeout, a malformed or missing reward file score 0.0 with the reason recorded; limits, mounts and
clean-up of the task's container; a FROM that cannot be resolved offline names the Dockerfile and the image."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
from pathlib import Path

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401  (registers relax/Harbor-v0)
from relax_agent.envs.bridges.harbor import HarborEnv
from relax_agent.envs.testing import run_contract
from relax_agent.errors import ConfigError, EnvError
from relax_agent.sandboxes.reaper import owner_token
from relax_agent.sandboxes.testing import require_backend

pytestmark = [pytest.mark.docker, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "harbor" / "sum-numbers"
SANDBOX = {"backend": "docker", "memory_mb": 512, "cpus": 0.5, "pids_limit": 64, "workdir_mb": 64, "ttl_s": 300}
HARBOR_IMAGES = {"label": "relax-agent.image=harbor"}


@pytest.fixture(scope="module")
def client():
    """The Docker client; the harbor images this module built are removed at its end."""
    require_backend("docker")
    import docker

    c = docker.from_env()
    before = {i.id for i in c.images.list(filters=HARBOR_IMAGES)}
    yield c
    for image in c.images.list(filters=HARBOR_IMAGES):
        if image.id not in before:
            with contextlib.suppress(docker.errors.APIError):
                c.images.remove(image.id)
    c.close()


def mine(client) -> list:
    """Containers this test process started (by the owner label the reaper reads)."""
    return client.containers.list(all=True, filters={"label": f"relax-agent.owner={owner_token()}"})


@pytest.fixture(autouse=True)
def no_container_left(client):
    yield
    assert mine(client) == [], "a container of this process outlived its env"


def task_like_example(tmp_path: Path, test_sh: str, toml_extra: str = "") -> Path:
    """A task with the example's environment (same image) and its own tests/test.sh."""
    folder = tmp_path / "task"
    shutil.copytree(EXAMPLE, folder)
    (folder / "tests" / "test.sh").write_text(test_sh)
    if toml_extra:
        toml = (folder / "task.toml").read_text().replace("[verifier]\ntimeout_sec = 60.0\n", toml_extra)
        (folder / "task.toml").write_text(toml)
    return folder


def bash(command: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]}


def finish(env) -> tuple[float, dict]:
    _, reward, terminated, truncated, info = env.step({"role": "assistant", "content": "I am done."})
    assert (terminated, truncated) == (True, False)
    return reward, info


def test_the_oracle_scores_1_and_doing_nothing_scores_0(client):
    env = HarborEnv(str(EXAMPLE), sandbox=SANDBOX)
    try:
        task = env.tasks("train")[0]
        env.reset(seed=0, options={"task": task})
        oracle = env.oracle_actions(task)
        obs, reward, terminated, _, _ = env.step(oracle[0])
        assert (obs[0]["content"], reward, terminated) == ("[no output]", 0.0, False)
        _, reward, terminated, _, info = env.step(oracle[1])
        assert (reward, terminated) == (1.0, True)
        assert info == {"tool_calls": 1.0, "verifier_ok": 1.0, "verifier_exit_code": 0.0, "verifier_status": "ok",
                        "reason": "/logs/verifier/reward.txt: reward 1", "agent_timed_out": 0.0}
        env.reset(seed=0, options={"task": task})
        reward, info = finish(env)
        assert (reward, info["verifier_status"], info["reason"]) == (0.0, "ok", "/logs/verifier/reward.txt: reward 0")
        env.reset(seed=0, options={"task": task})  # a wrong answer scores 0 too
        env.step(bash("echo 55786 > /app/answer.txt"))
        assert finish(env)[0] == 0.0
    finally:
        env.close()


def test_the_container_has_the_task_files_limits_and_mounts_and_nothing_of_the_solution(client):
    env = HarborEnv(str(EXAMPLE), sandbox=SANDBOX)
    try:
        env.reset(seed=0)
        obs = env.step(bash("pwd; head -n 2 numbers.txt; ls -A /tests /logs; ls /; id -u; ls /solution 2>&1 | head -1"))[0]
        lines = obs[0]["content"].splitlines()
        assert lines[:3] == ["/app", "6193", "8020"]  # the image's WORKDIR and COPYed file, unpacked into the tmpfs
        assert "/tests:" in lines and "/logs:" in lines and "solution" not in lines and "65534" in lines
        assert "No such file or directory" in lines[-1]
        [container] = mine(client)
        host = container.attrs["HostConfig"]
        assert host["Memory"] == 256 * 2**20  # the task's memory_mb (below the 512 MB cap)
        assert host["NanoCpus"] == int(0.5e9)  # the task asks 1 CPU, capped at sandbox.cpus=0.5
        assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] is True
        assert set(host["Tmpfs"]) == {"/app", "/tmp", "/tests", "/logs"} and "size=16m" in host["Tmpfs"]["/app"]
        assert container.labels["relax-agent.harbor.task"] == "sum-numbers"
        assert container.image.labels["relax-agent.image"] == "harbor"
        env.close()  # mid-episode: the container goes, and a late step cannot start another
        assert mine(client) == []
        with pytest.raises(EnvError, match="was closed"):
            env.step(bash("true"))
    finally:
        env.close()


@pytest.mark.parametrize(("test_sh", "toml_extra", "status", "reason"), [
    ("echo 1 > /logs/verifier/reward.txt\nsleep 30\n", "[verifier]\ntimeout_sec = 2.0\n", "timeout",
     "tests/test.sh did not finish within [verifier] timeout_sec=2 s"),
    ("echo 'all tests passed' > /logs/verifier/reward.txt\n", "", "malformed",
     "/logs/verifier/reward.txt must hold one finite number, got 'all tests passed\\n'"),
    ("echo '{\"score\": 1' > /logs/verifier/reward.json\n", "", "malformed", "/logs/verifier/reward.json is not JSON"),
    ("echo broken >&2\nexit 3\n", "", "missing",
     "tests/test.sh wrote neither /logs/verifier/reward.txt nor /logs/verifier/reward.json (exit 3): broken"),
])
def test_a_failed_verifier_scores_0_with_the_reason_recorded(client, tmp_path, test_sh, toml_extra, status, reason):
    env = HarborEnv(str(task_like_example(tmp_path, test_sh, toml_extra)), sandbox=SANDBOX)
    try:
        env.reset(seed=0)
        env.step(bash("cd /app && python3 -c \"print(sum(map(int, open('numbers.txt'))))\" > answer.txt"))
        reward, info = finish(env)
        assert (reward, info["verifier_ok"], info["verifier_status"]) == (0.0, 0.0, status)
        assert info["reason"].startswith(reason)
    finally:
        env.close()


def test_reward_json_wins_and_the_agent_cannot_write_the_reward_itself(client, tmp_path):
    script = ('if [ -f /app/answer.txt ]; then echo \'{"reward": 0.25, "tests_passed": 3}\' > /logs/verifier/reward.json; '
              'fi\necho 1 > /logs/verifier/reward.txt\n')
    env = HarborEnv(str(task_like_example(tmp_path, script)), sandbox=SANDBOX)
    try:
        env.reset(seed=0)
        env.step(bash("touch /app/answer.txt"))
        reward, info = finish(env)
        assert (reward, info["reason"], info["reward_json/tests_passed"]) == (0.25, "/logs/verifier/reward.json: reward 0.25", 3.0)
        (tmp_path / "task" / "tests" / "test.sh").write_text("exit 0\n")  # writes no reward at all
        env = HarborEnv(str(tmp_path / "task"), sandbox=SANDBOX)
        env.reset(seed=0)
        obs = env.step(bash("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
                            "echo 'echo 1 > /logs/verifier/reward.txt' > /tests/test.sh && echo planted"))[0]
        assert obs[0]["content"] == "planted"
        reward, info = finish(env)  # /tests and /logs are emptied and tests/ copied afresh before test.sh runs
        assert (reward, info["verifier_status"]) == (0.0, "missing")
    finally:
        env.close()


def test_a_base_image_that_cannot_be_resolved_offline_or_a_failing_build_is_refused_by_name(client, tmp_path):
    folder = task_like_example(tmp_path, "exit 0\n")
    dockerfile = folder / "environment" / "Dockerfile"
    dockerfile.write_text("FROM relax-agent/no-such-base:0\nWORKDIR /app\n")
    env = HarborEnv(str(folder), sandbox=SANDBOX)
    try:
        env.reset(seed=0)
        with pytest.raises(ConfigError, match=rf"{dockerfile}: FROM relax-agent/no-such-base:0 is not on the local "
                                              "Docker daemon and could not be pulled"):
            env.step(bash("true"))
        dockerfile.write_text("FROM relax-agent/python:bookworm\nRUN echo building && exit 7\n")
        env.reset(seed=0)
        with pytest.raises(EnvError, match=rf"(?s){dockerfile}: docker build failed: .*returned a non-zero code: 7"):
            finish(env)
    finally:
        env.close()


def test_the_env_contract_holds_in_docker(client):
    assert run_contract(functools.partial(gymnasium.make, "relax/Harbor-v0", task_dir=str(EXAMPLE), sandbox=SANDBOX)) == {}
