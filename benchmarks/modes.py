"""The same GRPO workload in the three training modes: colocate, async s=0, async s=k.

Workload: the Echo task ("Repeat exactly: WORD", reward = character similarity of the reply)
behind a tool call with a long-tailed latency: every ``env.step`` first waits for a simulated
tool / sandbox execution whose duration is drawn from a lognormal distribution (median
``--latency-median-s``, log-std ``--latency-sigma``, capped at ``--latency-cap-s``), seeded
per episode, so every mode sees the same latency for the same sample. The policy is a tiny
random llama (``--model PATH`` for another one). Each mode trains ``--steps`` steps with the
same seed, config and data order; reported per mode: samples/s (samples consumed by the
trainer / wall time of the training loop, model loading excluded), mean step time, trainer
idle time waiting for data, reward over the last half of the steps, staleness and dropped
groups; and the samples/s ratio against colocate, measured in the same run.

    python benchmarks/modes.py                        # ~3-5 minutes on 2 CPU cores
    python benchmarks/modes.py --repeats 2            # each mode twice, order rotated
    python benchmarks/modes.py --steps 20 --staleness 2 --latency-median-s 0.5
    python benchmarks/modes.py --baseline-rev 6baa57a # + colocate of an earlier commit, same run
    python benchmarks/modes.py --repeats 3 --record docs/results/async-colocate/   # record: ratios per repeat

``--baseline-rev REV`` also trains colocate with the code of git revision ``REV`` (extracted with
``git archive`` into a temporary package tree and run in a subprocess, rotated with the other
modes) and prints today's colocate samples/s against it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for examples/

from run_record import Recorder, add_record_args  # noqa: E402

from examples.custom_env import EchoEnv  # noqa: E402
from relax_agent.envs import register  # noqa: E402

ENV_ID = "bench/SlowToolEcho-v0"


class SlowToolEcho(EchoEnv):
    """The example Echo env behind a slow tool: ``step`` waits a lognormal latency, then scores.

    Args:
        latency_median_s: median tool latency in seconds.
        latency_sigma: log-std of the latency (1.0: p90 ≈ 3.6× the median, p99 ≈ 10×).
        latency_cap_s: longest latency.
        num_tasks: dataset size (3/4 train, 1/4 held out).
    """

    def __init__(self, latency_median_s: float = 0.5, latency_sigma: float = 1.0, latency_cap_s: float = 6.0,
                 num_tasks: int = 64):
        super().__init__(num_tasks)
        self.latency = (float(np.log(latency_median_s)), latency_sigma, latency_cap_s)

    def step(self, action):
        mu, sigma, cap = self.latency
        time.sleep(min(float(self.np_random.lognormal(mu, sigma)), cap))  # the tool / sandbox call
        return super().step(action)


register(id=ENV_ID, entry_point=SlowToolEcho)


def run_mode(args: argparse.Namespace, model_path: str, out: Path, mode: str, staleness: int) -> dict[str, Any]:
    """Train one mode in this process; returns its summary."""
    from relax_agent.config import validate_config
    from relax_agent.control import build_controller
    from relax_agent.metrics import read_metrics
    from relax_agent.roles import build_run_roles

    cfg = validate_config({
        "mode": mode, "max_staleness": staleness,
        "run": {"output_dir": str(out), "seed": args.seed},
        "model": {"path": model_path},
        "env": {"id": ENV_ID, "kwargs": {"latency_median_s": args.latency_median_s,
                                         "latency_sigma": args.latency_sigma, "latency_cap_s": args.latency_cap_s}},
        "rollout": {"tasks_per_step": args.tasks_per_step, "group_size": args.group_size,
                    "max_new_tokens": args.max_new_tokens, "max_total_tokens": 512},
        "trainer": {"steps": args.steps, "lr": args.lr, "micro_batch_size": 8,
                    "off_policy": "tis" if staleness > 0 else "none"},
        "eval": {"at_start": False, "at_end": False},
        "checkpoint": {"every_steps": 0},
        "logging": {"tensorboard": False, "progress": False, "plot": False},
    }, "benchmarks/modes.py")
    cpu0 = time.process_time()  # model loading included, as for --baseline-rev
    ctrl = build_controller(cfg, build_run_roles(cfg))
    try:
        ctrl.train()
    finally:
        ctrl.close()
    cpu_s = time.process_time() - cpu0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "rollout/reward" in r]
    wall_s = sum(r["timing/step_s"] for r in rows)
    samples = len(rows) * args.tasks_per_step * args.group_size
    late = rows[len(rows) // 2:]
    return {
        "mode": mode if mode == "colocate" else f"async s={staleness}",
        "steps": len(rows),
        "samples_per_s": samples / wall_s,
        "step_s": statistics.fmean(r["timing/step_s"] for r in rows),
        "data_wait_s": statistics.fmean(r["timing/data_wait_s"] for r in rows),
        "reward_first_half": statistics.fmean(r["rollout/reward"] for r in rows[: len(rows) // 2]),
        "reward_last_half": statistics.fmean(r["rollout/reward"] for r in late),
        "staleness_mean": statistics.fmean(r.get("async/staleness_mean", 0.0) for r in rows),
        "dropped_groups": sum(r.get("async/dropped_groups", 0.0) for r in rows),
        "wall_s": wall_s,
        "cpu_s_per_step": cpu_s / max(len(rows), 1),
    }


def run_baseline(args: argparse.Namespace, model_path: str, out: Path, tree: Path) -> dict[str, Any]:
    """Colocate with the code of ``args.baseline_rev``: its ``benchmarks/modes.py:run_mode`` in a
    subprocess over a package tree laid out as the wheel maps it (envs/ -> relax_agent/envs ...)."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    src, pkg = tree / "src", tree / "pkg"
    if not src.exists():
        src.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", args.baseline_rev], cwd=repo, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        import shutil

        shutil.copytree(src / "relax_agent", pkg / "relax_agent")
        for sub in ("envs", "sandboxes", "reward_services"):
            shutil.copytree(src / sub, pkg / "relax_agent" / sub)
    code = ("import json, sys, argparse; sys.path[:0] = [sys.argv[1], 'benchmarks', '.']; import modes; "
            "a = argparse.Namespace(**json.loads(sys.argv[2])); "
            "import time; c0 = time.process_time(); "
            "r = modes.run_mode(a, sys.argv[3], __import__('pathlib').Path(sys.argv[4]), 'colocate', 0); "
            "r['cpu_s_per_step'] = (time.process_time() - c0) / max(r['steps'], 1); "
            "r['mode'] = 'baseline'; print('RESULT', json.dumps(r))")
    params = {k: v for k, v in vars(args).items() if k not in ("json", "model")}
    done = subprocess.run([sys.executable, "-c", code, str(pkg), json.dumps(params), model_path, str(out)], cwd=src,
                          capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    result["mode"] = f"colocate@{args.baseline_rev}"
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--staleness", type=int, default=2, help="k of the fully async mode")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--latency-median-s", type=float, default=0.5)
    p.add_argument("--latency-sigma", type=float, default=1.0)
    p.add_argument("--latency-cap-s", type=float, default=6.0)
    p.add_argument("--model", default=None, help="policy path (default: a tiny random llama)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, in rotating order (means reported)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--baseline-rev", default=None, help="also run colocate with the code of this git revision")
    add_record_args(p, repeats=None)
    args = p.parse_args()
    recorder = Recorder.start(args.record, f"Training modes: async (max_staleness {args.staleness}) against colocate", {
        f"async_s{args.staleness}_vs_colocate": f"samples/s of async with max_staleness {args.staleness} / colocate's, "
                                                "the same repeat",
        "async_s0_vs_colocate": "samples/s of async with max_staleness 0 / colocate's, the same repeat",
        "colocate_samples_per_s": "samples consumed by the trainer / training-loop wall time, colocate",
        f"async_s{args.staleness}_samples_per_s": f"the same, async with max_staleness {args.staleness}",
    }, args.repeats)

    modes = [("colocate", 0), ("async", 0), ("async", args.staleness)]
    if args.baseline_rev:
        modes.append(("baseline", 0))
    runs: list[list[dict[str, Any]]] = [[] for _ in modes]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from relax_agent.models import make_tiny_model

            args.model = str(make_tiny_model(Path(tmp) / "tiny", arch="llama", seed=0))
        for rep in range(args.repeats):  # rotate the order so a drifting machine load hits every mode
            for k in range(len(modes)):
                i = (k + rep) % len(modes)
                out = Path(tmp) / f"r{rep}-m{i}"
                if modes[i][0] == "baseline":
                    runs[i].append(run_baseline(args, args.model, out, Path(tmp) / "baseline"))
                else:
                    runs[i].append(run_mode(args, args.model, out, *modes[i]))
    results = [{**r[0], **{key: statistics.fmean(x[key] for x in r) for key in r[0] if key not in ("mode", "steps")},
                "samples_per_s_runs": [x["samples_per_s"] for x in r]} for r in runs]
    base = results[0]["samples_per_s"]
    print(f"{args.steps} steps x {args.tasks_per_step} groups x {args.group_size} samples, {args.repeats} run(s) per "
          f"mode; tool latency lognormal (median {args.latency_median_s} s, sigma {args.latency_sigma}, "
          f"cap {args.latency_cap_s} s)")
    print(f"{'mode':<12} {'samples/s':>9} {'vs colocate':>11} {'step s':>7} {'wait s':>7} "
          f"{'reward 1st/2nd half':>20} {'staleness':>9} {'dropped':>7}")
    for r in results:
        r["speedup_vs_colocate"] = r["samples_per_s"] / base
        print(f"{r['mode']:<12} {r['samples_per_s']:>9.2f} {r['speedup_vs_colocate']:>10.2f}x {r['step_s']:>7.2f} "
              f"{r['data_wait_s']:>7.2f} {r['reward_first_half']:>9.3f} / {r['reward_last_half']:<8.3f} "
              f"{r['staleness_mean']:>9.2f} {r['dropped_groups']:>7.0f}   runs: "
              + " ".join(f"{x:.2f}" for x in r["samples_per_s_runs"]))
    if args.baseline_rev:
        now, then = results[0], results[-1]
        print(f"colocate vs colocate at {args.baseline_rev}: {base / then['samples_per_s']:.2f}x samples/s "
              f"(step s {now['step_s']:.2f} vs {then['step_s']:.2f}); process CPU per step "
              f"{now['cpu_s_per_step']:.2f} s vs {then['cpu_s_per_step']:.2f} s "
              f"(then / now {then['cpu_s_per_step'] / now['cpu_s_per_step']:.2f}; above 1: the new code uses less CPU)")
    for rep in range(args.repeats):
        colocate, async0, async_k = (runs[i][rep]["samples_per_s"] for i in range(3))
        recorder.add_repeat({f"async_s{args.staleness}_vs_colocate": async_k / colocate,
                             "async_s0_vs_colocate": async0 / colocate, "colocate_samples_per_s": colocate,
                             f"async_s{args.staleness}_samples_per_s": async_k, "async_s0_samples_per_s": async0})
    recorder.finish()
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
