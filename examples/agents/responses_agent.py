"""The tool-calling agent of ``openai_sdk_agent.py`` written with the OpenAI **Responses** API
(``client.responses.create``), trainable by relax-agent unchanged.

It reads ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (through ``OpenAI()``) and ``RELAX_TASK_FILE``,
keeps its whole conversation as ``input`` items (no ``previous_response_id``: the endpoint stores
no responses), appends each response's ``output`` and a ``function_call_output`` per call it ran,
and stops at a response without function calls (or a call of a tool it does not implement).
Run it with ``rollout.agent.command: ["{python}", "examples/agents/responses_agent.py"]``.
"""

from __future__ import annotations

import json
import os

from openai import OpenAI
from openai_sdk_agent import MAX_TURNS, TOOLS, run_tool


def main() -> None:
    task = json.loads(open(os.environ["RELAX_TASK_FILE"]).read())
    client = OpenAI()
    items: list = [{"role": m["role"], "content": m["content"]} for m in task["messages"]]
    tools = [{"type": "function", **t["function"]} for t in task["tools"]] or None
    for _ in range(MAX_TURNS):
        response = client.responses.create(model="policy", input=items, tools=tools)
        items.extend(response.output)
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls or any(c.name not in TOOLS for c in calls):
            break
        for call in calls:
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": run_tool(call.name, call.arguments)})


if __name__ == "__main__":
    main()
