#!/usr/bin/env bash
# A venv of its own for the agent-framework examples (examples/agents/{openai_agents,langgraph,
# smolagents,litellm}_agent.py), kept out of relax-agent's .venv: they are the agent's dependencies,
# not the trainer's. Jailed agents run as an unprivileged uid, so the venv must be readable by all
# and outside /tmp and /root (the default /opt/relax-fw-venv is).
#   bash scripts/setup_agent_frameworks.sh                 # builds /opt/relax-fw-venv
#   RELAX_FW_VENV=/srv/fw-venv bash scripts/setup_agent_frameworks.sh
# Then: .venv/bin/python -m pytest tests/e2e/test_agent_frameworks.py (skipped without the venv), or
#   relax-agent train examples/agents/openai_sdk_agent.yaml \
#     'rollout.agent.command=["/opt/relax-fw-venv/bin/python", "examples/agents/langgraph_agent.py"]'
set -euo pipefail
VENV=${RELAX_FW_VENV:-/opt/relax-fw-venv}
PY=${PYTHON:-python3.11}
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet openai-agents langchain-openai langgraph smolagents litellm
chmod -R a+rX "$VENV"
"$VENV/bin/pip" list 2>/dev/null | grep -iE '^(openai|openai-agents|langchain-openai|langgraph|smolagents|litellm) '
