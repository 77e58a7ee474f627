"""A small tool-calling agent written with the official ``openai`` client, trainable by relax-agent.

Run by ``rollout.driver: agent`` (see ``openai_sdk_agent.yaml``) once per episode. It knows nothing
of relax-agent beyond three environment variables:

- ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``: read by ``OpenAI()`` itself (the policy's endpoint);
- ``RELAX_TASK_FILE``: the task, ``{"messages": [...], "tools": [...], ...}``.

It calls the model, runs the tools it implements (the calculator's add/subtract/multiply/divide),
sends the results back with the whole history, and stops at a reply without tool calls, or at a
call of a tool it does not implement (e.g. a BFCL task, where the call itself is the answer). The
env scores the last reply. Outside relax-agent it runs against any OpenAI-compatible server:

    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=x RELAX_TASK_FILE=task.json \\
        python examples/agents/openai_sdk_agent.py
"""

from __future__ import annotations

import json
import os

from openai import OpenAI

MAX_TURNS = int(os.environ.get("AGENT_MAX_TURNS", "4"))

TOOLS = {
    "add": lambda a, b: a + b,
    "subtract": lambda a, b: a - b,
    "multiply": lambda a, b: a * b,
    "divide": lambda a, b: a / b,
}


def run_tool(name: str, arguments: str) -> str:
    """The tool's result as text; a bad call is an error message the model can read."""
    try:
        args = json.loads(arguments)
        value = TOOLS[name](**args)
    except Exception as exc:  # the model's mistake is the tool's answer, as with a real API
        return f"error: {type(exc).__name__}: {exc}"
    return str(int(value) if float(value).is_integer() else value)


def main() -> None:
    task = json.loads(open(os.environ["RELAX_TASK_FILE"]).read())
    client = OpenAI()
    messages = list(task["messages"])
    tools = task["tools"] or None
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        calls = reply.tool_calls or []
        if not calls or any(c.function.name not in TOOLS for c in calls):
            break
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})


if __name__ == "__main__":
    main()
