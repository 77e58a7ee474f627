#!/usr/bin/env bash
# GPU check of engine.kind=vllm: runs the gpu-marked vLLM test on a CUDA machine.
# Needs a venv with the CUDA vllm build (pip install vllm) whose python is given as
# RELAX_VLLM_PYTHON, and relax-agent's own venv (.venv, or PYTHON=...) with CUDA torch.
#   RELAX_VLLM_PYTHON=/opt/vllm-venv/bin/python bash scripts/gpu_check_vllm.sh
# Exits 2, saying why, when there is no GPU or no such venv (it never pretends to have run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[gpu_check_vllm] no CUDA device visible to $PY: nothing was checked" >&2
  exit 2
fi
if [ -z "${RELAX_VLLM_PYTHON:-}" ] || ! "$RELAX_VLLM_PYTHON" -c "import vllm, torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[gpu_check_vllm] RELAX_VLLM_PYTHON must name the python of a venv with the CUDA vllm build" >&2
  exit 2
fi
exec "$PY" -m pytest -q -m gpu -rs tests/e2e/test_vllm_gpu.py "$@"
