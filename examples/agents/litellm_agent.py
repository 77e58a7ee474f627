"""The calculator agent written with LiteLLM (``pip install litellm``).

LiteLLM is a client, not an agent framework: it has no loop of its own, so this is the loop of
``openai_sdk_agent.py`` with ``litellm.completion(model="openai/policy", ...)`` (its OpenAI
provider, chat completions) in place of the ``openai`` client, and the task's tool schemas sent as
they are. It reads ``OPENAI_BASE_URL`` /
``OPENAI_API_KEY`` and ``RELAX_TASK_FILE``, stops at a reply without tool calls or after
``AGENT_MAX_TURNS`` calls, and writes the last reply's text as ``answer`` to ``RELAX_OUTPUT_FILE``.
LiteLLM's model cost map is read from its package (``LITELLM_LOCAL_MODEL_COST_MAP``), not fetched.
Run it with
``rollout.agent.command: ["/opt/relax-fw-venv/bin/python", "examples/agents/litellm_agent.py"]``.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before the import: no fetch from GitHub

import litellm  # noqa: E402
from calculator_tools import ALL  # noqa: E402

MAX_TURNS = int(os.environ.get("AGENT_MAX_TURNS", "4"))


def run_tool(name: str, arguments: str) -> str:
    """The tool's result as text; a bad call is an error message the model can read."""
    try:
        return str(ALL[name](**json.loads(arguments)))
    except Exception as exc:  # the model's mistake is the tool's answer, as with a real API
        return f"error: {type(exc).__name__}: {exc}"


def main() -> None:
    task = json.loads(open(os.environ["RELAX_TASK_FILE"]).read())
    tools = task["tools"] or None
    messages = list(task["messages"])
    reply = None
    for _ in range(MAX_TURNS):
        reply = litellm.completion(model="openai/policy", api_base=os.environ["OPENAI_BASE_URL"],
                                   api_key=os.environ["OPENAI_API_KEY"], messages=messages,
                                   tools=tools).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        calls = reply.tool_calls or []
        if not calls or any(c.function.name not in ALL for c in calls):
            break
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    if reply is not None and not reply.tool_calls:
        json.dump({"answer": reply.content or ""}, open(os.environ["RELAX_OUTPUT_FILE"], "w"))


if __name__ == "__main__":
    main()
