"""Registration goes through gymnasium's own registry; message spaces accept OpenAI messages with content parts."""

from __future__ import annotations

import gymnasium
import pytest

import relax_agent.envs
from relax_agent.envs import ConversationSpace, MessageSpace, TextEnv, describe, env_ids, register
from relax_agent.envs.spaces import is_message


class Counter(TextEnv):
    def __init__(self, start: int = 0):
        super().__init__()
        self.start = start

    def tasks(self, split="train"):
        return [{"id": f"{split}-{self.start}"}]

    def _reset_task(self, task):
        self.n = self.start
        return [{"role": "user", "content": str(self.n)}], {"tools": []}

    def step(self, action):
        self.n += 1
        return [{"role": "user", "content": str(self.n)}], 0.0, False, False, {}


@pytest.fixture
def registered():
    ids = []

    def reg(env_id, entry_point, **kwargs):
        register(id=env_id, entry_point=entry_point, **kwargs)
        ids.append(env_id)

    yield reg
    for env_id in ids:
        gymnasium.registry.pop(env_id, None)


def test_string_entry_point_kwargs_and_time_limit(registered):
    registered("test/Counter-v0", f"{__name__}:Counter", kwargs={"start": 5}, max_episode_steps=2)
    env = gymnasium.make("test/Counter-v0")
    assert isinstance(env.unwrapped, Counter) and env.unwrapped.start == 5
    assert env.reset(seed=0)[0] == [{"role": "user", "content": "5"}]
    assert env.step({"role": "assistant", "content": "x"})[3] is False
    assert env.step({"role": "assistant", "content": "x"})[3] is True  # TimeLimit truncates
    assert gymnasium.make("test/Counter-v0", start=9).unwrapped.start == 9
    assert "test/Counter-v0" in env_ids()


def test_callable_entry_point_and_re_registration(registered):
    registered("test/Counter-v1", Counter)
    registered("test/Counter-v1", Counter)  # same arguments: no-op
    assert gymnasium.spec("test/Counter-v1").kwargs == {}
    with pytest.warns(UserWarning, match="Overriding environment test/Counter-v1"):
        registered("test/Counter-v1", Counter, kwargs={"start": 3})  # different arguments: replaced
    assert gymnasium.make("test/Counter-v1").unwrapped.start == 3


def test_unknown_ids_fail_with_gymnasium_suggestions():
    with pytest.raises(gymnasium.error.NameNotFound, match="Did you mean: `Calculator`"):
        gymnasium.make("relax/Calculater-v0")
    with pytest.raises(gymnasium.error.VersionNotFound, match="v0"):
        gymnasium.make("relax/Calculator-v7")
    with pytest.raises(gymnasium.error.NamespaceNotFound, match="Did you mean: `relax`"):
        gymnasium.make("relx/Calculator-v0")


def test_env_ids_list_relax_envs_and_not_gymnasium_toys():
    ids = env_ids()
    assert {"relax/BFCL-simple-v0", "relax/Calculator-v0", "relax/PythonExec-v0", "relax/ReasoningGym-v0"} <= set(ids)
    assert "CartPole-v1" not in ids


def test_describe_reports_tools_tasks_and_reward():
    info = describe("relax/Calculator-v0", difficulty=2, num_tasks=100)
    assert info["kwargs"] == {"difficulty": 2, "num_tasks": 100} and info["max_episode_steps"] == 8
    assert sum(info["tasks"].values()) == 100
    assert [t["function"]["name"] for t in info["tools"]] == ["add", "subtract", "multiply", "divide"]
    assert info["reward"].startswith("1.0 when the final assistant message")
    bfcl = describe("relax/BFCL-simple-v0")
    assert bfcl["tasks"] == {"train": 327, "heldout": 73} and len(bfcl["tools"]) == 1


def test_describe_imports_module_ids():
    info = describe("examples.custom_env:examples/Units-v0")
    assert info["tools"] and info["tasks"]["train"] > 0


def test_plugins_failing_to_load_are_skipped_with_a_warning(monkeypatch):
    from importlib.metadata import EntryPoint

    good = EntryPoint("zz", f"{__name__}:_register_zz", "gymnasium.envs")
    bad = EntryPoint("broken", "no_such_module_for_test:register", "gymnasium.envs")
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [bad, good])
    try:
        with pytest.warns(RuntimeWarning, match="gymnasium.envs plugin broken = no_such_module_for_test:register failed"):
            loaded = relax_agent.envs.load_plugins()
        assert loaded == [f"zz = {__name__}:_register_zz"]
        assert gymnasium.spec("zz/Counter-v0").entry_point is Counter  # the entry point's name is the namespace
    finally:
        gymnasium.registry.pop("zz/Counter-v0", None)


def _register_zz():
    gymnasium.register(id="Counter-v0", entry_point=Counter, disable_env_checker=True)


@pytest.mark.parametrize("message, ok", [
    ({"role": "user", "content": "hi"}, True),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "f", "arguments": "{}"}}]}, True),
    ({"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]}, True),
    ({"role": "user", "content": [{"type": "text", "text": "look"},
                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "video_url", "video_url": "file:///clip.mp4"},
                                  {"type": "image"}]}, True),
    ({"role": "tool", "tool_call_id": "c", "content": "42"}, True),
    ({"role": "robot", "content": "hi"}, False),
    ({"content": "hi"}, False),
    ({"role": "user", "content": 42}, False),
    ({"role": "user", "content": [{"type": "text"}]}, False),
    ({"role": "user", "content": [{"type": "hologram"}]}, False),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, False),
    ({"role": "user", "content": ["text"]}, False),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}, False),
    ({"role": "assistant", "content": "", "tool_calls": {"name": "f"}}, False),
])
def test_message_space(message, ok):
    assert is_message(message) is ok
    assert MessageSpace().contains(message) is ok
    assert ConversationSpace().contains([message]) is ok


def test_spaces_sample_members_and_compare():
    space = MessageSpace(seed=3)
    assert all(space.contains(space.sample()) for _ in range(5))
    assert ConversationSpace().contains(ConversationSpace().sample())
    assert not ConversationSpace(max_messages=1).contains([{"role": "user", "content": "a"}] * 2)
    assert MessageSpace() == MessageSpace() and ConversationSpace(2) != ConversationSpace(3)


def test_cli_envs_show_prints_tools_tasks_and_reward():
    from typer.testing import CliRunner

    from relax_agent.cli import app

    out = CliRunner().invoke(app, ["envs", "show", "relax/Calculator-v0", "--kwargs", '{"num_tasks": 50}'])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == "relax/Calculator-v0  (relax_agent.envs.calculator:CalculatorEnv, max_episode_steps=8)"
    assert "tools (4):" in lines and "  divide(a, b): Divide a by b." in lines
    assert any(line.startswith("tasks: train ") for line in lines)
    bad = CliRunner().invoke(app, ["envs", "show", "relax/Calculator-v0", "--kwargs", '{"difficulty": 9}'])
    assert bad.exit_code == 2 and "error: difficulty=9; expected one of [1, 2, 3, 4, 5]" in bad.output
