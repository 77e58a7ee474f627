"""Agents written against the OpenAI Responses API and the Anthropic Messages API (the example
agents, real processes using the official SDKs) train exactly like chat-completions agents: the
episode is the chain of the replies they sent back, with the sampled tokens, scored by the env."""

from __future__ import annotations

import pytest

from tests.unit.test_agent_driver import REPO, TASK, _driver, _ids, _play, tok  # noqa: F401
from tests.unit.test_endpoint_openai import ScriptedEngine


def _replies(tok):  # noqa: F811
    a, op, b = TASK["expression"].split()
    name = {"+": "add", "-": "subtract"}[op]
    call = f'Let me compute it.\n<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    return [_ids(tok, call), _ids(tok, f"Answer: {TASK['answer']}")]


@pytest.mark.parametrize("agent", ["responses_agent.py", "anthropic_agent.py"])
def test_the_example_agent_of_each_api_is_one_chain_of_sampled_tokens(tok, tmp_path, agent):  # noqa: F811
    replies = _replies(tok)
    engine = ScriptedEngine(lambda prompt: replies[len(engine.prompts) - 1], delay_s=0.001)
    driver = _driver(tok, engine, tmp_path, command=["{python}", str(REPO / "examples/agents" / agent)])
    traj = _play(driver)
    assert traj.error is None, traj.error
    assert traj.reward == 1.0 and traj.metrics["correct"] == 1.0
    assert [list(t.token_ids) for t in traj.turns] == replies  # exactly what was sampled, nothing re-tokenized
    assert traj.metrics["agent/requests"] == 2.0 and traj.metrics["agent/branches"] == 0.0
    assert traj.metrics["agent/chain_replies"] == 2.0 and traj.metrics["agent/dropped_replies"] == 0.0
    assert engine.prompts[1][:len(engine.prompts[0]) + len(replies[0])] == engine.prompts[0] + replies[0]
    tool_result = [m for m in traj.messages if m["role"] == "tool"]
    assert tool_result and tool_result[0]["content"] == str(TASK["answer"])  # the agent ran the tool itself


def test_the_parents_anthropic_credentials_never_reach_the_agent():
    from relax_agent.rollout.agent_driver import agent_environment

    parent = {"ANTHROPIC_API_KEY": "sk-ant-run", "ANTHROPIC_AUTH_TOKEN": "t", "ANTHROPIC_BASE_URL": "http://127.0.0.9",
              "OPENAI_API_KEY": "sk-run", "PATH": "/bin"}
    assert agent_environment(parent, ["*"]) == {"PATH": "/bin"}
