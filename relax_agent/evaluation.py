"""Held-out evaluation: each task once per seed, summarised as mean and std over seeds.

Besides the summary, :func:`evaluate` can write every sample as one JSON line (``samples_path``):
task id, seed, prompt messages, the response (each assistant message's raw text), the parsed
calls, and the verdict (correct, reward, the env's ``reason``, metrics, stop reason, error).
Trajectories keep only numeric env info, so the reason is recovered by replaying the episode's
parsed actions on a fresh env with the same seed (the env contract suite checks that envs are
deterministic under a seed; a reward service's score is the trajectory's ``reward``, the reason
is the env's). :func:`failure_table` counts the most common failure reasons, with quoted values
and numbers folded so that reasons of one kind group together.

:func:`evaluate_bfcl` runs every registered BFCL category (single-turn and multi-turn envs) and
:func:`bfcl_leaderboard` groups the per-category accuracies as the BFCL v4 leaderboard does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import re
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from relax_agent.records import Trajectory
from relax_agent.rollout.driver import PlaysEnv
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.parsers import parse_reply
from relax_agent.rollout.runner import RolloutRunner

Runner = Callable[[Callable[[], Any]], Any]


def _run_default(fn: Callable[[], Any]) -> Any:
    return asyncio.run(fn())


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


class EpisodeRunner(Protocol):
    """What :func:`evaluate` plays episodes with: a :class:`RolloutRunner` or a runtime's rollout service."""

    def specs(self, tasks: Sequence[dict[str, Any]], group_size: int, prefix: str, seed: int) -> list[Any]:
        """One :class:`EpisodeSpec` per task and group member; ids start with ``prefix``, seeds derive
        from ``seed``."""

    async def run(self, specs: Sequence[Any], params: SamplingParams,
                  on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Play ``specs`` with ``params``; returns their trajectories in the order of ``specs`` (``on_done``
        is called as each one finishes)."""


@runtime_checkable
class ReplaysEpisodes(Protocol):
    """An :class:`EpisodeRunner` whose episodes :func:`replay_reason` can replay on a fresh env."""

    def env_player(self) -> PlaysEnv | None:
        """The driver's env factory, renderer and parser; None when its driver plays no env itself."""
        ...


def evaluate(runner: EpisodeRunner, tasks: Sequence[dict[str, Any]], seeds: Sequence[int],
             params: SamplingParams, on_done: Callable[[Trajectory], None] | None = None,
             run: Runner = _run_default, samples_path: str | Path | None = None) -> dict[str, Any]:
    """Run every task once per seed; returns ``eval/<metric>`` means, ``_std`` over seeds and per-seed values.

    ``run`` drives each seed's coroutine (the controller passes one that Ctrl-C cancels). With
    ``samples_path``, every sample is written there as JSON lines (:func:`sample_record`) and
    the result also holds ``eval/samples_path`` and ``eval/failure_reasons`` (``[[reason, count], ...]``,
    most common first, from :func:`failure_table`).
    """
    per_seed: list[dict[str, float]] = []
    records: list[dict[str, Any]] = []
    for seed in seeds:
        specs = runner.specs(tasks, 1, prefix=f"eval-s{seed}", seed=seed * 100_003)
        trajs = run(functools.partial(runner.run, specs, params, on_done))
        per_seed.append(summarize(trajs))
        if samples_path is not None:
            records += [sample_record(t, spec.task, seed, t.env_reason if t.env_reason is not None
                                      else replay_reason(runner, spec.task, spec.seed, t))
                        for spec, t in zip(specs, trajs, strict=True)]
    out: dict[str, Any] = {"eval/num_tasks": len(tasks), "eval/seeds": list(seeds)}
    for key in per_seed[0]:
        vals = [r[key] for r in per_seed]
        out[f"eval/{key}"] = statistics.fmean(vals)
        out[f"eval/{key}_std"] = statistics.pstdev(vals)
        out[f"eval/{key}_per_seed"] = vals
    if samples_path is not None:
        path = Path(samples_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        out["eval/samples_path"] = str(path)
        out["eval/failure_reasons"] = [list(row) for row in failure_table(records)]
    return out


# ---------------------------------------------------------------- per-sample records
def replay_reason(runner: EpisodeRunner, task: dict[str, Any], seed: int, traj: Trajectory) -> str | None:
    """The env's ``info["reason"]`` at the end of ``traj``, by replaying its parsed actions on a fresh env.

    Returns None when the runner cannot replay (not :class:`ReplaysEpisodes`, or its driver plays no
    env itself), the episode failed, or the env gives no reason; a replay that raises gives
    ``"replay failed: ..."``.
    """
    player = runner.env_player() if isinstance(runner, ReplaysEpisodes) else None
    if player is None or traj.error is not None:
        return None
    make_env, parser = player.make_env, player.parser
    reason = None
    try:
        env = make_env()
        try:
            _, opening = env.reset(seed=seed, options={"task": task})
            tools = opening.get("tools", ()) if isinstance(opening, dict) else ()
            for action in [parse_reply(parser, m.get("content") or "", tools).message()
                           for m in traj.messages if _sampled(m)]:
                *_, terminated, truncated, info = env.step(action)
                reason = info.get("reason", reason) if isinstance(info, dict) else reason
                if terminated or truncated:
                    break
        finally:
            env.close()
    except Exception as exc:  # noqa: BLE001 - a replay problem must not lose the evaluation
        return f"replay failed: {type(exc).__name__}: {exc}"
    return None if reason is None else str(reason)


def _sampled(message: dict[str, Any]) -> bool:
    """True for an assistant message the policy sampled: the driver records those with their parsed
    ``tool_calls`` (a prompt's worked example or a task's earlier assistant turns have none)."""
    return message.get("role") == "assistant" and "tool_calls" in message


def sample_record(traj: Trajectory, task: dict[str, Any], seed: int, reason: str | None) -> dict[str, Any]:
    """One JSON-able line of the samples file.

    Keys: ``task_id``, ``sample_id``, ``seed``, ``prompt`` (the rendered prompt's messages: system
    prompt, worked example, task), ``response`` (each sampled assistant message's raw text), ``parsed_calls`` (per assistant
    message: ``[{"name", "arguments"}]``, plus ``parse_errors`` when a block did not parse),
    ``conversation`` (the messages after the prompt: tool results, later user turns), and
    ``verdict``: ``{"correct", "reward", "reason", "metrics", "stop_reason", "error"}``. A multi-context
    episode (``rollout.context``) also has ``contexts`` (per context: ``sample_id``, ``stop_reason``,
    ``response``: its sampled replies, summaries included), and ``response`` holds every context's replies
    in order; ``prompt``, ``parsed_calls`` and ``conversation`` are the last context's.
    """
    messages = list(traj.messages)
    first = next((i for i, m in enumerate(messages) if _sampled(m)), len(messages))
    assistant = [m for m in messages if _sampled(m)]
    parsed = []
    for m in assistant:
        calls = [{"name": c.get("function", {}).get("name"), "arguments": c.get("function", {}).get("arguments")}
                 for c in m.get("tool_calls") or []]
        parsed.append({"calls": calls, **({"parse_errors": m["parse_errors"]} if m.get("parse_errors") else {})})
    correct = episode_accuracy(traj)
    if reason is None:
        reason = "ok" if correct else (f"episode failed: {traj.error}" if traj.error else
                                        f"not correct (reward {traj.reward:.3g}, stopped: {traj.stop_reason.value})")
    out = {
        "task_id": traj.task_id, "sample_id": traj.sample_id, "seed": seed,
        "prompt": messages[:first], "response": [m.get("content", "") for m in assistant], "parsed_calls": parsed,
        "conversation": [m for m in messages[first:] if not _sampled(m)],
        "verdict": {"correct": correct, "reward": traj.reward, "reason": reason, "metrics": dict(traj.metrics),
                    "stop_reason": traj.stop_reason.value, "error": traj.error},
    }
    if traj.context_segments:  # a multi-context episode: every sampled reply, context by context
        contexts = [{"sample_id": seg.sample_id, "stop_reason": seg.stop_reason.value,
                     "response": [seg.messages[t.message_index].get("content", "") for t in seg.turns
                                  if t.message_index is not None and t.message_index < len(seg.messages)]}
                    for seg in traj.segments]
        out["contexts"] = contexts
        out["response"] = [text for ctx in contexts for text in ctx["response"]]
    return out


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
_BRACKETS = re.compile(r"\[[^\[\]]*\]|\{[^{}]*\}")
_NAMES = re.compile(r"\([\w.]+\)")
_NUMBERS = re.compile(r"\b\d+(\.\d+)?\b")


def reason_kind(reason: str) -> str:
    """``reason`` with quoted and bracketed values, function names in parentheses and numbers folded
    to ``…``/``N``, so that
    "parameter 'city': 'Rome' is not one of ['Paris']" and the same for 'unit' count together."""
    text = _QUOTED.sub("…", reason)
    for _ in range(3):  # nested brackets, innermost first
        text = _BRACKETS.sub("…", text)
    return _NUMBERS.sub("N", _NAMES.sub("(…)", text))


def failure_table(records: Sequence[dict[str, Any]], top: int = 10) -> list[tuple[str, int]]:
    """The ``top`` most common failure kinds among the incorrect samples, with their counts."""
    kinds = Counter(reason_kind(r["verdict"]["reason"]) for r in records if not r["verdict"]["correct"])
    return kinds.most_common(top)


def format_failure_table(rows: Sequence[Sequence[Any]], total: int) -> str:
    """A short text table of :func:`failure_table` rows (``total``: samples judged)."""
    if not rows:
        return f"no failures among {total} samples"
    lines = [f"most common failure reasons ({total} samples):", f"  {'count':>5}  reason"]
    lines += [f"  {int(n):>5}  {kind[:140]}" for kind, n in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- the whole BFCL
def bfcl_env_ids() -> dict[str, str]:
    """Every registered BFCL env id -> its category (single-turn, then multi-turn)."""
    from relax_agent.envs.bfcl import ENV_IDS, MULTI_TURN_ENV_IDS

    return {**ENV_IDS, **MULTI_TURN_ENV_IDS}


def _env_kwargs(env_id: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``env_id``'s constructor accepts (``category`` never)."""
    import importlib

    import gymnasium

    module, _, name = str(gymnasium.spec(env_id).entry_point).partition(":")
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    return {k: v for k, v in kwargs.items() if k in params and k != "category"}


def evaluate_bfcl(runner: RolloutRunner, num_tasks: int, seeds: Sequence[int], params: SamplingParams,
                  env_kwargs: dict[str, Any] | None = None, samples_dir: str | Path | None = None,
                  multi_turn_max_turns: int = 32, env_ids: Sequence[str] | None = None,
                  run: Runner = _run_default,
                  on_category: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Evaluate the runner's policy on the held-out split of every BFCL category.

    Args:
        runner: the configured runner; its engine, renderer, parser and limits are reused with
            each category's env (its reward service is not: BFCL envs score themselves).
        num_tasks: held-out tasks per category (the first ones, in file order).
        env_kwargs: keyword arguments for the envs; each env gets those its constructor takes.
        samples_dir: write ``<category>.jsonl`` sample files here (see :func:`evaluate`).
        multi_turn_max_turns: at least this many model calls per multi-turn episode.
        env_ids: a subset of :func:`bfcl_env_ids` (default: all of them).
        on_category: called with ``(category, result)`` after each category.

    Returns:
        ``{"categories": {category: evaluate's result}, "leaderboard": bfcl_leaderboard(...)}``.
    """
    import gymnasium

    import relax_agent.envs  # noqa: F401  (registers the ids)

    ids = bfcl_env_ids()
    unknown = sorted(set(env_ids or ()) - set(ids))
    if unknown:
        from relax_agent.errors import ConfigError

        raise ConfigError(f"env_ids: {unknown} are not BFCL envs; expected some of {sorted(ids)}")
    driver: Any = runner.driver  # an env driver: its engine, renderer and parser are reused
    results: dict[str, dict[str, Any]] = {}
    for env_id in env_ids or list(ids):
        category = ids[env_id]
        make_env = functools.partial(gymnasium.make, env_id, **_env_kwargs(env_id, dict(env_kwargs or {})))
        probe: Any = make_env()  # a relax env, whose unwrapped env lists tasks()
        try:
            tasks = probe.unwrapped.tasks("heldout")[:num_tasks]
        finally:
            probe.close()
        limits = runner.limits
        if category.startswith("multi_turn"):
            limits = dataclasses.replace(limits, max_turns=max(limits.max_turns, multi_turn_max_turns))
        sub = RolloutRunner(make_env, driver.engine, driver.renderer, driver.parser, limits, reward=None, env_id=env_id)
        path = None if samples_dir is None else Path(samples_dir) / f"{category}.jsonl"
        results[category] = evaluate(sub, tasks, seeds, params, run=run, samples_path=path)
        if on_category is not None:
            on_category(category, results[category])
    return {"categories": results, "leaderboard": bfcl_leaderboard(
        {c: (r["eval/accuracy"], r["eval/num_tasks"]) for c, r in results.items()})}


OVERALL_WEIGHTS: dict[str, float] = {"non_live_ast": 10, "live": 10, "irrelevance": 10, "multi_turn": 30}
"""BFCL v4's overall weights for the groups relax-agent runs (its agentic group, weight 40 — web
search and memory — is not run, so our overall renormalises over these four)."""


def bfcl_leaderboard(per_category: dict[str, tuple[float, int]]) -> dict[str, float]:
    """Group accuracies as BFCL v4's leaderboard (``eval_runner_helper.generate_leaderboard_csv``).

    Args:
        per_category: ``{category: (accuracy, tasks evaluated)}``.

    Returns:
        The groups whose categories are all present: ``non_live_ast`` (unweighted mean of simple,
        multiple, parallel, parallel_multiple, where simple is the unweighted mean of
        simple_python, simple_java, simple_javascript), ``live`` (mean of the four live AST
        categories weighted by tasks evaluated), ``multi_turn`` (unweighted mean of four),
        ``irrelevance`` (unweighted mean of irrelevance and live_irrelevance), ``relevance``
        (live_relevance) and ``overall`` (:data:`OVERALL_WEIGHTS`, renormalised), when its four
        groups are present.
    """
    from relax_agent.envs.bfcl import LEADERBOARD_GROUPS

    acc = {c: a for c, (a, _) in per_category.items()}
    count = {c: n for c, (_, n) in per_category.items()}
    out: dict[str, float] = {}
    if set(LEADERBOARD_GROUPS["non_live_ast"]) <= set(acc):
        simple = statistics.fmean(acc[c] for c in ("simple_python", "simple_java", "simple_javascript"))
        out["non_live_ast"] = statistics.fmean([simple, acc["multiple"], acc["parallel"], acc["parallel_multiple"]])
    live = LEADERBOARD_GROUPS["live"]
    live_tasks = sum(count[c] for c in live) if set(live) <= set(acc) else 0
    if live_tasks:
        out["live"] = sum(acc[c] * count[c] for c in live) / live_tasks
    for group in ("multi_turn", "irrelevance", "relevance"):
        if set(LEADERBOARD_GROUPS[group]) <= set(acc):
            out[group] = statistics.fmean(acc[c] for c in LEADERBOARD_GROUPS[group])
    if set(OVERALL_WEIGHTS) <= set(out):
        out["overall"] = sum(out[g] * w for g, w in OVERALL_WEIGHTS.items()) / sum(OVERALL_WEIGHTS.values())
    return out


def format_bfcl(result: dict[str, Any]) -> str:
    """Per-category accuracy and the leaderboard groups, as a short text table."""
    lines = [f"  {'category':<26} {'tasks':>5}  accuracy"]
    for category, r in result["categories"].items():
        lines.append(f"  {category:<26} {r['eval/num_tasks']:>5}  {r['eval/accuracy']:.3f} ± {r['eval/accuracy_std']:.3f}")
    lines.append("  leaderboard groups: " + ", ".join(f"{g} {v:.3f}" for g, v in result["leaderboard"].items()))
    return "\n".join(lines)
