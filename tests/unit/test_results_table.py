"""The README's results table and docs/results.md's tables say what the committed records say.

`benchmarks/report.py --check` rebuilds every table from docs/results/ and lists the rows that differ;
these tests run it on the committed tree and show that it catches a changed number and a row with no record.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_report():
    spec = importlib.util.spec_from_file_location("results_report", REPO / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


report = _load_report()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the two files with tables, beside the committed records (linked, not copied)."""
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / report.README, tmp_path / report.README)
    shutil.copy(REPO / report.RESULTS_PAGE, tmp_path / report.RESULTS_PAGE)
    (tmp_path / report.RESULTS).symlink_to(REPO / report.RESULTS, target_is_directory=True)
    return tmp_path


def test_committed_tables_match_their_records():
    diffs = report.run(REPO, check=True)
    assert diffs == [], "tables differ from the records; run python benchmarks/report.py:\n" + "\n".join(diffs)


def test_check_reports_a_number_that_differs_from_its_record(tree: Path):
    page = tree / report.RESULTS_PAGE
    text = page.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| after the 10-step warm-up alone |"))
    page.write_text(text.replace(row, row.replace("0.380 ± 0.043", "0.400 ± 0.043")))
    diffs = report.run(tree, check=True)
    assert diffs == [f"{report.RESULTS_PAGE} [main-job] - {row.replace('0.380 ± 0.043', '0.400 ± 0.043')}",
                     f"{report.RESULTS_PAGE} [main-job] + {row}"]
    assert page.read_text() != text  # check mode left the edited file alone


def test_rewrite_restores_the_records_numbers(tree: Path):
    readme = tree / report.README
    original = readme.read_text()
    begin, end = report.markers("readme")
    head, rest = original.split(begin + "\n")
    readme.write_text(head + begin + "\n| stale | 9.99× | nowhere |\n" + rest[rest.index(end):])
    assert report.run(tree, check=False)  # rows rewritten
    assert readme.read_text() == original
    assert report.run(tree, check=True) == []


def test_a_row_without_a_record_is_refused_unless_marked_no_record_yet(monkeypatch):
    def rows(_records):
        return [report.Row("made-up-claim", ("x", "2.00×", "page"), ())]

    table = report.Table(report.README, "readme", ("what", "result", "record"), rows)
    with pytest.raises(report.RecordError, match="made-up-claim"):
        report.render(table, REPO)
    monkeypatch.setattr(report, "NO_RECORD_YET", frozenset({"slow-benchmark"}))
    allowed = report.Table(report.README, "readme", ("what", "result", "record"),
                           lambda _r: [report.Row("slow-benchmark", ("x", "no record yet", "page"), ())])
    assert report.render(allowed, REPO)[-1] == "| x | no record yet | page |"


def test_every_readme_row_has_a_record():
    rows = [line for line in report.render(report.TABLES[0], REPO) if "no record yet" in line]
    assert rows == [] and report.NO_RECORD_YET == frozenset()


def test_a_missing_record_folder_is_an_error(tmp_path: Path):
    with pytest.raises(report.RecordError, match="docs/results/nowhere/ does not exist"):
        report.Records(tmp_path, report.README).folder("nowhere")


def test_a_missing_marker_is_an_error():
    with pytest.raises(report.RecordError, match="results-table:readme:begin"):
        report.region("no markers here\n", "readme", report.README)
