"""The calculator agent written with smolagents (``pip install smolagents``).

A ``ToolCallingAgent`` runs smolagents' own loop over ``OpenAIServerModel`` (chat completions,
``tool_choice: required``, stop strings ``Observation:`` / ``Calling tools:``): the calculator
tools are smolagents ``@tool``s beside its built-in ``final_answer`` tool, each call is run and
its observation sent back, until ``final_answer`` or ``AGENT_MAX_TURNS`` steps (then smolagents
asks the model for a final answer without tools). smolagents keeps its own memory and re-renders
it on every call (tool calls and observations as text turns), so the endpoint links each reply by
its content. The system prompt is the task's system text (smolagents' default one is ~2,000
tokens, past a small run's budget). It reads ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` and
``RELAX_TASK_FILE``, and writes the final answer as ``answer`` to ``RELAX_OUTPUT_FILE``. Run it with
``rollout.agent.command: ["/opt/relax-fw-venv/bin/python", "examples/agents/smolagents_agent.py"]``.
"""

from __future__ import annotations

import importlib.resources
import json
import os

import yaml
from calculator_tools import for_task, split_messages
from smolagents import AgentError, OpenAIServerModel, ToolCallingAgent, tool

MAX_TURNS = int(os.environ.get("AGENT_MAX_TURNS", "4"))
FINAL = "Call the final_answer tool with your final answer."


def main() -> None:
    task = json.loads(open(os.environ["RELAX_TASK_FILE"]).read())
    system, messages = split_messages(task)
    templates = yaml.safe_load(importlib.resources.files("smolagents.prompts").joinpath("toolcalling_agent.yaml")
                               .read_text())
    templates["system_prompt"] = f"{system}\n\n{FINAL}" if system else FINAL
    model = OpenAIServerModel(model_id="policy", api_base=os.environ["OPENAI_BASE_URL"],
                              api_key=os.environ["OPENAI_API_KEY"])
    agent = ToolCallingAgent(tools=[tool(f) for f in for_task(task)], model=model, prompt_templates=templates,
                             max_steps=MAX_TURNS, verbosity_level=0)
    try:
        answer = agent.run("\n\n".join(m["content"] for m in messages))
    except AgentError:  # e.g. no call under tool_choice "required" after the SDK's retries
        return
    json.dump({"answer": str(answer)}, open(os.environ["RELAX_OUTPUT_FILE"], "w"))


if __name__ == "__main__":
    main()
