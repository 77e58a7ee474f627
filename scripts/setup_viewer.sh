#!/usr/bin/env bash
# Install headless Chromium from Debian's packages for the viewer's browser tests
# (tests/unit/test_viewer_browser.py). Idempotent: does nothing when a chromium binary exists.
#   bash scripts/setup_viewer.sh
#   RELAX_SKIP_CHROMIUM=1 bash scripts/setup_viewer.sh   # do nothing (the browser tests then skip, outside CI)
set -euo pipefail
if [ "${RELAX_SKIP_CHROMIUM:-0}" = "1" ]; then
  echo "[setup_viewer] RELAX_SKIP_CHROMIUM=1: not installing Chromium"
  exit 0
fi
for bin in chromium chromium-browser; do
  if command -v "$bin" >/dev/null 2>&1; then
    echo "[setup_viewer] $("$bin" --version 2>/dev/null || echo "$bin") already installed"
    exit 0
  fi
done
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "[setup_viewer] installing chromium (Debian package)"
if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium; then
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium
fi
chromium --version
