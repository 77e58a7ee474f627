"""A multimodal GRPO workload in colocate vs async (s=2): samples/s and their ratio, in one run.

Workload: ``relax/VisualCount-v0`` images (84 px, 9 image tokens after the 2x2 merge; the zoom
tool offered) played by a tiny random Qwen2.5-VL (``python -m relax_agent.models tiny-vl``, or
``--model PATH``). So that every group trains (a random policy never answers right, and uniform
groups give no gradient), the benchmark's env scores a reply by its character similarity to the
answer line ``Answer: N`` (the env's own reward is 0/1), and each ``env.step`` waits a simulated
tool latency (lognormal, median ``--latency-median-s``, seeded per episode, the same in both
modes). Each mode trains ``--steps`` steps with the same seed, config and data order, the media
path end to end: rendering and processing the image, the media engine, the ``media`` bus field,
the vision encoder in the trainer's forward and backward, weight sync.

Reported per mode: samples/s (samples the trainer consumed / summed step wall time, model loading
excluded), mean step time, trainer wait for data, mean staleness, process CPU per step; and the
async samples/s over colocate's, measured in the same run.

    python benchmarks/multimodal.py               # ~2-4 minutes on 2 CPU cores
    python benchmarks/multimodal.py --steps 12 --repeats 2
"""

from __future__ import annotations

import argparse
import difflib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relax_agent.envs import register  # noqa: E402
from relax_agent.envs.visual import VisualCountEnv  # noqa: E402

ENV_ID = "bench/SlowVisualCount-v0"


class SlowVisualCount(VisualCountEnv):
    """VisualCount with a graded reward (similarity of the reply to ``Answer: N``) and a slow step.

    Args:
        latency_median_s: median simulated tool latency per step (lognormal, log-std 1, capped at 3 s).
    """

    def __init__(self, latency_median_s: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.latency_mu = float(np.log(latency_median_s))

    def step(self, action):
        time.sleep(min(float(self.np_random.lognormal(self.latency_mu, 1.0)), 3.0))
        return super().step(action)

    def score(self, message):
        reward, info = super().score(message)
        similarity = difflib.SequenceMatcher(None, message.get("content") or "", f"Answer: {self.task['answer']}").ratio()
        return max(reward, similarity), info


register(id=ENV_ID, entry_point=SlowVisualCount, max_episode_steps=4)


def run_mode(args: argparse.Namespace, model_path: str, out: Path, mode: str, staleness: int) -> dict[str, Any]:
    """Train one mode in this process; returns its summary."""
    from relax_agent.config import validate_config
    from relax_agent.control import build_controller
    from relax_agent.metrics import read_metrics
    from relax_agent.roles import build_run_roles

    cfg = validate_config({
        "mode": mode, "max_staleness": staleness,
        "run": {"output_dir": str(out), "seed": args.seed, "num_threads": 1},
        "model": {"path": model_path},
        "env": {"id": ENV_ID, "kwargs": {"latency_median_s": args.latency_median_s}, "max_turns": 2},
        "rollout": {"tasks_per_step": args.tasks_per_step, "group_size": args.group_size,
                    "max_new_tokens": args.max_new_tokens, "max_total_tokens": 1024},
        "trainer": {"steps": args.steps, "lr": args.lr, "micro_batch_size": 8,
                    "off_policy": "tis" if staleness > 0 else "none"},
        "eval": {"at_start": False, "at_end": False},
        "checkpoint": {"every_steps": 0},
        "logging": {"tensorboard": False, "progress": False, "plot": False},
    }, "benchmarks/multimodal.py")
    cpu0 = time.process_time()
    ctrl = build_controller(cfg, build_run_roles(cfg))
    try:
        ctrl.train()
    finally:
        ctrl.close()
    cpu_s = time.process_time() - cpu0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "rollout/reward" in r]
    samples = sum(r.get("train/samples", 0.0) for r in rows)
    wall_s = sum(r["timing/step_s"] for r in rows)
    return {
        "mode": mode if mode == "colocate" else f"async s={staleness}", "steps": len(rows),
        "trained_samples": samples, "samples_per_s": samples / wall_s,
        "step_s": statistics.fmean(r["timing/step_s"] for r in rows),
        "data_wait_s": statistics.fmean(r["timing/data_wait_s"] for r in rows),
        "staleness_mean": statistics.fmean(r.get("async/staleness_mean", 0.0) for r in rows),
        "cpu_s_per_step": cpu_s / max(len(rows), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tasks-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--staleness", type=int, default=2, help="k of the async mode")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--latency-median-s", type=float, default=0.2)
    p.add_argument("--model", default=None, help="multimodal policy path (default: a tiny random Qwen2.5-VL)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, in rotating order (means reported)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()

    modes = [("colocate", 0), ("async", args.staleness)]
    runs: list[list[dict[str, Any]]] = [[] for _ in modes]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from relax_agent.models import make_tiny_media_model

            args.model = str(make_tiny_media_model(Path(tmp) / "tiny-vl", kind="tiny-vl"))
        for rep in range(args.repeats):
            for k in range(len(modes)):
                i = (k + rep) % len(modes)
                runs[i].append(run_mode(args, args.model, Path(tmp) / f"r{rep}-m{i}", *modes[i]))
    results = [{**r[0], **{key: statistics.fmean(x[key] for x in r) for key in r[0] if key not in ("mode", "steps")},
                "samples_per_s_runs": [x["samples_per_s"] for x in r]} for r in runs]
    base = results[0]["samples_per_s"]
    print(f"{args.steps} steps x {args.tasks_per_step} groups x {args.group_size} samples (VisualCount images, tiny "
          f"VL policy), {args.repeats} run(s) per mode; tool latency lognormal median {args.latency_median_s} s")
    print(f"{'mode':<12} {'samples/s':>9} {'vs colocate':>11} {'step s':>7} {'wait s':>7} {'staleness':>9} {'cpu s/step':>10}")
    for r in results:
        r["speedup_vs_colocate"] = r["samples_per_s"] / base
        print(f"{r['mode']:<12} {r['samples_per_s']:>9.2f} {r['speedup_vs_colocate']:>10.2f}x {r['step_s']:>7.2f} "
              f"{r['data_wait_s']:>7.2f} {r['staleness_mean']:>9.2f} {r['cpu_s_per_step']:>10.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
