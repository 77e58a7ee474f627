"""mypy over ``relax_agent/`` (the ``[tool.mypy]`` section of pyproject.toml) finds no error.

Without mypy (the ``dev`` extra installs it) this test skips, except under ``CI=true``, where a
missing mypy fails it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

if importlib.util.find_spec("mypy") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("CI=true but mypy is not installed: scripts/setup.sh installs it with the dev extra",
                    pytrace=False)
    pytestmark = pytest.mark.skip(reason="mypy is not installed (pip install -e '.[dev]' installs it)")


@pytest.mark.slow
def test_mypy_finds_no_error() -> None:
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, f"mypy found errors:\n{res.stdout}{res.stderr}"
