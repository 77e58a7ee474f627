#!/usr/bin/env bash
# The test command: set up the venv, the Docker daemon and the sandbox image, vLLM and Chromium, then run pytest.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=.venv/bin/python bash scripts/setup_docker.sh
bash scripts/setup_vllm.sh  # .venv-vllm for engine.kind=vllm (~3 min once; RELAX_SKIP_VLLM=1 skips it)
bash scripts/setup_viewer.sh  # headless Chromium for the viewer's browser tests (RELAX_SKIP_CHROMIUM=1 skips it)
exec .venv/bin/python -m pytest -q "$@"
