"""The main job's task with each RL algorithm, from the same warm-up, in one run.

Variants (``--variants``, default all): ``grpo`` (the default recipe), ``grpo_ds`` (+ dynamic
sampling), ``gspo`` (sequence ratio, ``loss_agg: seq_mean``, clip 3e-4 / 4e-4 as in the paper),
``rloo`` (leave-one-out advantages) and ``cispo`` (clipped IS weight, upper clip 4.0 as in the paper),
plus ``lora`` (the default recipe with ``trainer.lora.rank: 16`` and 10x the learning rates, as in
``docs/results/bfcl-smollm2-lora-r16``) when asked. The supervised warm-up runs
once (``relax-agent train examples/bfcl.yaml trainer.steps=0``, evaluated with ``eval.after_warmup``)
and saves ``checkpoints/step_000000``; each variant then resumes from a copy of that checkpoint in its
own process (``--resume``), so every variant starts from the same weights, optimizer state and data
position. ``lora`` warms up its own adapters (a LoRA run cannot resume a full-weight checkpoint).
Equal rollout budget: every variant trains ``--steps`` steps of ``tasks_per_step x group_size``
samples; dynamic sampling draws more groups to fill them and the table says how many.

Printed per variant: held-out accuracy (the main job's evaluation: BFCL checker, 3 seeds) with its
spread, samples/s (trained samples over the training loop), groups drawn, median step time, peak RSS
and CPU-seconds of the process. Each variant's row is printed as it ends and appended to
``results.jsonl`` in the work folder; run again with the same ``--out`` and a finished warm-up and
finished variants are reused, not rerun (a crash or a kill loses only the variant it was in).

    .venv/bin/python benchmarks/algorithms.py                       # ~70 min on 2 idle CPU cores
    .venv/bin/python benchmarks/algorithms.py --variants grpo,lora  # LoRA next to full fine-tuning
    .venv/bin/python benchmarks/algorithms.py --steps 1 --warmup-steps 1 --eval-tasks 4 --eval-seeds 0 \\
        --tasks-per-step 2 --group-size 4 --variants grpo,gspo      # a smoke run (minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "bfcl.yaml"

VARIANTS: dict[str, list[str]] = {
    "grpo": [],
    "grpo_ds": ["rollout.dynamic_sampling.enabled=true"],
    "gspo": ["trainer.loss=gspo", "trainer.loss_agg=seq_mean", "trainer.clip_eps_low=3e-4", "trainer.clip_eps_high=4e-4"],
    "rloo": ["trainer.advantage=rloo"],
    "cispo": ["trainer.loss=cispo", "trainer.clip_eps_low=1.0", "trainer.clip_eps_high=4.0"],
    "lora": ["trainer.lora.rank=16", "trainer.sft_lr=1e-3", "trainer.lr=5e-4"],
}
DEFAULT = ["grpo", "grpo_ds", "gspo", "rloo", "cispo"]


def _train(name: str, args: argparse.Namespace, out: Path, extra: list[str], resume: bool) -> tuple[Path, Any]:
    """Run ``relax-agent train`` for one variant in its own process; returns its folder and rusage."""
    run_dir = out / name
    cmd = [sys.executable, "-m", "relax_agent.cli", "train", str(CONFIG), f"run.output_dir={run_dir}",
           f"trainer.steps={args.steps}", f"trainer.sft_warmup_steps={args.warmup_steps}",
           f"rollout.tasks_per_step={args.tasks_per_step}", f"rollout.group_size={args.group_size}",
           f"eval.num_tasks={args.eval_tasks}", f"eval.seeds=[{args.eval_seeds}]", "eval.at_start=false",
           f"run.num_threads={args.threads}", f"checkpoint.every_steps={args.steps}", "logging.tensorboard=false",
           *extra, "--quiet", *(["--resume"] if resume else [])]
    with (out / f"{name}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{name} failed; see {out / f'{name}.log'}")
    return run_dir, usage


def warm_up(args: argparse.Namespace, out: Path) -> tuple[Path, tuple[float, float]]:
    """The shared warm-up: its checkpoint (``step_000000``) and its held-out accuracy (mean, std)."""
    run_dir = out / "warmup"
    if not _warm_eval(run_dir):  # not finished before: run it (again)
        shutil.rmtree(run_dir, ignore_errors=True)
        _train("warmup", args, out, ["trainer.steps=0", "eval.after_warmup=true", "eval.at_end=false"], resume=False)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    warm = next(r for r in rows if "eval_warmup/accuracy" in r)
    return run_dir / "checkpoints" / "step_000000", (warm["eval_warmup/accuracy"], warm["eval_warmup/accuracy_std"])


def _warm_eval(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a finished warm-up: its checkpoint and its held-out evaluation."""
    metrics = run_dir / "metrics.jsonl"
    return ((run_dir / "checkpoints" / "step_000000").is_dir() and metrics.exists()
            and "eval_warmup/accuracy" in metrics.read_text())


