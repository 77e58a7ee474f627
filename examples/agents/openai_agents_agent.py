"""The calculator agent written with the OpenAI Agents SDK (``pip install openai-agents``).

``Runner`` runs the SDK's own loop: the model is called on the Responses API (the SDK's default,
``OpenAIResponsesModel``) with the task's system text as ``instructions`` and the calculator tools
as ``@function_tool``s; the SDK runs each call and sends the results back until a reply without
tool calls (``final_output``), at most ``AGENT_MAX_TURNS`` model calls. It reads
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (through ``AsyncOpenAI()``), ``RELAX_TASK_FILE``, and
writes the final output as ``answer`` to ``RELAX_OUTPUT_FILE``. Tracing is off (it would post to
api.openai.com). Run it with
``rollout.agent.command: ["/opt/relax-fw-venv/bin/python", "examples/agents/openai_agents_agent.py"]``.
"""

from __future__ import annotations

import json
import os

from agents import Agent, AgentsException, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from calculator_tools import for_task, split_messages
from openai import AsyncOpenAI

MAX_TURNS = int(os.environ.get("AGENT_MAX_TURNS", "4"))


def main() -> None:
    task = json.loads(open(os.environ["RELAX_TASK_FILE"]).read())
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(), use_for_tracing=False)
    system, messages = split_messages(task)
    agent = Agent(name="calculator", instructions=system or None, model="policy",
                  tools=[function_tool(f) for f in for_task(task)])
    try:
        result = Runner.run_sync(agent, input=messages, max_turns=MAX_TURNS)
    except AgentsException:  # out of turns, a malformed or unknown tool call: the env scores the last reply
        return
    json.dump({"answer": str(result.final_output)}, open(os.environ["RELAX_OUTPUT_FILE"], "w"))


if __name__ == "__main__":
    main()
