"""The verifiers bridge against verifiers' own pipeline. The same scripted model replies are played twice: through
relax-agent's bridge (``relax/Verifiers-v0``), and through verifiers' real rollout machinery — ``Agent.run`` /
``Env.run_episode`` with its ``null`` harness (the bundled chat program, run as a subprocess), its interception
server, the Toolset's MCP server process and ``Task.score`` — with a local OpenAI-compatible server on 127.0.0.1
answering verifiers' model calls. Every request the model sees (messages and tools) and every reward are equal.

The one substitution on verifiers' side: it runs its PEP 723 programs with ``uv``, which this machine does not
have (nor the network to fetch it); ``prepare_uv_script`` is patched to run the same program with this venv's
Python, which has every package the script declares."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

import relax_agent.envs as envs
from tests.e2e.data.vf_envs import CAPITALS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "e2e" / "data"


def _call(call_id: str, name: str, arguments: Any) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ScriptedModel:
    """An OpenAI-compatible ``/v1/chat/completions`` on 127.0.0.1 (streamed or not) that answers each request with the
    next reply of ``script`` and keeps every request body."""

    def __init__(self, script: list[dict]) -> None:
        self.script, self.requests = list(script), []

    async def handle(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        reply = self.script.pop(0)
        message = {"role": "assistant", "content": reply.get("content")}
        if reply.get("tool_calls"):
            message["tool_calls"] = [_call(c["id"], c["function"]["name"], json.dumps(c["function"]["arguments"])
                                           if not isinstance(c["function"]["arguments"], str) else c["function"]["arguments"])
                                     for c in reply["tool_calls"]]
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        head = {"id": "cmpl-0", "created": 0, "model": body["model"]}
        if not body.get("stream"):
            return web.json_response({**head, "object": "chat.completion", "choices": [
                {"index": 0, "message": message, "finish_reason": finish}]})
        delta = {**message, **({"tool_calls": [{**c, "index": i} for i, c in enumerate(message["tool_calls"])]}
                               if message.get("tool_calls") else {})}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for choice in ({"index": 0, "delta": delta, "finish_reason": None}, {"index": 0, "delta": {}, "finish_reason": finish}):
            await response.write(f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _verifiers_pipeline(task: Any, script: list[dict], *, env_config: dict | None = None,
                              max_turns: int | None = None) -> tuple[Any, list[dict]]:
    """verifiers' own rollout of ``task`` (its env's ``run_episode`` when ``env_config`` is given) against the scripted
    model: (the trace, the request bodies the model got)."""
    import verifiers.v1 as vf
    from aiohttp import web

    model = ScriptedModel(script)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", model.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = {"type": "eval", "base_url": f"http://127.0.0.1:{port}/v1", "api_key_var": "RELAX_TEST_NO_KEY"}
        seat = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}, "max_turns": max_turns}
        if env_config is None:
            trace = await vf.Agent(vf.AgentConfig(model="policy", client=client, **seat)).run(task)
        else:
            env = vf.load_environment(vf.resolve_env_config({**env_config, "player": seat}))
            async with env.serving():
                ctx = vf.ModelContext(model="policy", client=vf.EvalClientConfig(**{k: v for k, v in client.items() if k != "type"}))
                trace = (await env.run_episode(task, ctx)).traces[0]
    finally:
        await runner.cleanup()
    assert not trace.errors, trace.errors
    return trace, model.requests


def _bridge(env_id: str, script: list[dict], key: str, **kwargs: Any) -> tuple[Any, list[list[dict]], list, float, dict]:
    """The bridge's episode on task ``key`` with the same replies: (the verifiers task, the requests the policy saw, their
    tools, the reward, the final info)."""
    env = envs.make(env_id, heldout_fraction=0.0, **kwargs)
    try:
        task = next(t for t in env.unwrapped.tasks("train") if t["key"] == key)
        obs, info = env.reset(options={"task": task})
        conversation, requests = list(obs), [list(obs)]
        for reply in script:
            new, reward, terminated, _, end = env.step(reply)
            if terminated:
                return env.unwrapped._tasks[task["id"]], requests, info["tools"], reward, end
            conversation += [reply, *new]
            requests.append(list(conversation))
        raise AssertionError("the bridge episode did not end on the script")
    finally:
        env.close()


def _normal(messages: list[dict]) -> list[tuple]:
    """Messages as the model reads them: role, text, tool call ids/names/arguments, tool result ids/names."""
    out = []
    for m in messages:
        calls = tuple((c["id"], c["function"]["name"], json.loads(a) if isinstance(a := c["function"]["arguments"], str) else a)
                      for c in m.get("tool_calls") or [])
        out.append((m["role"], m.get("content") or "", calls, m.get("tool_call_id"), m.get("name")))
    return out


@pytest.fixture
def verifiers_pipeline(monkeypatch, tmp_path):
    """verifiers' pipeline runnable here: programs run by this venv's Python, runtime folders under ``tmp_path``, and the
    Toolset server subprocess able to import the test environments."""
    from verifiers.v1.runtimes import subprocess as vf_subprocess

    async def prepare_uv_script(self: Any, script: str | bytes, env: Any = None, *, activate: bool = True) -> list[str]:
        path = self.workdir / "vf_program.py"
        path.write_bytes(script.encode() if isinstance(script, str) else script)
        return [sys.executable, str(path)]

    monkeypatch.setattr(vf_subprocess.SubprocessRuntime, "prepare_uv_script", prepare_uv_script)
    monkeypatch.setattr(vf_subprocess, "CACHE_DIR", tmp_path / "verifiers-cache")
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{DATA}")
    monkeypatch.syspath_prepend(str(DATA))
    return _verifiers_pipeline


def _math_script(task: Any, right: bool) -> list[dict]:
    answer = task.data.answer if right else task.data.answer + 1
    return [{"role": "assistant", "content": f"<think>adding</think> <answer>{answer}</answer>", "tool_calls": []}]


@pytest.mark.parametrize("right", [True, False])
def test_single_turn_matches_verifiers(verifiers_pipeline, right):
    import relax_agent.envs.bridges.verifiers as bridge

    task = list(bridge.load("tests.e2e.data.vf_envs:load_math")[1])[5]
    vtask, requests, tools, reward, info = _bridge("verifiers:tests.e2e.data.vf_envs:load_math",
                                                   _math_script(task, right), task.key)
    trace, bodies = asyncio.run(verifiers_pipeline(vtask, _math_script(task, right)))
    assert [_normal(b["messages"]) for b in bodies] == [_normal(r) for r in requests] and tools == []
    assert reward == trace.reward == (1.2 if right else 0.2)
    assert {k: r.score for k, r in trace.rewards.items()} == {k[10:]: v for k, v in info.items() if k.startswith("vf_reward_")}


def _lookup_script(country: str) -> list[dict]:
    return [{"role": "assistant", "content": "", "tool_calls": [
                _call("call_a", "atlas_capital", {"country": country}), _call("call_b", "atlas_hint", {}),
                _call("call_c", "no_such_tool", {}), _call("call_d", "atlas_capital", {})]},
            {"role": "assistant", "content": f"<answer>{CAPITALS[country]}</answer>", "tool_calls": []}]


@pytest.mark.parametrize("max_turns", [None, 1])
def test_tool_episode_matches_verifiers(verifiers_pipeline, max_turns):
    import relax_agent.envs.bridges.verifiers as bridge

    env_id = "verifiers:tests.e2e.data.vf_envs:load_lookup"
    task = bridge.load("tests.e2e.data.vf_envs:load_lookup")[1].load()[3]
    script = _lookup_script(task.data.country)
    vtask, requests, tools, reward, info = _bridge(env_id, script, task.key, max_turns=max_turns)
    trace, bodies = asyncio.run(verifiers_pipeline(vtask, script, max_turns=max_turns))
    assert [_normal(b["messages"]) for b in bodies] == [_normal(r) for r in requests]
    assert all(b["tools"] == tools for b in bodies)  # same names, descriptions and JSON schemas, in order
    assert reward == trace.reward == (1.5 if max_turns is None else 0.0)
    assert info["reason"] == trace.stop_condition == ("agent_completed" if max_turns is None else "max_turns")
    assert {k: r.score for k, r in trace.rewards.items()} == {k[10:]: v for k, v in info.items() if k.startswith("vf_reward_")}


def test_env_run_episode_matches_verifiers(verifiers_pipeline):
    env_id, args = "verifiers:vf_dialogue", {"max_guesses": 3}
    sys.path.insert(0, str(DATA))
    try:
        import vf_dialogue

        game = vf_dialogue.GuessTaskset(vf_dialogue.GuessConfig(**args)).load()[2]
        secret = game.data.secret
        script = [{"role": "assistant", "content": f"<guess>{g}</guess>", "tool_calls": []} for g in (secret - 1, secret)]
        vtask, requests, _, reward, info = _bridge(env_id, script, game.key, env_args=args)
        trace, bodies = asyncio.run(verifiers_pipeline(vtask, script, env_config={"taskset": {"id": "vf_dialogue", **args}}))
    finally:
        sys.path.remove(str(DATA))
    assert [_normal(b["messages"]) for b in bodies] == [_normal(r) for r in requests]
    assert reward == trace.reward == 1.5 and info["reason"] == trace.stop_condition == "user_closed"
    assert {k: r.score for k, r in trace.rewards.items()} == {k[10:]: v for k, v in info.items() if k.startswith("vf_reward_")}
