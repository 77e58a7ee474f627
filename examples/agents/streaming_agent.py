"""The calculator agent of ``openai_sdk_agent.py``, streaming: it prints tokens as they are sampled.

Same environment variables and tools; each reply is requested with ``stream=True`` and rebuilt
from its chunks (content deltas, then tool-call deltas: id and name first, arguments after).
Train through it with ``rollout.agent.command=["{python}", "examples/agents/streaming_agent.py"]``.
"""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI
from openai_sdk_agent import MAX_TURNS, TOOLS, run_tool


def streamed_reply(client: OpenAI, messages: list[dict], tools: list[dict] | None) -> dict:
    """One assistant message rebuilt from a streamed completion."""
    content, calls = [], {}
    for chunk in client.chat.completions.create(model="policy", messages=messages, tools=tools, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            content.append(delta.content)
            print(delta.content, end="", file=sys.stderr, flush=True)
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["function"]["name"] += d.function.name or ""
                call["function"]["arguments"] += d.function.arguments or ""
    print(file=sys.stderr)
    message = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def main() -> None:
    task = json.loads(open(os.environ["RELAX_TASK_FILE"]).read())
    client = OpenAI()
    messages = list(task["messages"])
    tools = task["tools"] or None
    for _ in range(MAX_TURNS):
        reply = streamed_reply(client, messages, tools)
        messages.append(reply)
        calls = reply.get("tool_calls", [])
        if not calls or any(c["function"]["name"] not in TOOLS for c in calls):
            break
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": run_tool(call["function"]["name"], call["function"]["arguments"])})


if __name__ == "__main__":
    main()
