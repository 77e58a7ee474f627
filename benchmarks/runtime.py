"""``runtime: ray`` against ``runtime: local`` on the modes workload, and rollout failover times.

Workload: benchmarks/modes.py's Echo task behind a slow tool (every ``env.step`` waits a lognormal
latency, median ``--latency-median-s``, seeded per episode), a tiny random llama, async mode with
``--staleness`` versions of lag. Each rollout replica plays at most ``--groups-per-replica`` groups at
once (``runtime.max_groups_per_replica``: the env / sandbox slots a real replica has), so the
workload is bound by tool latency per replica and replicas add capacity; the local runtime has no
such limit (only the staleness gate). Runs, in one Ray session and one process:

1. samples/s of ``runtime: local``, ``runtime: ray`` with 1 replica and with 2 replicas, and with 1
   replica without the cap (the local run's concurrency: what the runtime itself costs) (same seed,
   config and data order; samples consumed by the trainer / wall time of the steps), and the ratios;
2. failover: a ``runtime: ray`` run with 2 replicas trains while one replica is SIGKILLed ``--kills``
   times (one at a time): seconds from the kill until the replacement is ready (engine loaded,
   latest weights pulled: it takes groups) and until it finished its first group; p50 and max.

    python benchmarks/runtime.py                     # ~6 minutes on 2 CPU cores
    python benchmarks/runtime.py --repeats 2 --json runtime.json   # each configuration twice, order rotated
    python benchmarks/runtime.py --repeats 3 --record docs/results/ray-replicas/   # ratios per repeat, failover once

Targets (issue 13): 2 replicas >= 1.6x 1 replica; failover (kill -> replacement ready) p50 <= 15 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]  # examples/ and modes.py, here and (PYTHONPATH) in every Ray worker

import modes  # noqa: E402  (registers bench/SlowToolEcho-v0)
from run_record import Recorder, add_record_args  # noqa: E402

ENV_ID = f"modes:{modes.ENV_ID}"
"""The module prefix makes every replica import (and so register) the env before looking it up."""


def config(args: argparse.Namespace, model: str, out: Path, runtime: dict[str, Any], steps: int | None = None) -> Any:
    from relax_agent.config import validate_config

    return validate_config({
        "mode": "async", "max_staleness": args.staleness,
        "run": {"output_dir": str(out), "seed": args.seed, "num_threads": 1},
        "model": {"path": model},
        "env": {"id": ENV_ID, "kwargs": {"latency_median_s": args.latency_median_s,
                                         "latency_sigma": args.latency_sigma, "latency_cap_s": args.latency_cap_s}},
        "rollout": {"tasks_per_step": args.tasks_per_step, "group_size": args.group_size,
                    "max_new_tokens": args.max_new_tokens, "max_total_tokens": 512},
        "trainer": {"steps": steps or args.steps, "lr": 1e-3, "micro_batch_size": 8,
                    "off_policy": "tis" if args.staleness > 0 else "none"},
        "weights": {"transport": "tcp"},
        "eval": {"at_start": False, "at_end": False},
        "checkpoint": {"every_steps": 0},
        "logging": {"tensorboard": False, "progress": False, "plot": False},
        "runtime": runtime,
    }, "benchmarks/runtime.py")


def build(cfg: Any) -> Any:
    from relax_agent.control import build_controller
    from relax_agent.roles import build_run_roles

    return build_controller(cfg, build_run_roles(cfg))


def throughput(args: argparse.Namespace, model: str, out: Path, name: str, runtime: dict[str, Any]) -> dict[str, Any]:
    """Train one configuration; samples/s over the steps' wall time (actor start-up excluded)."""
    from relax_agent.metrics import read_metrics

    ctrl = build(config(args, model, out, runtime))
    try:
        ctrl.train()
    finally:
        ctrl.close()
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "rollout/reward" in r]
    wall_s = sum(r["timing/step_s"] for r in rows)
    return {"run": name, "steps": len(rows), "samples_per_s": len(rows) * args.tasks_per_step * args.group_size / wall_s,
            "step_s": statistics.fmean(r["timing/step_s"] for r in rows),
            "data_wait_s": statistics.fmean(r["timing/data_wait_s"] for r in rows),
            "staleness_mean": statistics.fmean(r.get("async/staleness_mean", 0.0) for r in rows), "wall_s": wall_s}


