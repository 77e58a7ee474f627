"""JSONL files read while a run appends to them: a half-written last line is reported as partial and
any other broken line is counted, so one bad line never hides the rest of a run."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class JsonlRead:
    """Rows of one JSONL file. ``partial``: the last line was not a complete JSON object (a writer is
    still appending it); ``bad_lines``: 1-based numbers of other lines that did not parse."""

    rows: list[dict[str, Any]]
    partial: bool = False
    bad_lines: tuple[int, ...] = ()


def read_jsonl(path: Path) -> JsonlRead:
    """Rows of ``path`` (one JSON object per line; empty lines skipped; ``.gz``: gzip-compressed).
    Missing file: no rows.

    Never raises on content: an unparsable last line is reported as ``partial``, any other as a
    bad line. Raises OSError only when the file exists but cannot be read.
    """
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", errors="replace") as f:
                text = f.read()
        else:
            text = path.read_text(errors="replace")
    except FileNotFoundError:
        return JsonlRead([])
    except (EOFError, gzip.BadGzipFile):  # a gzip file cut short: nothing trustworthy in it yet
        return JsonlRead([], partial=True)
    lines = text.split("\n")
    rows, bad, partial = [], [], False
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not an object")
        except ValueError:
            if i == last:
                partial = True
            else:
                bad.append(i + 1)
            continue
        rows.append(row)
    return JsonlRead(rows, partial, tuple(bad))
