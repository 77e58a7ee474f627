"""The calculator agent written with LangGraph and LangChain (``pip install langgraph langchain-openai``).

``create_react_agent`` runs LangGraph's own loop over ``ChatOpenAI`` (chat completions) with the
calculator tools as LangChain ``@tool``s: the model is called, its tool calls run by the graph's
``ToolNode`` and sent back as ``ToolMessage``s, until a reply without tool calls or
``AGENT_MAX_TURNS`` model calls (the graph's recursion limit). It reads ``OPENAI_BASE_URL`` /
``OPENAI_API_KEY`` and ``RELAX_TASK_FILE``, and writes the last AI message's text as ``answer``
to ``RELAX_OUTPUT_FILE``. Run it with
``rollout.agent.command: ["/opt/relax-fw-venv/bin/python", "examples/agents/langgraph_agent.py"]``.
"""

from __future__ import annotations

import json
import os
import warnings

from calculator_tools import for_task
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError

with warnings.catch_warnings():  # create_react_agent moved to langchain.agents in LangGraph 1.0
    warnings.simplefilter("ignore")
    from langgraph.prebuilt import create_react_agent

MAX_TURNS = int(os.environ.get("AGENT_MAX_TURNS", "4"))


def main() -> None:
    task = json.loads(open(os.environ["RELAX_TASK_FILE"]).read())
    model = ChatOpenAI(model="policy", base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
    graph = create_react_agent(model, [tool(f) for f in for_task(task)])
    try:  # each model call and each tool round is a graph step
        state = graph.invoke({"messages": task["messages"]}, {"recursion_limit": 2 * MAX_TURNS})
    except GraphRecursionError:  # out of turns: the env scores the last reply
        return
    final = [m for m in state["messages"] if isinstance(m, AIMessage)][-1]
    json.dump({"answer": final.text}, open(os.environ["RELAX_OUTPUT_FILE"], "w"))


if __name__ == "__main__":
    main()
