"""The documentation site builds with ``mkdocs build --strict`` (no broken link, no page left out
of the nav, no docstring the API reference cannot render); README.md stays a front door of at most
250 lines; nothing tracked points at the ``shared`` folder beside the repository (outside it).

Without mkdocs (the ``docs`` and ``dev`` extras install it) the build test skips, except under
``CI=true``, where a missing mkdocs fails it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import require_dev_tools

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
OUTSIDE = b"../" + b"shared"  # spelt in two parts so that this file does not match itself

NEEDS_MKDOCS = require_dev_tools("mkdocs", "material", "mkdocstrings_handlers",
                                 what="mkdocs, mkdocs-material or mkdocstrings[python]", extra="docs")


@pytest.mark.slow
@NEEDS_MKDOCS
def test_the_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner, not a build warning
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, f"mkdocs build --strict failed:\n{res.stdout}{res.stderr}"
    assert (tmp_path / "site" / "api" / "config" / "index.html").exists()


def test_the_readme_is_a_front_door() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move details to a page under docs/")


def test_no_tracked_file_points_at_shared() -> None:
    res = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"not a git checkout: {res.stderr.strip()}")
    files = res.stdout
    hits = []
    for name in filter(None, files.split("\0")):
        path = REPO / name
        if not path.is_file() or path.is_symlink():
            continue
        try:
            if OUTSIDE in path.read_bytes():
                hits.append(name)
        except OSError:
            continue
    assert hits == [], f"tracked files mention {OUTSIDE.decode()} (outside the repository): {hits}"
