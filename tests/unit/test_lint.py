"""ruff over the repository (the ``[tool.ruff]`` section of pyproject.toml) finds nothing.

Without ruff (the ``dev`` extra installs it) this test skips, except under ``CI=true``, where a
missing ruff fails it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.fixtures import require_dev_tools

REPO = Path(__file__).resolve().parents[2]

pytestmark = require_dev_tools("ruff", what="ruff")


def test_ruff_finds_nothing() -> None:
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"ruff found problems:\n{res.stdout}{res.stderr}"
