"""ToolEnv: schemas from plain functions, tool errors as messages, per-turn limits, timeouts, async tools."""

from __future__ import annotations

import asyncio
import time

import pytest

from relax_agent.envs import ToolEnv, tool_schema
from relax_agent.envs.tool_env import TRUNCATION_MARKER, call_in_thread, truncate
from relax_agent.errors import ConfigError, EnvError


def lookup(key: str, repeat: int = 1) -> str:
    """Look a key up.

    Args:
        key: The key to look up.
        repeat: How many times to repeat the value.
    """
    if key == "boom":
        raise KeyError(key)
    return f"value-of-{key}" * repeat


def sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


async def fetch(url: str) -> dict:
    """Fetch a URL (async).

    Args:
        url: The address.
    """
    if url == "slow":
        await asyncio.sleep(30)
    return {"url": url, "status": 200}


class KV(ToolEnv):
    def __init__(self, **limits):
        super().__init__(tools=[lookup, sleepy, fetch, self.remember], **limits)
        self.memory: list[str] = []

    def remember(self, note: str) -> str:
        """Store a note for this episode.

        Args:
            note: The note.
        """
        self.memory.append(note)
        return f"{len(self.memory)} notes"

    def tasks(self, split="train"):
        return [{"id": f"{split}-0", "question": "find x"}]

    def prompt(self, task):
        self.memory = []
        return [{"role": "user", "content": task["question"]}]

    def score(self, message):
        ok = message["content"] == "value-of-x"
        return float(ok), {"correct": float(ok)}


def call(name, args, cid="c"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def turn(*calls, **extra):
    return {"role": "assistant", "content": "", "tool_calls": list(calls), **extra}


def test_schema_from_type_hints_and_docstring():
    schema = tool_schema(lookup)
    assert schema == {"type": "function", "function": {
        "name": "lookup", "description": "Look a key up.",
        "parameters": {"type": "object", "properties": {
            "key": {"type": "string", "description": "The key to look up."},
            "repeat": {"type": "integer", "description": "How many times to repeat the value."}},
            "required": ["key"]}}}
    _, info = KV().reset(seed=0)
    assert [t["function"]["name"] for t in info["tools"]] == ["lookup", "sleepy", "fetch", "remember"]
    assert "self" not in info["tools"][3]["function"]["parameters"]["properties"]


def test_undocumented_tool_is_a_config_error():
    def bare(x):
        return x

    with pytest.raises(ConfigError, match="tool 'bare'.*docstring"):
        tool_schema(bare)
    with pytest.raises(ConfigError, match="unique"):
        ToolEnv(tools=[lookup, lookup])
    with pytest.raises(ConfigError, match="max_tool_calls_per_turn >= 1"):
        ToolEnv(tools=[lookup], max_tool_calls_per_turn=0)


def test_tool_results_and_errors_become_tool_messages():
    env = KV()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(turn(
        call("lookup", {"key": "x"}, "c1"),
        call("lookup", '{"key": "boom"}', "c2"),           # the tool raises
        call("lookup", {"nope": 1}, "c3"),                  # wrong argument name
        call("missing", {}, "c4"),                          # unknown tool
    ))
    assert [m["role"] for m in obs] == ["tool"] * 4
    assert [m["tool_call_id"] for m in obs] == ["c1", "c2", "c3", "c4"]
    assert obs[0]["content"] == "value-of-x"
    assert obs[1]["content"] == "error: KeyError: 'boom'"
    assert obs[2]["content"].startswith("error: bad arguments for 'lookup'")
    assert obs[3]["content"] == "error: unknown tool 'missing'; available: ['fetch', 'lookup', 'remember', 'sleepy']"
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info == {"tool_calls": 4.0, "tool_errors": 3.0}
    _, reward, terminated, _, info = env.step({"role": "assistant", "content": "value-of-x"})
    assert (reward, terminated, info["correct"], info["tool_calls"]) == (1.0, True, 1.0, 4.0)


def test_bad_json_arguments_and_parse_errors_are_reported():
    env = KV()
    env.reset(seed=0)
    obs, *_ = env.step(turn(call("lookup", "{not json")))
    assert obs[0]["content"] == "error: arguments must be a JSON object"
    obs, _, terminated, _, info = env.step({"role": "assistant", "content": "", "tool_calls": [],
                                            "parse_errors": ["unterminated <tool_call>"]})
    assert not terminated and obs == [{"role": "tool", "tool_call_id": "", "name": "",
                                       "content": "error: could not parse a tool call: unterminated <tool_call>"}]
    assert info["tool_errors"] == 2.0


def test_per_turn_call_limit_and_observation_truncation():
    env = KV(max_tool_calls_per_turn=2, max_observation_chars=25)
    env.reset(seed=0)
    obs, *_ = env.step(turn(call("lookup", {"key": "x", "repeat": 3}, "a"), call("remember", {"note": "n"}, "b"),
                            call("remember", {"note": "never"}, "c")))
    assert obs[0]["content"] == "value-of-x" * 2 + "value" + TRUNCATION_MARKER.format(n=5)
    assert obs[1]["content"] == "1 notes"
    assert obs[2]["content"] == "error: at most 2 tool calls per turn; this call was not run"
    assert env.memory == ["n"]
    assert truncate("abc", 3) == "abc"


def test_hanging_sync_tool_becomes_an_error_message():
    env = KV(tool_timeout_s=0.2)
    env.reset(seed=0)
    obs, _, terminated, _, _ = env.step(turn(call("sleepy", {"seconds": 30})))
    assert obs[0]["content"] == "error: tool 'sleepy' did not finish within 0.2 s" and not terminated
    obs, *_ = env.step(turn(call("sleepy", {"seconds": 0})))
    assert obs[0]["content"] == "awake"


def test_astep_awaits_async_tools_and_times_them_out():
    env = KV(tool_timeout_s=0.2)

    async def play():
        await env.areset(seed=0)
        ok = await env.astep(turn(call("fetch", {"url": "a"}), call("lookup", {"key": "y"})))
        slow = await env.astep(turn(call("fetch", {"url": "slow"}), call("sleepy", {"seconds": 30})))
        return ok, slow

    ok, slow = asyncio.run(play())
    assert [m["content"] for m in ok[0]] == ['{"url": "a", "status": 200}', "value-of-y"]
    assert [m["content"] for m in slow[0]] == ["error: tool 'fetch' did not finish within 0.2 s",
                                               "error: tool 'sleepy' did not finish within 0.2 s"]
    # the sync step runs async tools too
    env.reset(seed=0)
    assert env.step(turn(call("fetch", {"url": "b"})))[0][0]["content"] == '{"url": "b", "status": 200}'


def test_step_ordering_is_enforced():
    env = KV()
    with pytest.raises(EnvError, match="call reset"):
        env.step({"role": "assistant", "content": "hi"})
    env.reset(seed=0)
    with pytest.raises(EnvError, match="message dict"):
        env.step("hi")
    env.step({"role": "assistant", "content": "done"})
    with pytest.raises(EnvError, match="call reset"):
        env.step({"role": "assistant", "content": "again"})


def test_call_in_thread_returns_raises_and_is_abandoned_on_timeout():
    async def main():
        assert await call_in_thread(lambda a, b=0: a + b, 1, b=2) == 3
        with pytest.raises(ZeroDivisionError):
            await call_in_thread(lambda: 1 / 0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call_in_thread(time.sleep, 30), 0.1)

    asyncio.run(main())  # returns although a 30 s sleep is still running in its thread
