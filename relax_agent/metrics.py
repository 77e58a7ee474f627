"""Run metrics: console progress, JSONL, TensorBoard and PNG plots.

Metric keys are namespaced constants (``rollout/reward``, ``timing/step_s``, ``eval/accuracy``).
``metrics.jsonl`` survives resume: a resumed run moves the rows of the steps it will redo to
``metrics.superseded.jsonl`` (:meth:`MetricsLogger.supersede_after`), so each step has one row set;
:func:`read_metrics` also keeps only the last row per step and kind.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

REWARD = "rollout/reward"
ACCURACY = "rollout/accuracy"
FORMAT_RATE = "rollout/well_formed"
TOKENS_PER_S = "rollout/tokens_per_s"
STEP_TIME = "timing/step_s"
DATA_WAIT = "timing/data_wait_s"
"""Seconds the trainer sat idle waiting for rollouts in a step (colocate: the whole rollout)."""
SAMPLES_PER_S = "timing/samples_per_s"
"""Samples consumed by the step per second of step wall time."""
PREFIX_CACHE_HIT_RATE = "rollout/prefix_cache_hit_rate"
"""Prompt tokens whose KV came from the engine's prefix cache / prompt tokens, since the previous step."""
CROSSED_UPDATE_TURNS = "rollout/crossed_update_turns"
"""Fraction of the step's turns whose tokens were sampled under more than one policy version."""
EVAL_ACCURACY = "eval/accuracy"
EVAL_FORMAT_RATE = "eval/well_formed"
EVAL_REWARD = "eval/reward"


class MetricsLogger:
    """Writes one row per step to JSONL and TensorBoard; draws plots on demand.

    Args:
        output_dir: run folder; writes ``metrics.jsonl``, ``tensorboard/``, ``plots/``.
        tensorboard: also write TensorBoard event files.
    """

    def __init__(self, output_dir: str | Path, tensorboard: bool = True):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append ``metrics`` for ``step`` (non-finite and non-numeric values are kept as null/str)."""
        row = {"step": step, "time": time.time(), **{k: _clean(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def supersede_after(self, step: int) -> int:
        """Move the rows of steps after ``step`` (the resumed checkpoint's) from ``metrics.jsonl`` to
        ``metrics.superseded.jsonl``: the resumed run writes those steps again. Returns the rows moved.

        The kept rows are written to a temporary file that replaces ``metrics.jsonl``: a crash leaves
        one whole file or the other; moved rows are appended to the superseded file first."""
        if not self.path.exists():
            return 0
        keep: list[str] = []
        moved: list[str] = []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                later = int(json.loads(line).get("step", 0)) > step
            except (ValueError, TypeError, AttributeError):  # a half-written last line of a crash
                later = True
            (moved if later else keep).append(line)
        if moved:
            with (self.dir / "metrics.superseded.jsonl").open("a") as f:
                f.write("".join(line + "\n" for line in moved))
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            tmp.replace(self.path)
        return len(moved)

    def log_histogram(self, step: int, key: str, values: list[float]) -> None:
        """A TensorBoard histogram of ``values`` at ``step`` (the JSONL row carries the counts)."""
        if self._tb is not None and values:
            import numpy as np

            self._tb.add_histogram(key, np.asarray(values, dtype=np.float64), step)
            self._tb.flush()

    def close(self) -> None:
        """Flush and close the TensorBoard writer (idempotent)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return str(v)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of ``metrics.jsonl`` ordered by step, the last row written for each (step, kind) kept."""
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    p = Path(path)
    if not p.exists():
        return []
    for line in p.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[(row["step"], _row_kind(row))] = row
    return [rows[k] for k in sorted(rows)]


def _row_kind(row: dict[str, Any]) -> str:
    """"eval" for a step's evaluation, "eval_<name>" for a named one (``eval_warmup/*``), else ""."""
    for key in row:
        head, sep, _ = key.partition("/")
        if sep and (head == "eval" or head.startswith("eval_")):
            return head
    return ""


def plot_curves(metrics_path: str | Path, out_png: str | Path) -> Path:
    """Draw reward/accuracy/format-rate curves (training), eval points and, when the run has them,
    the staleness of the trained samples (async mode) and the rollout replicas and restarts per
    role (``runtime: ray``) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    stale = [(r["step"], r["async/staleness_mean"], r["async/staleness_max"]) for r in rows if "async/staleness_mean" in r]
    roles = [r for r in rows if "runtime/rollout_replicas" in r]
    panels = 2 + bool(stale) + bool(roles)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), sharex=True)
    colors = {"reward": "tab:blue", "accuracy": "tab:green", "well-formed calls": "tab:orange"}
    for key, label in ((REWARD, "reward"), (ACCURACY, "accuracy"), (FORMAT_RATE, "well-formed calls")):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            axes[0].plot(*zip(*pts, strict=True), marker=".", label=label, color=colors[label])
    axes[0].set_title("training rollouts")
    for key, label in ((EVAL_REWARD, "reward"), (EVAL_ACCURACY, "accuracy"), (EVAL_FORMAT_RATE, "well-formed calls")):
        with_std = [(r["step"], r[key], r.get(key + "_std") or 0.0) for r in rows if r.get(key) is not None]
        if with_std:
            s, m, e = zip(*with_std, strict=True)
            axes[1].errorbar(s, m, yerr=e, marker="o", capsize=3, label=label, color=colors[label])
    warm = [(r["step"], r["eval_warmup/accuracy"], r.get("eval_warmup/accuracy_std") or 0.0)
            for r in rows if r.get("eval_warmup/accuracy") is not None]
    if warm:  # the supervised warm-up's own share, evaluated before RL
        s, m, e = zip(*warm, strict=True)
        axes[1].errorbar(s, m, yerr=e, marker="x", capsize=3, linestyle="none", color="black",
                         label="accuracy after warm-up")
    axes[1].set_title("held-out evaluation (mean ± std over seeds)")
    if stale:  # async mode: how many policy versions the trained samples lagged
        s, mean, high = zip(*stale, strict=True)
        axes[2].plot(s, mean, marker=".", label="mean", color="tab:purple")
        axes[2].plot(s, high, marker=".", label="max", color="tab:red")
        axes[2].set_title("staleness of trained samples (versions)")
    if roles:  # runtime: ray: replicas serving and restarts so far, per role
        ax = axes[-1]
        for key, label, color, style in (("runtime/rollout_target", "replica target", "tab:gray", "--"),
                                         ("runtime/rollout_replicas", "rollout replicas", "tab:blue", "-"),
                                         ("runtime/rollout_restarts", "rollout restarts", "tab:red", "-"),
                                         ("runtime/trainer_restarts", "trainer restarts", "tab:purple", "-")):
            pts = [(r["step"], r[key]) for r in roles if r.get(key) is not None]
            if pts:
                ax.step(*zip(*pts, strict=True), where="post", marker=".", label=label, color=color, linestyle=style)
        ax.set_title("runtime: replicas and restarts")
    last = max((r["step"] for r in rows), default=1)
    for ax in axes:
        ax.set_xlim(-0.5, last + 0.5)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
