"""Modules stay small: no module of the package (``relax_agent/`` and the folders mapped into it,
``envs/``, ``sandboxes/``, ``reward_services/``) is over 500 lines. A module that grows past it
is split by responsibility, not trimmed of its docstrings."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 500


def test_no_module_is_over_500_lines():
    sizes = {}
    for folder in ("relax_agent", "envs", "sandboxes", "reward_services"):
        for path in (REPO / folder).rglob("*.py"):
            sizes[str(path.relative_to(REPO))] = len(path.read_text().splitlines())
    assert len(sizes) > 100, sorted(sizes)  # the walk found the package
    over = {path: n for path, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