def run_variant(name: str, args: argparse.Namespace, out: Path, warm_ckpt: Path) -> dict:
    """Train ``name`` from the shared warm-up checkpoint (``lora``: from its own warm-up)."""
    own = name == "lora"
    shutil.rmtree(out / name, ignore_errors=True)  # a variant killed half-way starts again
    if not own:
        shutil.copytree(warm_ckpt, out / name / "checkpoints" / warm_ckpt.name)
    run_dir, usage = _train(name, args, out, ["eval.after_warmup=false", *VARIANTS[name]], resume=not own)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward" in r]
    end = next(r for r in reversed(rows) if "eval/accuracy" in r)
    groups = sum(r.get("dynamic_sampling/drawn_groups", args.tasks_per_step) for r in steps)
    return {"name": name, "acc": end["eval/accuracy"], "acc_std": end["eval/accuracy_std"],
            "samples_per_s": sum(r.get("train/samples", 0.0) for r in steps) / sum(r["timing/step_s"] for r in steps),
            "groups": groups, "step_s": statistics.median(r["timing/step_s"] for r in steps),
            "rss_gb": usage.ru_maxrss / 2**20, "cpu_s": usage.ru_utime + usage.ru_stime}


def _check_same_settings(args: argparse.Namespace, out: Path) -> None:
    """Keep the settings of the first run in ``out/settings.json``; a later run in the same folder
    reuses its results only with the same settings (``--variants`` may differ)."""
    settings = {k: v for k, v in vars(args).items() if k not in ("variants", "out")}
    saved = out / "settings.json"
    if saved.exists() and (before := json.loads(saved.read_text())) != settings:
        changed = sorted(k for k in settings if before.get(k) != settings[k])
        raise SystemExit(f"{out} holds results of other settings ({', '.join(changed)}); use another --out")
    saved.write_text(json.dumps(settings, indent=1))


def _row(r: dict) -> str:
    return (f"{r['acc']:>7.3f} ± {r['acc_std']:.3f} {r['samples_per_s']:>9.3f} {r['groups']:>6.0f} "
            f"{r['step_s']:>7.1f} {r['rss_gb']:>11.2f} {r['cpu_s']:>7.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(DEFAULT), help=f"comma-separated, of {sorted(VARIANTS)}")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--tasks-per-step", type=int, default=6)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-tasks", type=int, default=50)
    p.add_argument("--eval-seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="work folder (default: a temporary one, kept)")
    args = p.parse_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="algorithms-"))
    out.mkdir(parents=True, exist_ok=True)
    _check_same_settings(args, out)
    load = os.getloadavg()[0]
    warm_ckpt, warm = warm_up(args, out)
    print(f"warm-up done: held-out accuracy {warm[0]:.3f} ± {warm[1]:.3f}", flush=True)
    results = out / "results.jsonl"
    done = {r["name"]: r for r in map(json.loads, results.read_text().splitlines())} if results.exists() else {}
    rows = []
    for n in names:  # each row is printed and kept in results.jsonl as it ends (a crash loses no row)
        if n in done:
            rows.append(done[n])
            print(f"{n}: reused from {results}", flush=True)
            continue
        rows.append(run_variant(n, args, out, warm_ckpt))
        with results.open("a") as f:
            f.write(json.dumps(rows[-1]) + "\n")
        print(f"{n} done: {_row(rows[-1])}", flush=True)
    print(f"BFCL simple, {args.warmup_steps} warm-up + {args.steps} RL steps x {args.tasks_per_step} x {args.group_size}, "
          f"{args.threads} threads; held-out {args.eval_tasks} tasks x seeds [{args.eval_seeds}]; "
          f"load at start {load:.1f}, at end {os.getloadavg()[0]:.1f}; work folder {out}")
    print(f"warm-up alone: held-out accuracy {warm[0]:.3f} ± {warm[1]:.3f} (every variant but lora starts there)")
    print(f"{'variant':<9} {'held-out acc':>14} {'samples/s':>9} {'groups':>6} {'step s':>7} {'peak RSS GB':>11} {'CPU s':>7}")
    for r in rows:
        print(f"{r['name']:<9} {_row(r)}")
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['name']} / {base['name']}: samples/s {r['samples_per_s'] / base['samples_per_s']:.2f}x, "
              f"held-out accuracy {r['acc'] - base['acc']:+.3f}")
    print(f"plot: {plot(out, rows, warm)}")


def plot(out: Path, rows: list[dict], warm: tuple[float, float]) -> Path:
    """``out/comparison.png``: held-out accuracy per variant (± std over seeds) beside the warm-up's,
    and each variant's training reward per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, reward) = plt.subplots(1, 2, figsize=(11, 4))
    acc.bar([r["name"] for r in rows], [r["acc"] for r in rows], yerr=[r["acc_std"] for r in rows], capsize=4)
    acc.axhline(warm[0], ls="--", color="k", label=f"warm-up alone {warm[0]:.3f} ± {warm[1]:.3f}")
    acc.set_ylabel("held-out accuracy (BFCL checker)")
    acc.set_title("held-out accuracy at the end")
    acc.legend(loc="lower right")
    for i, r in enumerate(rows):
        metrics = [json.loads(x) for x in (out / r["name"] / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "rollout/reward" in m]
        reward.plot([m["step"] for m in steps], [m["rollout/reward"] for m in steps], label=r["name"],
                    ls=("-", "--", ":")[i % 3], marker="o")  # equal curves (see the docs) stay visible
    reward.set_xlabel("RL step")
    reward.set_ylabel("training reward (step mean)")
    reward.set_title("training reward per step")
    reward.legend()
    fig.tight_layout()
    path = out / "comparison.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
