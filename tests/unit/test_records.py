"""Committed run records (docs/results/) hold relative paths only: a path of the machine a run was made on
means nothing to a reader, and a regenerating command must not depend on it."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
ABSOLUTE = re.compile(r'"/(?:tmp|work|root|home|var|opt|mnt)/[^"]*"')


def _text(path: Path) -> str | None:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", errors="replace") as f:
            return f.read()
    if path.suffix in {".png", ".jpg", ".pt", ".safetensors"}:
        return None
    return path.read_text(errors="replace")


def test_no_record_holds_an_absolute_path():
    found = []
    for path in sorted(RESULTS.rglob("*")):
        text = _text(path) if path.is_file() else None
        match = ABSOLUTE.search(text or "")
        if match:
            found.append(f"{path.relative_to(RESULTS)}: {match.group(0)[:80]}")
    assert not found, "absolute paths in committed records:\n" + "\n".join(found)


def test_the_check_finds_one():
    assert ABSOLUTE.search('{"checkpoint": "/tmp/run/checkpoints/step_000001"}')
    assert not ABSOLUTE.search('{"checkpoint": "runs/run/checkpoints/step_000001"}')
