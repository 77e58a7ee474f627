"""``relax-agent envs audit``: play degenerate policies against an environment and flag the reward they earn.

No model is loaded. Each policy (:data:`~relax_agent.envaudit_policies.POLICIES`) writes the *text* of an assistant reply; the text
goes through relax-agent's own tool-call parser (``rollout.tool_parser``, built by
:func:`~relax_agent.rollout.parsers.build_parser`) exactly as the rollout driver turns a sampled
reply into the message ``env.step`` gets (``parser.parse(text).message()``: content, tool calls,
parse errors), and env calls go through the driver's own :class:`~relax_agent.rollout.env_calls.EnvCalls`
(``areset``/``astep`` when the env has them, every call bounded by ``step_timeout_s``) with the
driver's return checks. An episode's reward is the sum of its step rewards, as in training.

Every policy is deterministic (its random strings come from a generator seeded by the policy,
the episode and the turn) and plays the same held-out tasks. A policy "earns" when its mean
reward, normalised to the env's reward range, is above ``threshold``: the env pays for a reply
that knows nothing about the task. The verdict is FAIL when any policy earns
(:meth:`AuditReport.verdict`). An env that raises on a degenerate reply is reported (exception
type, count, first message), not a crash of the audit.

    report = audit("relax/Calculator-v0", {"num_tasks": 200}, episodes=8)
    report.verdict            # "PASS", "FAIL" (or "ERROR": the env raised in every episode)
    report.to_dict()          # what --json prints and --out writes
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_agent.envaudit_policies import POLICIES, Policy, Turn, select_policies, tool_names
from relax_agent.errors import ConfigError


@dataclass
class Episode:
    """One episode of one policy.

    Attributes:
        task_id: the held-out task's id ("" for an env without tasks).
        seed: its ``reset`` seed.
        reward: the summed step rewards (0.0 for an episode that raised: training masks it).
        turns: replies sent to ``env.step``.
        first_reply: the policy's first reply text (cut to 300 characters).
        reason: the env's last ``info["reason"]`` (or ``"correct"``/``"answered"`` flags) when it gives one.
        error: ``"Type: message"`` when the env raised (or returned a malformed step), else None.
        where: the call that raised: ``"make"``, ``"reset"``, ``"step N"``.
        skipped: why the episode was not played (a tool policy on an env that declares no tools).
    """

    task_id: str
    seed: int
    reward: float = 0.0
    turns: int = 0
    first_reply: str = ""
    reason: str = ""
    error: str | None = None
    where: str = ""
    skipped: str = ""


@dataclass
class PolicyResult:
    """A policy's episodes and their statistics.

    Attributes:
        policy: the policy's name.
        description: what it writes.
        episodes: its episodes, in task order.
    """

    policy: str
    description: str
    episodes: list[Episode] = field(default_factory=list)

    @property
    def played(self) -> list[Episode]:
        """The episodes that were not skipped."""
        return [e for e in self.episodes if not e.skipped]

    def stats(self, success: float, lo: float, hi: float) -> dict[str, Any]:
        """``episodes`` (played), ``mean_reward``, ``max_reward``, ``min_reward``, ``success_rate`` (reward
        >= ``success``), ``mean_turns``, ``normalized_mean`` (the mean scaled from [lo, hi] to [0, 1]),
        ``errors`` (exception type -> count) and ``skipped`` (the reason, when no episode was played)."""
        played = self.played
        if not played:
            return {"episodes": 0, "skipped": self.episodes[0].skipped if self.episodes else "no episodes"}
        rewards = [e.reward for e in played]
        mean = sum(rewards) / len(rewards)
        errors = Counter(e.error.split(":", 1)[0] for e in played if e.error)
        return {"episodes": len(played), "mean_reward": mean, "max_reward": max(rewards), "min_reward": min(rewards),
                "success_rate": sum(r >= success - 1e-9 for r in rewards) / len(rewards),
                "mean_turns": sum(e.turns for e in played) / len(played),
                "normalized_mean": (mean - lo) / (hi - lo), "errors": dict(sorted(errors.items()))}


@dataclass
class AuditReport:
    """The audit of one env.

    Attributes:
        env: the env id as given.
        kwargs: the constructor kwargs as given.
        settings: episodes, max_turns, threshold, success, reward_range, tool_parser, seed, step_timeout_s.
        reward_description: the env's own words about its reward.
        task_ids: the held-out tasks played (empty for an env without tasks).
        results: one per policy, in :data:`POLICIES` order.
        notes: remarks (rewards outside the range, a fallback to the train split, ...).
        elapsed_s: wall-clock seconds of the audit.
    """

    env: str
    kwargs: dict[str, Any]
    settings: dict[str, Any]
    reward_description: str = ""
    task_ids: list[str] = field(default_factory=list)
    results: list[PolicyResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each policy's :meth:`PolicyResult.stats` with an ``earns`` flag (normalised mean above the threshold)."""
        lo, hi = self.settings["reward_range"]
        out = {}
        for result in self.results:
            s = result.stats(self.settings["success"], lo, hi)
            s["earns"] = bool(s["episodes"]) and s["normalized_mean"] > self.settings["threshold"] + 1e-9
            out[result.policy] = s
        return out

    @property
    def earning(self) -> list[str]:
        """The policies whose mean reward is above the threshold."""
        return [name for name, s in self.stats().items() if s["earns"]]

    @property
    def errors(self) -> int:
        """Played episodes in which the env raised or returned a malformed value."""
        return sum(1 for r in self.results for e in r.played if e.error)

    @property
    def verdict(self) -> str:
        """``"ERROR"`` when the env raised in every episode played (nothing was measured); else ``"FAIL"`` when
        any policy earns (or, with ``fail_on_errors``, any episode raised); else ``"PASS"``."""
        played = sum(len(r.played) for r in self.results)
        if played and self.errors == played:
            return "ERROR"
        failed = bool(self.earning) or (self.settings.get("fail_on_errors", False) and self.errors > 0)
        return "FAIL" if failed else "PASS"

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (what ``--json`` prints and ``--out`` writes)."""
        stats = self.stats()
        policies = []
        for result in self.results:
            played = result.played
            best = max(played, key=lambda e: e.reward, default=None)
            failing = next((e for e in played if e.error), None)
            row: dict[str, Any] = {"policy": result.policy, "description": result.description, **stats[result.policy]}
            if best is not None:
                row["best_episode"] = _episode_dict(best)
            if failing is not None:
                row["first_error"] = _episode_dict(failing)
            policies.append(row)
        return {"env": self.env, "kwargs": self.kwargs, "verdict": self.verdict, "earning": self.earning,
                "errors": self.errors, "settings": self.settings, "reward_description": self.reward_description,
                "task_ids": self.task_ids, "policies": policies, "notes": self.notes,
                "elapsed_s": round(self.elapsed_s, 2)}


def _episode_dict(e: Episode) -> dict[str, Any]:
    out = {"task_id": e.task_id, "seed": e.seed, "reward": e.reward, "turns": e.turns, "first_reply": e.first_reply}
    if e.reason:
        out["reason"] = e.reason
    if e.error:
        out["error"], out["where"] = e.error, e.where
    return out


def parse_reward_range(text: str) -> tuple[float, float]:
    """``"LO,HI"`` as two finite floats with LO < HI.

    Raises:
        ConfigError: not two comma-separated finite numbers in increasing order.
    """
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--reward-range {text!r}: expected 'LO,HI', e.g. '-1,1'") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ConfigError(f"--reward-range {text!r}: expected finite LO < HI")
    return lo, hi


def _declared_range(env: Any) -> tuple[float, float] | None:
    """The env's own ``reward_range`` attribute when it is a finite ``(lo, hi)`` with lo < hi."""
    value = getattr(env, "reward_range", None)
    try:
        lo, hi = (float(v) for v in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        return None
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) and lo < hi else None


