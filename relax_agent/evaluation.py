"""Held-out evaluation: each task once per seed, summarised as mean and std over seeds."""

from __future__ import annotations

import asyncio
import statistics
from typing import Any, Callable, Sequence

from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.runner import RolloutRunner
from relax_agent.records import Trajectory


def episode_accuracy(t: Trajectory) -> float:
    """1.0 when the env judged the episode fully correct (``metrics["correct"]``), else 0.0."""
    return float(t.metrics.get("correct", 0.0)) if t.trainable else 0.0


def summarize(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Accuracy, well-formed rate, mean reward, failure count of one pass over the tasks."""
    n = max(len(trajs), 1)
    ok = [t for t in trajs if t.trainable]
    return {
        "accuracy": sum(episode_accuracy(t) for t in trajs) / n,
        "well_formed": sum(float(t.metrics.get("well_formed", 0.0)) for t in ok) / n,
        "reward": sum(t.reward for t in ok) / max(len(ok), 1),
        "failed": float(len(trajs) - len(ok)),
    }


def evaluate(runner: RolloutRunner, tasks: Sequence[dict[str, Any]], seeds: Sequence[int],
             params: SamplingParams, on_done: Callable[[Trajectory], None] | None = None,
             run: Callable[[Callable[[], Any]], Any] = lambda fn: asyncio.run(fn())) -> dict[str, Any]:
    """Run every task once per seed; returns ``eval/<metric>`` means, ``_std`` over seeds and per-seed values.

    ``run`` drives each seed's coroutine (the controller passes one that Ctrl-C cancels).
    """
    per_seed: list[dict[str, float]] = []
    for seed in seeds:
        specs = runner.specs(tasks, 1, prefix=f"eval-s{seed}", seed=seed * 100_003)
        per_seed.append(summarize(run(lambda: runner.run(specs, params, on_done))))
    out: dict[str, Any] = {"eval/num_tasks": len(tasks), "eval/seeds": list(seeds)}
    for key in per_seed[0]:
        vals = [r[key] for r in per_seed]
        out[f"eval/{key}"] = statistics.fmean(vals)
        out[f"eval/{key}_std"] = statistics.pstdev(vals)
        out[f"eval/{key}_per_seed"] = vals
    return out
