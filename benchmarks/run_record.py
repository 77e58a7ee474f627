"""A benchmark's own record: ``--record docs/results/<name>/`` writes ``record.json`` and ``README.md``.

The record holds what a reader needs to trust or redo a number: the command (paths relative to the
repository root), the commit (``git rev-parse HEAD``, and whether the tree had uncommitted changes),
the machine (CPU cores, ``os.getloadavg()`` before and after, the busiest other processes by name),
every repeat's raw figures and, per figure, the median and the spread (min, max) over the repeats.
``benchmarks/report.py`` builds the README's and ``docs/results.md``'s tables from these files.

Use from a benchmark::

    add_record_args(parser)                      # --record DIR, --repeats N (default 3)
    recorder = Recorder.start(args.record, "Weight sync ...", {"tcp_publish_gbps": "GB/s ..."}, args.repeats)
    for _ in range(args.repeats):
        recorder.add_repeat({"tcp_publish_gbps": 0.91, ...})
    recorder.finish()                            # prints the summary; writes the files if --record was given
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD_FILE = "record.json"
MIN_REPEATS = 3


def add_record_args(parser: argparse.ArgumentParser, repeats: int | None = MIN_REPEATS) -> None:
    """Adds ``--record DIR`` (write the record there) and ``--repeats N`` (whole measurements, each one a repeat;
    ``repeats`` None: the benchmark has its own ``--repeats``)."""
    parser.add_argument("--record", type=Path, default=None,
                        help="write record.json and README.md into this folder (e.g. docs/results/<name>/)")
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats,
                            help=f"whole measurements to run; a record needs >= {MIN_REPEATS}")


def relative(arg: str) -> str:
    """``arg`` with an absolute path under the repository root made relative to it (others unchanged)."""
    path = Path(arg)
    if path.is_absolute() and path.resolve().is_relative_to(REPO):
        return str(path.resolve().relative_to(REPO))
    return arg


def command_line(argv: list[str]) -> str:
    """The command that reproduces this run from the repository root: ``python benchmarks/x.py ...``."""
    return shlex.join(["python", relative(str(Path(argv[0]).resolve())), *(relative(a) for a in argv[1:])])


def git_commit() -> dict[str, object]:
    """``{"commit": <HEAD sha>, "uncommitted_changes": bool}`` of the repository (``"unknown"`` outside git)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or "unknown",
            "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no"))}


def busiest_processes(n: int = 5) -> list[str]:
    """The ``n`` processes using the most CPU now, as ``"<percent> <name>"`` (names only: no arguments, no paths)."""
    out = subprocess.run(["ps", "-eo", "pcpu=,comm=", "--sort=-pcpu"], capture_output=True, text=True, check=False)
    return [" ".join(line.split()) for line in out.stdout.splitlines()[:n]]


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max and count of one figure over the repeats."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


@dataclass
class Recorder:
    """Collects the repeats of one benchmark run and writes its record.

    ``counts`` maps each figure's key to what it counts (unit included); only these keys are summarised.
    """

    folder: Path | None
    title: str
    counts: dict[str, str]
    command: str
    load_before: tuple[float, float, float]
    processes_before: list[str]
    repeats: list[dict[str, float]] = field(default_factory=list)
    once: dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(cls, folder: Path | None, title: str, counts: dict[str, str], repeats: int) -> Recorder:
        """Notes the command and the load now; ``folder`` None prints the summary without writing a record.

        Raises ``ValueError`` when a record is asked for with fewer than ``MIN_REPEATS`` repeats.
        """
        if folder is not None and repeats < MIN_REPEATS:
            raise ValueError(f"--record needs --repeats >= {MIN_REPEATS} (got {repeats}): a record states a spread")
        return cls(folder, title, counts, command_line(sys.argv), os.getloadavg(), busiest_processes())

    def add_repeat(self, figures: dict[str, float]) -> None:
        """One whole measurement's figures; raises ``KeyError`` naming a summarised figure it lacks."""
        missing = sorted(set(self.counts) - set(figures))
        if missing:
            raise KeyError(f"repeat {len(self.repeats) + 1} lacks the figures {missing}; expected every key of counts")
        self.repeats.append(dict(figures))

    def add_once(self, figures: dict[str, float]) -> None:
        """Figures measured once per run, not per repeat (recorded apart, with no spread)."""
        self.once.update(figures)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per summarised figure: median, min, max, n over the repeats (empty before the first repeat)."""
        return {key: spread([r[key] for r in self.repeats]) for key in self.counts} if self.repeats else {}

    def finish(self) -> dict[str, object] | None:
        """Prints the summary; with a folder, writes ``record.json`` and ``README.md`` there and returns the record.

        Raises ``ValueError`` when fewer than ``MIN_REPEATS`` repeats were added to a record.
        """
        summary = self.summary()
        for key, s in summary.items():
            print(f"{key}: median {s['median']:.4g} (min {s['min']:.4g}, max {s['max']:.4g}, n {s['n']})")
        if self.folder is None:
            return None
        if len(self.repeats) < MIN_REPEATS:
            raise ValueError(f"--record needs --repeats >= {MIN_REPEATS} (got {len(self.repeats)})")
        record = {"title": self.title, "command": self.command, **git_commit(),
                  "machine": {"cpu_cores": os.cpu_count(), "load_before": list(self.load_before),
                              "load_after": list(os.getloadavg()), "busiest_processes_before": self.processes_before,
                              "busiest_processes_after": busiest_processes()},
                  "counts": self.counts, "repeats": self.repeats, "summary": summary, "measured_once": self.once}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
        (self.folder / "README.md").write_text(readme(record))
        print(f"record: {relative(str(self.folder.resolve()))}/{RECORD_FILE}")
        return record


def readme(record: dict) -> str:
    """The record folder's README: command, commit, machine and load, and the summary table."""
    machine = record["machine"]
    load = f"load average (1, 5, 15 min) {fmt_load(machine['load_before'])} before, {fmt_load(machine['load_after'])} after"
    lines = [f"# {record['title']}", "", "```bash", record["command"], "```", "",
             f"Commit `{record['commit']}`" + (" (with uncommitted changes)" if record["uncommitted_changes"] else "")
             + f"; {machine['cpu_cores']} CPU cores, {load}.",
             "The CPU may have been shared with other processes while this ran (the busiest are listed in `record.json`): the timings carry that noise, which is "
             "why every figure is the median of the repeats with its min and max.", "",
             "| figure | what it counts | median | min | max | repeats |", "|---|---|---|---|---|---|"]
    for key, s in record["summary"].items():
        what = record["counts"][key].replace("|", "\\|")  # a | inside a cell would end it
        lines.append(f"| `{key}` | {what} | {s['median']:.4g} | {s['min']:.4g} | {s['max']:.4g} | {s['n']} |")
    if record["measured_once"]:
        lines += ["", "Measured once in the run (no spread): "
                  + ", ".join(f"`{k}` {v:.4g}" for k, v in record["measured_once"].items()) + "."]
    lines += ["", f"Every repeat's figures, the busiest processes before and after: `{RECORD_FILE}`.", ""]
    return "\n".join(lines)


def fmt_load(load: list[float]) -> str:
    return ", ".join(f"{x:.1f}" for x in load)
