"""relax/PythonExec-v0 on the fake sandbox: tasks, answers, tool calls, sandbox lifetime."""

from __future__ import annotations

import math

import gymnasium
import pytest

from relax_agent.envs import python_exec
from relax_agent.envs.python_exec import PythonExecEnv, format_result, make_tasks, parse_answer
from relax_agent.errors import ConfigError, DataError, EnvError, SandboxError
from relax_agent.sandboxes import ExecResult, FakeBackend, PoolConfig, SandboxConfig, SandboxPool, portal_loop, run_sync

FAKE = {"backend": "fake"}


def call(code, name="run_python", cid="c1"):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": {"code": code} if code else "{bad"}}]}


def test_tasks_are_deterministic_disjoint_and_right():
    train, held = make_tasks("train"), make_tasks("heldout")
    assert len(train) > 1000 and 100 < len(held) < len(train) // 5
    assert not {t["id"] for t in train} & {t["id"] for t in held}
    assert not {t["question"] for t in train} & {t["question"] for t in held}
    assert PythonExecEnv(sandbox=FAKE).tasks("train") == train
    for task in train[:300]:
        q, a = task["question"], task["answer"]
        if task["kind"] == "squares":
            n = int(q.rsplit(" ", 1)[-1].rstrip("?"))
            assert a == sum(i * i for i in range(1, n + 1))
        elif task["kind"] == "primes":
            n = int(q.rsplit(" ", 1)[-1].rstrip("?"))
            assert a == sum(1 for k in range(2, n) if all(k % d for d in range(2, math.isqrt(k) + 1)))
        elif task["kind"] == "digits_fact":
            n = int(q.split(" of ")[-1].split()[0])
            assert a == sum(map(int, str(math.factorial(n))))
    with pytest.raises(DataError, match="split='test'"):
        make_tasks("test")


@pytest.mark.parametrize("text, value", [
    ("I ran it. Answer: 1,024", 1024),
    ("answer = -17\nthanks", -17),
    ("The result is \\boxed{99}.", 99),
    ("first 3 then 12", 12),
    ("Answer: 5 ... wait, Answer: 6", 6),
    ("no digits here", None),
])
def test_parse_answer(text, value):
    assert parse_answer(text) == value


def test_format_result_reports_failures():
    assert format_result(ExecResult(0, "42\n", ""), 5, 100) == "42"
    text = format_result(ExecResult(137, "", "", timed_out=True), 5, 100)
    assert text == "[killed: timed out after 5 s]"
    assert "[killed: out of memory]" in format_result(ExecResult(137, "", "", oom_killed=True), 5, 100)
    text = format_result(ExecResult(1, "", "Traceback\nZeroDivisionError\n"), 5, 100)
    assert "ZeroDivisionError" in text and "[exit code 1]" in text
    assert format_result(ExecResult(0, "x" * 500, "", truncated=True), 5, 120).endswith("[observation truncated]")
    assert format_result(ExecResult(0, "", ""), 5, 100) == "[no output]"


def test_episode_with_tool_call_then_answer():
    env = PythonExecEnv(sandbox=FAKE)
    task = {"id": "t1", "question": "What is 2 to the power 10?", "answer": 1024}
    messages, info = env.reset(options={"task": task})
    assert messages[0]["role"] == "user" and "2 to the power 10" in messages[0]["content"]
    assert info["tools"][0]["function"]["name"] == "run_python" and info["task_id"] == "t1"
    sb = env.sandbox
    obs, reward, terminated, truncated, info = env.step(call("print(2 ** 10)"))
    assert obs == [{"role": "tool", "tool_call_id": "c1", "name": "run_python", "content": "1024"}]
    assert (reward, terminated, truncated, info) == (0.0, False, False, {"tool_calls": 1.0})
    obs, reward, terminated, truncated, info = env.step({"role": "assistant", "content": "Answer: 1024"})
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info == {"correct": 1.0, "answered": 1.0, "tool_calls": 1.0}
    with pytest.raises(EnvError, match="reset"):
        env.step({"role": "assistant", "content": "again"})
    env.close()
    assert sb.closed and env.sandbox is None
    env.close()


@pytest.mark.parametrize("code, why", [("print('\udc80')", "a lone surrogate '\\udc80' at index 7 (not valid UTF-8)"),
                                       ("print(1)\0", "a NUL byte")])
def test_code_the_sandbox_cannot_take_is_a_tool_error_not_a_sandbox_failure(code, why):
    env = PythonExecEnv(sandbox=FAKE)
    env.reset(options={"task": {"id": "t", "question": "q", "answer": 7}})
    sb = env.sandbox
    obs, reward, terminated, _, _ = env.step(call(code))
    assert obs[0]["content"] == f"error: code holds {why}; send UTF-8 Python source"
    assert (reward, terminated) == (0.0, False) and env.sandbox is sb and not sb.closed
    obs, *_ = env.step(call("print(6 * 7)"))
    assert obs[0]["content"] == "42"
    env.close()


def test_wrong_answer_bad_calls_and_tool_limit():
    env = PythonExecEnv(sandbox=FAKE, max_tool_calls=1)
    env.reset(options={"task": {"id": "t", "question": "q", "answer": 7}})
    obs, *_ = env.step(call("print(1)", name="shell"))
    assert "unknown tool 'shell'" in obs[0]["content"]
    obs, *_ = env.step(call(None))
    assert "must be a JSON object" in obs[0]["content"]
    obs, *_ = env.step(call("print(1 // 0)"))
    assert "ZeroDivisionError" in obs[0]["content"]
    obs, *_ = env.step(call("print(1)"))
    assert "limit (1) reached" in obs[0]["content"]
    _, reward, terminated, _, info = env.step({"role": "assistant", "content": "It is 8."})
    assert reward == 0.0 and terminated and info["correct"] == 0.0 and info["answered"] == 1.0
    env.close()


def test_reset_without_task_draws_from_split_and_replaces_sandbox():
    env = PythonExecEnv(sandbox=FAKE, split="heldout")
    env.reset(seed=3)
    first_task, first_sb = env.task, env.sandbox
    assert first_task in make_tasks("heldout")
    env.reset(seed=3)
    assert env.task == first_task and first_sb.closed and env.sandbox is not first_sb
    env.close()


def test_sandbox_comes_from_a_pool_and_goes_back():
    backend = FakeBackend(SandboxConfig(backend="fake"))
    pool = SandboxPool(backend, PoolConfig(size=1, max_size=1))
    run_sync(pool.start(), loop=portal_loop())
    try:
        env = PythonExecEnv(pool=pool)
        env.reset(options={"task": {"id": "t", "question": "q", "answer": 1}})
        sb = env.sandbox
        assert sb is backend.created[0] and pool.in_use == 1
        env.close()
        assert pool.in_use == 0 and pool.idle == 1 and not sb.closed and sb.reset_count == 1
    finally:
        run_sync(pool.close(), loop=pool.loop)


def test_shared_pool_from_config_size():
    env = PythonExecEnv(sandbox={"backend": "fake", "pool": {"size": 2, "max_size": 2}})
    env.reset(options={"task": {"id": "t", "question": "q", "answer": 1}})
    pool = env._from
    assert pool is not None and pool.in_use == 1
    env.close()
    env2 = PythonExecEnv(sandbox={"backend": "fake", "pool": {"size": 2, "max_size": 2}})
    env2.reset(options={"task": {"id": "t", "question": "q", "answer": 1}})
    assert env2._from is pool, "envs with the same config share one warm pool"
    env2.close()


def test_sandbox_failure_is_an_error_not_a_wrong_answer():
    env = PythonExecEnv(sandbox=FAKE)
    env.reset(options={"task": {"id": "t", "question": "q", "answer": 1}})
    sb = env.sandbox

    async def broken(*args, **kwargs):
        raise SandboxError("container vanished")

    sb.run_python = broken
    with pytest.raises(SandboxError, match="container vanished"):
        env.step(call("print(1)"))
    assert sb.closed and env.sandbox is None
    env.close()


def test_bad_arguments_and_registration():
    with pytest.raises(ConfigError, match="sandbox is invalid"):
        PythonExecEnv(sandbox={"backend": "subprocess"})
    with pytest.raises(ConfigError, match="split="):
        PythonExecEnv(sandbox=FAKE, split="dev")
    with pytest.raises(ConfigError, match="max_tool_calls"):
        PythonExecEnv(sandbox=FAKE, max_tool_calls=0)
    with pytest.raises(DataError, match="question"):
        PythonExecEnv(sandbox=FAKE).reset(options={"task": {"id": "x"}})
    was_registered = python_exec.ENV_ID in gymnasium.registry
    python_exec.register()
    try:
        env = gymnasium.make(python_exec.ENV_ID, sandbox=FAKE)
        assert isinstance(env.unwrapped, PythonExecEnv)
        env.close()
    finally:
        if not was_registered:
            gymnasium.registry.pop(python_exec.ENV_ID, None)