def audit(env_id: str, kwargs: dict[str, Any] | None = None, *, episodes: int = 8, threshold: float = 0.1,
          max_turns: int = 8, tool_parser: str = "hermes", success: float | None = None,
          reward_range: tuple[float, float] | None = None, seed: int = 0, step_timeout_s: float = 60.0,
          policies: Sequence[str] | None = None, fail_on_errors: bool = False,
          progress: Callable[[str], None] | None = None) -> AuditReport:
    """Play every degenerate policy on ``episodes`` held-out tasks of ``env_id`` and report what each earns.

    Args:
        env_id: any form :func:`relax_agent.envs.make` takes (registered id, ``"module:ns/Name-v0"``,
            ``"<scheme>:<name>"``).
        kwargs: the env's constructor kwargs.
        episodes: held-out tasks played by each policy (drawn with ``seed``; all when fewer).
        threshold: a policy earns when its mean reward, scaled from the reward range to [0, 1], is above it.
        max_turns: replies per episode at most.
        tool_parser: ``rollout.tool_parser``'s name (``auto`` needs a model: name the parser).
        success: the reward that counts as solved (default: the top of the reward range).
        reward_range: ``(lo, hi)``; default the env's ``reward_range`` attribute when it has a finite
            one, else ``(0, 1)``.
        seed: picks the tasks; episode ``i`` resets with seed ``seed + i``.
        step_timeout_s: most seconds one env call may take (a slower one is an error of the episode).
        policies: names (or family prefixes) of the policies to play; all by default.
        fail_on_errors: FAIL also when the env raised in any episode.
        progress: called with one line per policy played.

    Raises:
        ConfigError: a bad argument, an unknown parser or policy, or a parser that cannot write calls.
        Exception: whatever building the env or listing its tasks raises (the audit cannot start).
    """
    from relax_agent.rollout.parsers import WritesCalls, build_parser

    if episodes < 1 or max_turns < 1 or step_timeout_s <= 0 or not math.isfinite(threshold):
        raise ConfigError(f"need episodes >= 1, max_turns >= 1, step_timeout_s > 0 and a finite threshold; got "
                          f"{episodes}, {max_turns}, {step_timeout_s}, {threshold}")
    parser = build_parser(tool_parser)
    if not isinstance(parser, WritesCalls):
        raise ConfigError(f"--tool-parser {tool_parser!r} cannot write calls (no format method): the tool policies need it")
    chosen = select_policies(policies)
    started = time.monotonic()
    kwargs = dict(kwargs or {})
    tasks, description, declared, notes = _list_tasks(env_id, kwargs, episodes, seed)
    lo, hi = reward_range or declared or (0.0, 1.0)
    settings: dict[str, Any] = {"episodes": episodes, "max_turns": max_turns, "threshold": threshold,
                "success": hi if success is None else success, "reward_range": [lo, hi], "tool_parser": tool_parser,
                "seed": seed, "step_timeout_s": step_timeout_s, "fail_on_errors": fail_on_errors}
    report = AuditReport(env_id, kwargs, settings, description, [str(t.get("id", "")) for t in tasks if t], notes=notes)
    runner = _Runner(env_id, kwargs, parser, max_turns, step_timeout_s)
    for policy in chosen:
        result = PolicyResult(policy.name, policy.description)
        for i, task in enumerate(tasks):
            result.episodes.append(asyncio.run(runner.play(policy, task, seed + i, i)))
        report.results.append(result)
        if progress is not None:
            s = result.stats(float(settings["success"]), lo, hi)
            progress(f"{policy.name}: " + (f"mean {s['mean_reward']:.3f}, errors {sum(s['errors'].values())}"
                                           if s["episodes"] else s["skipped"]))
    seen = [e.reward for r in report.results for e in r.played]
    if seen and (min(seen) < lo - 1e-9 or max(seen) > hi + 1e-9):
        report.notes.append(f"episode rewards from {min(seen):g} to {max(seen):g} fall outside the reward range "
                            f"[{lo:g}, {hi:g}]: pass --reward-range (or give the env a reward_range attribute)")
    report.elapsed_s = time.monotonic() - started
    return report


