#!/usr/bin/env bash
# A separate venv with Hugging Face TRL for benchmarks/vs_trl.py (never imported by relax-agent itself).
# Pinned to the project's own torch and transformers, so both systems run the same kernels.
#   bash scripts/setup_trl.sh            # creates .venv-trl (~1-2 min once; idempotent)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${RELAX_TRL_VENV:-.venv-trl}
TORCH=${RELAX_TORCH:-torch==2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup_trl] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import trl" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "$TORCH" "transformers==5.24.0" "accelerate==1.16.0" "datasets==5.2.0" "trl==1.16.0"
fi
"$VENV/bin/python" -c "import trl, torch, transformers; print(f'[setup_trl] ok: trl {trl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