def failover(args: argparse.Namespace, model: str, out: Path) -> dict[str, Any]:
    """SIGKILL a ready replica ``args.kills`` times while training; time each replacement."""
    from relax_agent.runtime.ray_rollout import READY

    ctrl = build(config(args, model, out, {"kind": "ray", "rollout_replicas": 2, "trainer_num_cpus": 0.25,
                                            "max_groups_per_replica": args.groups_per_replica,
                                            "heartbeat_interval_s": 0.5}, steps=100_000))
    pool = ctrl.runtime.rollout.pool
    ready_s: list[float] = []
    serving_s: list[float] = []
    errors: list[BaseException] = []

    def wait(cond: Any, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError("failover benchmark: a replacement did not come up within 600 s")
            time.sleep(0.05)

    def kill_loop() -> None:
        try:
            for _ in range(args.kills):
                wait(lambda: len(pool.in_state(READY)) == 2 and ctrl.step >= 1)
                before = {r.name for r in pool.replicas}
                victim = next(r for r in pool.in_state(READY) if r.pid)
                os.kill(victim.pid, signal.SIGKILL)
                t0 = time.monotonic()
                wait(lambda before=before: any(r.name not in before and r.state == READY for r in pool.replicas))
                ready_s.append(time.monotonic() - t0)
                new = next(r for r in pool.replicas if r.name not in before)
                wait(lambda new=new: new.groups_done > 0)
                serving_s.append(time.monotonic() - t0)
                print(f"kill {len(ready_s)}: replacement ready after {ready_s[-1]:.1f} s, first group done after "
                      f"{serving_s[-1]:.1f} s", flush=True)
        except BaseException as exc:  # reported after the run stops
            errors.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # the controller's Ctrl-C: a clean stop

    thread = threading.Thread(target=kill_loop, daemon=True)
    thread.start()
    try:
        ctrl.train()
    finally:
        thread.join(60)
        ctrl.close()
    if errors:
        raise errors[0]
    return {"kills": len(ready_s), "ready_s": ready_s, "serving_s": serving_s,
            "ready_p50_s": statistics.median(ready_s), "ready_max_s": max(ready_s),
            "serving_p50_s": statistics.median(serving_s)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--groups-per-replica", type=int, default=2, help="runtime.max_groups_per_replica")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--latency-median-s", type=float, default=2.0)
    p.add_argument("--latency-sigma", type=float, default=0.5)
    p.add_argument("--latency-cap-s", type=float, default=6.0)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration, in rotating order (means reported)")
    p.add_argument("--ray-num-cpus", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="policy path (default: a tiny random llama)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    add_record_args(p, repeats=None)
    args = p.parse_args()
    recorder = Recorder.start(args.record, "Ray runtime: 2 rollout replicas against 1, and failover", {
        "ray_2_vs_1_replicas": f"samples/s of 2 Ray replicas / 1, each capped at {args.groups_per_replica} groups at once "
                               "(runtime.max_groups_per_replica), the same repeat",
        "ray_uncapped_vs_local": "samples/s of 1 Ray replica without the cap / runtime: local (the runtime's own cost)",
    }, args.repeats)

    import ray

    from relax_agent.data.ray import LOCAL_RAY_SYSTEM_CONFIG

    ray.init(num_cpus=args.ray_num_cpus, include_dashboard=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(REPO), str(BENCH)])}})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.model is None:
                from relax_agent.models import make_tiny_model

                args.model = str(make_tiny_model(Path(tmp) / "tiny", arch="llama", seed=0))
            ray_rt = {"kind": "ray", "trainer_num_cpus": 0.25, "max_groups_per_replica": args.groups_per_replica}
            configs = [("local", {"kind": "local"}), ("ray, 1 replica", {**ray_rt, "rollout_replicas": 1}),
                       ("ray, 2 replicas", {**ray_rt, "rollout_replicas": 2}),
                       ("ray, 1, no cap", {**ray_rt, "rollout_replicas": 1, "max_groups_per_replica": None})]
            per_run: list[list[dict[str, Any]]] = [[] for _ in configs]
            for rep in range(args.repeats):  # rotate the order so a drifting machine load hits every run
                for k in range(len(configs)):
                    i = (k + rep) % len(configs)
                    name, runtime = configs[i]
                    per_run[i].append(throughput(args, args.model, Path(tmp) / f"r{rep}-{i}", name, runtime))
            fail = failover(args, args.model, Path(tmp) / "failover") if args.kills else None
    finally:
        ray.shutdown()
    runs = [{**r[0], **{k: statistics.fmean(x[k] for x in r) for k in r[0] if k not in ("run", "steps")},
             "samples_per_s_runs": [x["samples_per_s"] for x in r]} for r in per_run]
    local, one, two, uncapped = (r["samples_per_s"] for r in runs)
    print(f"{args.steps} steps x {args.tasks_per_step} groups x {args.group_size} samples, max_staleness "
          f"{args.staleness}, tool latency lognormal (median {args.latency_median_s} s, sigma {args.latency_sigma}), "
          f"{args.groups_per_replica} groups per replica; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'run':<16} {'samples/s':>9} {'step s':>7} {'wait s':>7} {'staleness':>9}")
    for r in runs:
        print(f"{r['run']:<16} {r['samples_per_s']:>9.2f} {r['step_s']:>7.2f} {r['data_wait_s']:>7.2f} "
              f"{r['staleness_mean']:>9.2f}   runs: " + " ".join(f"{x:.2f}" for x in r["samples_per_s_runs"]))
    print(f"ray 2 replicas / 1 replica: {two / one:.2f}x (target >= 1.6x); ray 1 replica without the cap / local "
          f"(same concurrency, the runtime's own cost): {uncapped / local:.2f}x")
    if fail:
        print(f"failover over {fail['kills']} kills: replacement ready p50 {fail['ready_p50_s']:.1f} s (max "
              f"{fail['ready_max_s']:.1f} s; target <= 15 s), first group done p50 {fail['serving_p50_s']:.1f} s")
    for rep in range(args.repeats):
        local_r, one_r, two_r, uncapped_r = (per_run[i][rep]["samples_per_s"] for i in range(4))
        recorder.add_repeat({"ray_2_vs_1_replicas": two_r / one_r, "ray_uncapped_vs_local": uncapped_r / local_r,
                             "local_samples_per_s": local_r, "ray_1_samples_per_s": one_r,
                             "ray_2_samples_per_s": two_r})
    if fail:
        recorder.add_once({k: float(fail[k]) for k in ("kills", "ready_p50_s", "ready_max_s", "serving_p50_s")})
    recorder.finish()
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "runs": runs, "failover": fail,
                                         "ratio_2_vs_1": two / one, "ratio_uncapped_vs_local": uncapped / local}, indent=2,
                                        default=str))


if __name__ == "__main__":
    main()