def _list_tasks(env_id: str, kwargs: dict[str, Any], episodes: int,
                seed: int) -> tuple[list[dict[str, Any] | None], str, tuple[float, float] | None, list[str]]:
    """(the tasks to play, None each for an env without tasks; reward description; declared reward range; notes)."""
    from relax_agent.envs import make
    from relax_agent.envs.base import DescribesReward, HasTasks

    env = make(env_id, **kwargs)
    try:
        inner = env.unwrapped
        description = inner.reward_description if isinstance(inner, DescribesReward) else ""
        notes: list[str] = []
        if not isinstance(inner, HasTasks):
            notes.append("the env lists no tasks: episodes reset with seeds only")
            return [None] * episodes, description, _declared_range(inner), notes
        pool = list(inner.tasks("heldout"))
        if not pool:
            notes.append("the held-out split is empty: tasks drawn from the train split")
            pool = list(inner.tasks("train"))
        if not pool:
            raise ConfigError(f"{env_id}: the env lists no tasks in either split")
        if len(pool) > episodes:
            picked = sorted(random.Random(seed).sample(range(len(pool)), episodes))
            pool = [pool[i] for i in picked]
        return list(pool), description, _declared_range(inner), notes
    finally:
        env.close()


class _Runner:
    """Plays one policy's episode in a fresh env, the way the rollout driver calls envs."""

    def __init__(self, env_id: str, kwargs: dict[str, Any], parser: Any, max_turns: int, step_timeout_s: float):
        self.env_id, self.kwargs, self.parser = env_id, kwargs, parser
        self.max_turns, self.step_timeout_s = max_turns, step_timeout_s

    async def play(self, policy: Policy, task: dict[str, Any] | None, seed: int, index: int) -> Episode:
        from relax_agent.envs import make
        from relax_agent.envs.tool_env import call_in_thread
        from relax_agent.rollout.driver import Deadline, EpisodeSpec
        from relax_agent.rollout.env_calls import EnvCalls, close_env

        task_id = str(task.get("id", "")) if task else ""
        episode = Episode(task_id, seed)
        spec = EpisodeSpec(f"audit-{policy.name}-{index}", "audit", task_id, task or {}, seed, max_turns=self.max_turns,
                           step_timeout_s=self.step_timeout_s,
                           episode_timeout_s=self.step_timeout_s * (2 * self.max_turns + 3))
        deadline = Deadline(spec.episode_timeout_s)
        try:
            env = await deadline.call(call_in_thread(lambda: make(self.env_id, **self.kwargs)), "make",
                                      self.step_timeout_s, f"building the env exceeded {self.step_timeout_s} s")
        except Exception as exc:  # noqa: BLE001 - a finding of the episode
            episode.error, episode.where = _describe(exc), "make"
            return episode
        try:
            await self._turns(policy, EnvCalls(env, spec, deadline), task, seed, index, episode)
        except Exception as exc:  # noqa: BLE001 - an env that raises on a degenerate reply is a finding
            episode.error = _describe(exc)
            episode.reward = 0.0  # the driver masks a failed episode: it trains on no reward
        finally:
            await close_env(env, self.step_timeout_s)
        return episode

    async def _turns(self, policy: Policy, calls: Any, task: dict[str, Any] | None, seed: int, index: int,
                     episode: Episode) -> None:
        from relax_agent.rollout.env_calls import check_reset, check_step

        episode.where = "reset"
        options = {"task": task} if task is not None else None
        obs, info = check_reset(await calls.reset(seed=seed, options=options))
        tools = list(info.get("tools") or [])
        if policy.needs_tools and not tool_names(tools):
            episode.skipped, episode.where = "no tools declared", ""
            return
        history = list(obs)
        for turn in range(self.max_turns):
            text = policy.reply(Turn(history, tools, turn, index, self.parser.format))
            if turn == 0:
                episode.first_reply = text[:300]
            action = self.parser.parse(text).message()  # what the env driver hands env.step
            episode.where = f"step {turn + 1}"
            new_obs, reward, terminated, truncated, step_info = check_step(await calls.step(action))
            episode.reward += reward
            episode.turns = turn + 1
            episode.reason = _reason(step_info) or episode.reason
            history += [{**action, "content": text}, *new_obs]
            if terminated or truncated:
                break
        episode.where = ""


