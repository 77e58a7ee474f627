"""Draw curves.png from the runs copied here: the warm-up's loss per update and the held-out accuracy.

    .venv/bin/python docs/results/visual-count-tiny-vl/plot.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
CHANCE = 0.25  # a uniform guess among 1-4
RUNS = {  # folder: label
    "warmup_grpo": "wide-init tiny-vl, seed 0: warm-up + GRPO",
    "warmup_grpo_seed1": "wide-init tiny-vl, seed 1: warm-up + GRPO",
    "warmup_only": "wide-init tiny-vl, seed 0: warm-up only",
    "default_init_warmup_only": "default tiny-vl: warm-up only",
}


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main() -> None:
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, (folder, label) in enumerate(RUNS.items()):
        run = HERE / folder
        if not run.is_dir():
            continue
        sft = rows(run / "sft.jsonl")
        if sft and folder != "warmup_only":  # the same warm-up as warmup_grpo (seed 0): drawn once
            loss_ax.plot([r["sft/step"] for r in sft], [r["sft/loss"] for r in sft], lw=0.8, label=label, color=f"C{i}")
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        warmup = summary.get("sft", {}).get("sft/steps", 0)
        pts = [(warmup + r["step"], r["eval/accuracy"], r.get("eval/accuracy_std") or 0.0)
               for r in rows(run / "metrics.jsonl") if "eval/accuracy" in r]
        if "eval_start" in summary:  # before the warm-up, at update 0
            pts[0] = (0, *pts[0][1:])
        if pts:
            x, y, e = zip(*pts, strict=True)
            acc_ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=label, color=f"C{i}",
                            linestyle="none")  # no held-out evaluation inside the warm-up: points, not a curve
    loss_ax.set_yscale("log")
    loss_ax.set_xlabel("warm-up update (32 demonstrations each)")
    loss_ax.set_title("supervised warm-up: token-mean NLL of the reply")
    loss_ax.legend(fontsize=8)
    for y, text, style, dy in ((CHANCE, "chance (1/4)", ":", -0.035), (2 * CHANCE, "2x chance", "--", 0.01),
                               (0.2775, "majority answer", "-.", 0.01)):
        acc_ax.axhline(y, color="gray", linestyle=style, lw=1)
        acc_ax.text(5, y + dy, text, color="gray", fontsize=8)
    acc_ax.set_ylim(-0.03, 1.03)
    acc_ax.set_xlabel("updates (1500 warm-up, then GRPO steps)")
    acc_ax.set_title("held-out accuracy = reward (400 tasks, mean ± std over 3 eval seeds)")
    acc_ax.legend(fontsize=8, loc="center right")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "curves.png", dpi=110)


if __name__ == "__main__":
    main()
