"""The Python snippets of the docs pages "Weight sync" and "Data bus" run as written (the model path pointed
at the tiny test model)."""

from __future__ import annotations

import os
from pathlib import Path

CONCEPTS = Path(__file__).resolve().parents[2] / "docs" / "concepts"


def snippet(page: str) -> str:
    """The first Python code block of ``docs/concepts/<page>``."""
    text = (CONCEPTS / page).read_text()
    start = text.index("```python\n") + len("```python\n")
    return text[start:text.index("```", start)]


def test_data_bus_snippet_runs():
    scope: dict = {}
    exec(compile(snippet("data-bus.md"), "docs/concepts/data-bus.md", "exec"), scope)
    batch = scope["batch"]
    assert batch.sample_ids == ["s0", "s1", "s2", "s3"] and batch.fields["reward"].tolist() == [1, 0, 0, 1]
    assert [len(r) for r in batch.fields["response_ids"]] == [3, 5, 2, 4]


def test_weight_sync_snippet_runs(tiny_model_dir, tmp_path):
    (tmp_path / ".cache").mkdir()
    os.symlink(tiny_model_dir, tmp_path / ".cache" / "tiny-llama")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        scope: dict = {}
        exec(compile(snippet("weight-sync.md"), "docs/concepts/weight-sync.md", "exec"), scope)
    finally:
        os.chdir(cwd)
    assert scope["stats"].version == 1 and scope["stats"].subscribers == 1