def _reason(info: dict[str, Any]) -> str:
    if info.get("reason") is not None:
        return str(info["reason"])[:200]
    return ", ".join(f"{k}={info[k]:g}" for k in ("correct", "answered") if isinstance(info.get(k), (int, float)))


def _describe(exc: BaseException) -> str:
    import re

    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).split())  # terminal colours some packages put in messages
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def relative_kwargs(value: Any, root: str) -> Any:
    """``value`` with every absolute path string under ``root`` made relative to it, and any other
    absolute path cut to ``<abs>/<basename>`` (records keep relative paths only)."""
    import os

    if isinstance(value, dict):
        return {k: relative_kwargs(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [relative_kwargs(v, root) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        rel = os.path.relpath(value, root)
        return rel if not rel.startswith("..") else f"<abs>/{os.path.basename(value)}"
    return value


def dumps(data: Any) -> str:
    """``data`` as indented JSON (non-JSON values as their ``str``)."""
    return json.dumps(data, indent=2, default=str)


def _num(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def table_rows(report: AuditReport) -> list[list[str]]:
    """One row of strings per policy: policy, episodes, mean, max, solved, turns, errors, earns ("EARNS" or "")."""
    rows = []
    for name, s in report.stats().items():
        if not s["episodes"]:
            rows.append([name, "0", "-", "-", "-", "-", f"n/a ({s['skipped']})", ""])
            continue
        errors = ", ".join(f"{k} x{v}" for k, v in s["errors"].items())
        rows.append([name, str(s["episodes"]), _num(s["mean_reward"]), _num(s["max_reward"]), _num(s["success_rate"]),
                     f"{s['mean_turns']:.1f}", errors, "EARNS" if s["earns"] else ""])
    return rows


TABLE_HEADER = ["policy", "episodes", "mean", "max", "solved", "turns", "errors", "earns"]
"""The column names of :func:`table_rows`."""


def verdict_line(report: AuditReport) -> str:
    """One line: the verdict, the policies that earn (with their means) and the errors."""
    stats = report.stats()
    lo, hi = report.settings["reward_range"]
    scale = "" if (lo, hi) == (0.0, 1.0) else f" of the range [{lo:g}, {hi:g}]"
    line = f"{report.verdict} {report.env}"
    if report.earning:
        line += (f": {len(report.earning)} of {len(stats)} degenerate policies earn a mean reward above "
                 f"{report.settings['threshold']:g}{scale}: "
                 + ", ".join(f"{n} {stats[n]['mean_reward']:.3f}" for n in report.earning))
    else:
        line += f": no degenerate policy earns a mean reward above {report.settings['threshold']:g}{scale}"
    if report.verdict == "ERROR":
        first = next(e for r in report.results for e in r.played if e.error)
        return f"ERROR {report.env}: the env raised in every episode ({report.errors}); first, at {first.where}: {first.error}"
    if report.errors:
        line += f"; the env raised in {report.errors} episode(s)"
    return line


def markdown(report: AuditReport, command: str = "") -> str:
    """The report as a Markdown page: verdict, settings, one table row per policy, notes and errors."""
    s = report.settings
    out = [f"# Environment audit: `{report.env}`", "", f"**{verdict_line(report)}**", ""]
    if command:
        out += [f"Command: `{command}`", ""]
    out += [f"Settings: {s['episodes']} held-out tasks per policy, at most {s['max_turns']} turns, tool parser "
            f"`{s['tool_parser']}`, threshold {s['threshold']:g}, success at reward >= {s['success']:g}, reward range "
            f"[{s['reward_range'][0]:g}, {s['reward_range'][1]:g}], seed {s['seed']}; kwargs "
            f"`{json.dumps(report.kwargs, default=str)}`; {report.elapsed_s:.1f} s.", ""]
    if report.reward_description:
        out += [f"Reward (the env's words): {report.reward_description}", ""]
    out += ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table_rows(report)]
    described = {p.name: p.description for p in POLICIES}
    out += ["", "Policies: " + "; ".join(f"`{r.policy}`: {described.get(r.policy, r.description)}"
                                         for r in report.results) + "."]
    data = report.to_dict()
    examples = [(p["policy"], p["best_episode"]) for p in data["policies"] if p.get("earns")]
    if examples:
        out += ["", "Earning episodes (the best of each policy):", ""]
        out += [f"- `{name}` on task `{e['task_id']}` (seed {e['seed']}): reward {e['reward']:g}"
                + (f", env's reason: {e['reason']}" if e.get("reason") else "") for name, e in examples]
    failures = [(p["policy"], p["first_error"]) for p in data["policies"] if p.get("first_error")]
    if failures:
        out += ["", "Errors (the first of each policy):", ""]
        out += [f"- `{name}`, task `{e['task_id']}`, {e['where']}: `{e['error']}`" for name, e in failures]
    if report.notes:
        out += ["", "Notes: " + "; ".join(report.notes) + "."]
    return "\n".join(out) + "\n"


def write_record(report: AuditReport, out_dir: str, command: str = "") -> list[str]:
    """Write ``audit.json`` and ``README.md`` of ``report`` into ``out_dir`` (paths inside relative to
    the working directory); returns the two paths written."""
    import os
    from dataclasses import replace
    from pathlib import Path

    report = replace(report, kwargs=relative_kwargs(report.kwargs, os.getcwd()))
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    data = {**report.to_dict(), "command": command}
    (folder / "audit.json").write_text(dumps(data) + "\n")
    (folder / "README.md").write_text(markdown(report, command))
    return [str(folder / "audit.json"), str(folder / "README.md")]


__all__ = ["POLICIES", "TABLE_HEADER", "AuditReport", "Episode", "PolicyResult", "audit", "dumps", "markdown", "parse_reward_range",
           "relative_kwargs", "table_rows", "verdict_line", "write_record"]
