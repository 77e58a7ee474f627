"""benchmarks/run_record.py: what a benchmark's ``--record`` writes (relative command, every repeat, median and spread)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("run_record", REPO / "benchmarks" / "run_record.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


run_record = _load()
COUNTS = {"x_ratio": "a over b"}


def test_a_record_holds_every_repeat_the_median_and_spread_and_a_relative_command(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "lora.py"), "--record", str(REPO / "docs/results/l"),
                                      "--repeats", "3"])
    recorder = run_record.Recorder.start(tmp_path / "rec", "LoRA", COUNTS, 3)
    for value in (2.0, 1.0, 4.0):
        recorder.add_repeat({"x_ratio": value, "extra": value * 10})
    record = recorder.finish()
    written = json.loads((tmp_path / "rec" / "record.json").read_text())
    assert written == json.loads(json.dumps(record))
    assert written["command"] == "python benchmarks/lora.py --record docs/results/l --repeats 3"
    assert written["summary"] == {"x_ratio": {"median": 2.0, "min": 1.0, "max": 4.0, "n": 3}}
    assert [r["extra"] for r in written["repeats"]] == [20.0, 10.0, 40.0]
    assert written["machine"]["cpu_cores"] >= 1 and len(written["machine"]["load_after"]) == 3
    readme = (tmp_path / "rec" / "README.md").read_text()
    assert "| `x_ratio` | a over b | 2 | 1 | 4 | 3 |" in readme
    assert str(REPO) not in (tmp_path / "rec" / "record.json").read_text() + readme


def test_a_record_needs_three_repeats(tmp_path):
    with pytest.raises(ValueError, match="--repeats >= 3 \\(got 2\\)"):
        run_record.Recorder.start(tmp_path, "t", COUNTS, 2)
    assert run_record.Recorder.start(None, "t", COUNTS, 1).finish() is None  # no record asked: prints only


def test_a_repeat_missing_a_summarised_figure_is_refused():
    recorder = run_record.Recorder.start(None, "t", COUNTS, 1)
    with pytest.raises(KeyError, match="x_ratio"):
        recorder.add_repeat({"other": 1.0})


def test_paths_outside_the_repository_stay_as_given():
    assert run_record.relative("/elsewhere/file") == "/elsewhere/file"
    assert run_record.relative(str(REPO / "docs" / "x")) == "docs/x"
