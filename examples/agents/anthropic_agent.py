"""The tool-calling agent of ``openai_sdk_agent.py`` written with the official ``anthropic`` SDK
(Messages API, streamed with ``client.messages.stream``), trainable by relax-agent unchanged.

It reads ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY`` (through ``Anthropic()``; relax-agent sets
both to the episode's endpoint and key) and ``RELAX_TASK_FILE``, sends the task's system message
as ``system`` and its tools with ``input_schema``, appends each reply's ``content`` as the
assistant turn and a ``tool_result`` per ``tool_use`` it ran, and stops at a reply without tool
use (or a call of a tool it does not implement). Run it with
``rollout.agent.command: ["{python}", "examples/agents/anthropic_agent.py"]``.
"""

from __future__ import annotations

import json
import os

from anthropic import Anthropic
from openai_sdk_agent import MAX_TURNS, TOOLS, run_tool


def main() -> None:
    task = json.loads(open(os.environ["RELAX_TASK_FILE"]).read())
    client = Anthropic()
    system = "\n\n".join(m["content"] for m in task["messages"] if m["role"] in ("system", "developer"))
    messages: list = [{"role": m["role"], "content": m["content"]} for m in task["messages"]
                      if m["role"] not in ("system", "developer")]
    tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"].get("parameters") or {"type": "object", "properties": {}}}
             for t in task["tools"]]
    extra = {"system": system} if system else {}
    for _ in range(MAX_TURNS):
        with client.messages.stream(model="policy", max_tokens=512, messages=messages, tools=tools, **extra) as stream:
            reply = stream.get_final_message()
        messages.append({"role": "assistant", "content": reply.content})
        uses = [block for block in reply.content if block.type == "tool_use"]
        if not uses or any(u.name not in TOOLS for u in uses):
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id, "content": run_tool(u.name, json.dumps(u.input))}
            for u in uses]})


if __name__ == "__main__":
    main()
