"""The run reader: one run folder's files, re-read when they change (JSONL parses cached by mtime and
size), and the viewer's pages built from them: the run overview, a step's groups, one episode, and an
evaluation's samples."""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from relax_agent.errors import ConfigError, DataError
from relax_agent.viewer.data.episodes import EpisodeFilter, crossed_update, group_of, is_failed
from relax_agent.viewer.data.jsonl import JsonlRead, read_jsonl
from relax_agent.viewer.data.tokens import TOKEN_FIELDS, TokenDecoder, checkpoint_tokenizer

_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _mean(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def _std(xs: list[float]) -> float | None:
    if not xs:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


class RunReader:
    """Reads one run folder; every call sees the files as they are now (a run in progress grows).

    Parsed JSONL files are cached by (mtime, size), so an unchanged file is not parsed twice.

    Args:
        run_dir: the run's ``run.output_dir``.
        tokenizer: shows token ids as text: a tokenizer folder or hub id; "auto" (default) takes the
            latest checkpoint's ``model`` folder when there is one; None: ids only.

    Raises:
        ConfigError: ``run_dir`` is not a folder.
    """

    def __init__(self, run_dir: str | Path, tokenizer: str | None = "auto"):
        self.dir = Path(run_dir).expanduser().resolve()
        if not self.dir.is_dir():
            raise ConfigError(f"run folder {str(run_dir)!r} does not exist or is not a folder; "
                              "expected a run's run.output_dir (it holds metrics.jsonl, rollouts/, eval/)")
        self.tokenizer_spec = tokenizer
        self._decoder: TokenDecoder | None = None
        self._cache: dict[Path, tuple[tuple[int, int], JsonlRead]] = {}
        self._lock = threading.Lock()

    # -- files ------------------------------------------------------------------------------
    def jsonl(self, path: Path) -> JsonlRead:
        """:func:`read_jsonl` of ``path``, parsed again only when its mtime or size changed."""
        try:
            st = path.stat()
        except FileNotFoundError:
            return JsonlRead([])
        key = (st.st_mtime_ns, st.st_size)
        with self._lock:
            hit = self._cache.get(path)
        if hit and hit[0] == key:
            return hit[1]
        read = read_jsonl(path)
        with self._lock:
            self._cache[path] = (key, read)
        return read

    def summary(self) -> dict[str, Any] | None:
        """``summary.json`` (written when the run ends), or None while it runs or when unreadable."""
        try:
            data = json.loads((self.dir / "summary.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    @property
    def curves_png(self) -> Path:
        """Where the run's curves are drawn: ``plots/curves.png`` in the run folder."""
        return self.dir / "plots" / "curves.png"

    def step_files(self) -> dict[int, Path]:
        """Step number -> ``rollouts/step_NNNNNN.jsonl``."""
        folder = self.dir / "rollouts"
        if not folder.is_dir():
            return {}
        out = {}
        for p in folder.iterdir():
            m = _STEP_FILE.match(p.name)
            if m:
                out[int(m.group(1))] = p
        return dict(sorted(out.items()))

    def token_record(self, step: int) -> dict[str, dict[str, Any]]:
        """Sample id -> row of ``rollouts/tokens/step_NNNNNN.jsonl.gz`` (empty without one)."""
        read = self.jsonl(self.dir / "rollouts" / "tokens" / f"step_{step:06d}.jsonl.gz")
        return {str(r.get("sample_id")): r for r in read.rows}

    @property
    def decoder(self) -> TokenDecoder:
        """The :class:`TokenDecoder` of ``tokenizer`` ("auto" is resolved now: a checkpoint written
        after the first look is used once the current one cannot be found)."""
        if self._decoder is None or (self.tokenizer_spec == "auto" and self._decoder.source is None):
            spec = self.tokenizer_spec
            if spec == "auto":
                found = checkpoint_tokenizer(self.dir)
                spec = str(found) if found else None
            self._decoder = TokenDecoder(spec)
        return self._decoder

    def eval_files(self) -> dict[str, Path]:
        """Evaluation sample files by name: ``step_000004`` / ``warmup`` for ``eval/<name>.samples.jsonl``,
        ``<name>`` for ``<name>.samples.jsonl`` at the top of the run folder (``top-<name>`` when
        ``eval/`` has that name too)."""
        out: dict[str, Path] = {}
        for folder in (self.dir / "eval", self.dir):
            if folder.is_dir():
                for p in sorted(folder.glob("*.samples.jsonl")):
                    name = p.name[: -len(".samples.jsonl")]
                    out[name if name not in out else f"top-{name}"] = p
        return out

    # -- metrics ----------------------------------------------------------------------------
    def metrics(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], JsonlRead]:
        """``(step rows, evaluation rows, raw read)`` of ``metrics.jsonl``: for each step the last
        row written is kept (a resumed run repeats steps), rows ordered by step."""
        read = self.jsonl(self.dir / "metrics.jsonl")
        steps: dict[int, dict[str, Any]] = {}
        evals: dict[tuple[int, str], dict[str, Any]] = {}
        for row in read.rows:
            step = row.get("step")
            if not isinstance(step, int):
                continue
            kind = next((k.partition("/")[0] for k in row
                         if "/" in k and (k.startswith("eval/") or k.startswith("eval_"))), "")
            if kind:
                evals[(step, kind)] = row
            else:
                steps[step] = {**steps.get(step, {}), **row}
        return ([steps[k] for k in sorted(steps)], [evals[k] for k in sorted(evals)], read)

    # -- views ------------------------------------------------------------------------------
    def overview(self) -> dict[str, Any]:
        """The run page: summary, per-step rewards/accuracy and sample counts, evaluations, warm-up.

        Each step: ``step``, ``reward``, ``accuracy``, ``well_formed`` (from ``metrics.jsonl``, None
        before its row is written), ``episodes``, ``failed``, ``trained``, ``dropped_stale``,
        ``filtered`` (counted in its rollout dump; None without one), ``has_rollouts``, ``has_tokens``
        (its token record exists).
        """
        step_rows, eval_rows, mread = self.metrics()
        files = self.step_files()
        by_step = {r["step"]: r for r in step_rows}
        steps = []
        partial_files = []
        for step in sorted(set(files) | {s for s, r in by_step.items() if "rollout/reward" in r}):
            r = by_step.get(step, {})
            item: dict[str, Any] = {
                "step": step, "reward": _num(r.get("rollout/reward")), "accuracy": _num(r.get("rollout/accuracy")),
                "well_formed": _num(r.get("rollout/well_formed")), "has_rollouts": step in files,
                "has_tokens": (self.dir / "rollouts" / "tokens" / f"step_{step:06d}.jsonl.gz").is_file(),
                "episodes": None, "failed": None, "trained": None, "dropped_stale": None, "filtered": None,
            }
            if step in files:
                read = self.jsonl(files[step])
                if read.partial:
                    partial_files.append(files[step].name)
                rows = read.rows
                item.update(episodes=len(rows), failed=sum(is_failed(x) for x in rows),
                            trained=sum(bool(x.get("trained")) for x in rows),
                            dropped_stale=sum(bool(x.get("dropped_stale")) for x in rows),
                            filtered=sum(bool(x.get("filtered")) for x in rows))
                if item["reward"] is None:  # the dump is written before the metrics row
                    item["reward"] = _mean(_num(x.get("reward")) for x in rows if not is_failed(x))
            steps.append(item)
        evals = []
        files_by_name = self.eval_files()
        for row in eval_rows:
            kind = next(k.partition("/")[0] for k in row if k.startswith("eval"))
            name = kind.partition("_")[2] or f"step_{row['step']:06d}"
            evals.append({"name": name, "step": row["step"], "kind": kind,
                          "accuracy": _num(row.get(f"{kind}/accuracy")), "reward": _num(row.get(f"{kind}/reward")),
                          "well_formed": _num(row.get(f"{kind}/well_formed")),
                          "accuracy_std": _num(row.get(f"{kind}/accuracy_std")),
                          "has_samples": name in files_by_name})
        sft = self.jsonl(self.dir / "sft.jsonl").rows
        return {
            "run_dir": str(self.dir), "summary": self.summary(), "steps": steps, "evals": evals,
            "eval_files": list(files_by_name), "sft": sft, "has_curves": self.curves_png.is_file(),
            "in_progress": self.summary() is None,
            "partial_files": (["metrics.jsonl"] if mread.partial else []) + partial_files,
            "bad_lines": {"metrics.jsonl": list(mread.bad_lines)} if mread.bad_lines else {},
        }

    def step_rows(self, step: int) -> JsonlRead:
        """The rollout dump of ``step``. Raises DataError (a LookupError-like 404) when there is none."""
        path = self.step_files().get(step)
        if path is None:
            raise DataError(f"step {step}: no rollouts/step_{step:06d}.jsonl in {self.dir}")
        return self.jsonl(path)

    def step(self, step: int, flt: EpisodeFilter = EpisodeFilter()) -> dict[str, Any]:
        """A step's groups and their episodes (only those ``flt`` keeps; a group none passes is left out).

        Each group: ``group_id``, ``task_id``, ``size`` (episodes in the dump), ``reward_mean`` /
        ``reward_std`` over its non-failed episodes, ``episodes``. Each episode: :meth:`episode_brief`.
        Also ``stop_reasons`` (every one present in the step, for the filter's choices), ``total`` and
        ``shown`` episode counts, ``metrics`` (the step's metrics row, if written), ``partial``.
        """
        read = self.step_rows(step)
        groups: dict[str, list[dict[str, Any]]] = {}
        for row in read.rows:
            groups.setdefault(group_of(str(row.get("sample_id", "")))[0], []).append(row)
        out_groups, shown = [], 0
        for gid, rows in groups.items():
            rewards = [float(r["reward"]) for r in rows if not is_failed(r) and not r.get("side_branch_of")
                       and not r.get("context_of")]
            mean = sum(rewards) / len(rewards) if rewards else None
            kept = [self.episode_brief(r, mean) for r in rows if not r.get("context_of")  # shown with their episode
                    and flt.keep(r, is_failed(r), str(r.get("stop_reason")))]
            kept.sort(key=lambda e: e["index"])
            shown += len(kept)
            if kept:
                out_groups.append({"group_id": gid, "task_id": rows[0].get("task_id"), "size": len(rows),
                                   "reward_mean": mean, "reward_std": _std(rewards), "episodes": kept})
        step_rows, _, _ = self.metrics()
        metrics = next((r for r in step_rows if r["step"] == step), None)
        return {"step": step, "groups": out_groups, "total": len(read.rows), "shown": shown,
                "stop_reasons": sorted({str(r.get("stop_reason")) for r in read.rows}),
                "metrics": metrics, "partial": read.partial}

    @staticmethod
    def episode_brief(row: dict[str, Any], group_mean: float | None = None) -> dict[str, Any]:
        """One episode's line in a step's listing: ids, reward (and reward minus its group's mean),
        statuses, flags (``trained``, ``dropped_stale``, ``filtered``, ``failed``, ``crossed_update``),
        policy versions (``sample_version``, ``trained_at_version``, per-turn ``policy_versions``),
        ``turns`` and ``response_chars``."""
        sid = str(row.get("sample_id", ""))
        reward = _num(row.get("reward"))
        responses = row.get("response") or []
        failed = is_failed(row)
        return {
            "sample_id": sid, "index": group_of(sid)[1], "task_id": row.get("task_id"), "reward": reward,
            "vs_group_mean": None if failed or reward is None or group_mean is None else reward - group_mean,
            "reward_status": row.get("reward_status"), "stop_reason": row.get("stop_reason"),
            "error": row.get("error"), "failed": failed, "trained": bool(row.get("trained")),
            "dropped_stale": bool(row.get("dropped_stale")), "filtered": bool(row.get("filtered")),
            "crossed_update": crossed_update(row), "sample_version": row.get("sample_version"),
            "trained_at_version": row.get("trained_at_version"), "policy_versions": row.get("policy_versions") or [],
            "turns": len(responses), "response_chars": sum(len(str(x)) for x in responses),
            "correct": _num((row.get("metrics") or {}).get("correct")),
        }

    def episode(self, step: int, sample_id: str) -> dict[str, Any]:
        """One episode in full: :meth:`episode_brief` plus ``metrics``, ``turns`` (per turn: ``response``,
        ``policy_version``, ``token_versions``), ``messages`` (when the dump has them: role, content,
        tool calls, tool results, parse errors; from the dump row or the step's token record),
        ``tokens`` (when the dump row or the token record has :data:`TOKEN_FIELDS`: see :meth:`_tokens`;
        else None, with ``tokens_missing`` naming the absent fields), ``media_kinds``, ``group_reward_mean`` and ``siblings`` (every
        episode of its group, itself included, as :meth:`episode_brief`).

        Raises DataError when the step or the sample is not in the dump.
        """
        read = self.step_rows(step)
        rows = {str(r.get("sample_id")): r for r in read.rows}
        row = rows.get(sample_id)
        if row is None:
            raise DataError(f"step {step}: no sample {sample_id!r} in rollouts/step_{step:06d}.jsonl")
        gid = group_of(sample_id)[0]
        group = [r for sid, r in rows.items() if group_of(sid)[0] == gid and not r.get("context_of")]
        rewards = [float(r["reward"]) for r in group if not is_failed(r) and not r.get("side_branch_of")]
        mean = sum(rewards) / len(rewards) if rewards else None
        brief = self.episode_brief(row, mean)
        responses = row.get("response") or []
        versions = row.get("policy_versions") or []
        token_versions = row.get("token_versions") or []
        turns = [{"index": i, "response": str(text),
                  "policy_version": versions[i] if i < len(versions) else None,
                  "token_versions": token_versions[i] if i < len(token_versions) else []}
                 for i, text in enumerate(responses)]
        record = self.token_record(step).get(sample_id)
        src, source = row, "rollout dump"
        if any(not isinstance(row.get(f), list) for f in TOKEN_FIELDS) and record is not None:
            src, source = record, f"rollouts/tokens/step_{step:06d}.jsonl.gz"
        missing = [f for f in TOKEN_FIELDS if not isinstance(src.get(f), list)]
        tokens = None
        if not missing:
            tokens = self._tokens(src, source)
        messages = row.get("messages") if isinstance(row.get("messages"), list) else None
        if messages is None and record is not None and isinstance(record.get("messages"), list):
            messages = record["messages"]
        return {**brief, "step": step, "group_id": gid, "metrics": row.get("metrics") or {}, "turn_list": turns,
                "messages": messages, "tokens": tokens, "tokens_missing": missing,
                "media_kinds": (record or {}).get("media_kinds") or [],
                "group_reward_mean": mean, "context_of": row.get("context_of"),
                "contexts": self._contexts(rows, str(row.get("context_of") or sample_id)),
                "siblings": sorted((self.episode_brief(r, mean) for r in group), key=lambda e: e["index"])}

    @staticmethod
    def _contexts(rows: dict[str, dict[str, Any]], episode: str) -> list[dict[str, Any]]:
        """Every context of a multi-segment episode in order (``rollout.context``): ``sample_id``, ``segment``,
        ``turns``, ``stop_reason`` and ``last_response`` (a ``compact`` context's summary); [] for an
        episode of one context."""
        earlier = sorted((r for r in rows.values() if r.get("context_of") == episode), key=lambda r: int(r.get("segment", 0)))
        if not earlier:
            return []
        out = []
        for k, r in enumerate([*earlier, rows[episode]] if episode in rows else earlier):
            responses = r.get("response") or []
            out.append({"sample_id": str(r.get("sample_id")), "segment": k, "turns": len(responses),
                        "stop_reason": r.get("stop_reason"), "last_response": str(responses[-1]) if responses else ""})
        return out

    def _tokens(self, src: dict[str, Any], source: str) -> dict[str, Any]:
        """The token view of one trajectory row: ids, mask, log-probs, the turn and policy version of
        each sampled token (from ``turns``: ``start``, ``token_ids``, ``policy_version``), text."""
        ids = [int(i) for i in src["token_ids"]]
        n = len(ids)
        turn_of: list[int | None] = [None] * n
        version_of: list[int | None] = [None] * n
        for k, turn in enumerate(src.get("turns") or []):
            start = turn.get("start")
            if not isinstance(start, int):
                continue
            for i in range(start, min(start + len(turn.get("token_ids") or ()), n)):
                turn_of[i], version_of[i] = k, turn.get("policy_version")
        text = src.get("token_text")
        if not (isinstance(text, list) and len(text) == n):
            text = self.decoder.texts(ids)
        return {"source": source, "token_ids": ids, "loss_mask": list(src["loss_mask"][:n]),
                "logprobs": list(src["rollout_logprobs"][:n]), "prompt_len": src.get("prompt_len"),
                "turn": turn_of, "policy_version": version_of, "text": text,
                "tokenizer": self.decoder.source, "tokenizer_error": self.decoder.error,
                "advantage": _num(src.get("advantage"))}

    def eval_samples(self, name: str, flt: EpisodeFilter = EpisodeFilter(), reason: str = "") -> dict[str, Any]:
        """Samples of the evaluation ``name`` (a key of :meth:`eval_files`), each with its verdict.

        A sample fails when its verdict is not correct; ``reason`` keeps samples whose verdict
        reason contains it (case-insensitive). Returns ``name``, ``total``, ``correct``, ``samples``
        (``index`` = line order, task and sample ids, seed, ``verdict``, ``prompt``, ``response``,
        ``parsed_calls``, ``conversation``), ``stop_reasons``, ``reasons`` (verdict reason -> count,
        most common first), ``partial``. Raises DataError for an unknown name.
        """
        path = self.eval_files().get(name)
        if path is None:
            raise DataError(f"evaluation {name!r} not found in {self.dir}; expected one of {sorted(self.eval_files())}")
        read = self.jsonl(path)
        samples: list[dict[str, Any]] = []
        reasons: dict[str, int] = {}
        for i, row in enumerate(read.rows):
            verdict = row.get("verdict") or {}
            reasons[str(verdict.get("reason"))] = reasons.get(str(verdict.get("reason")), 0) + 1
            failed = not verdict.get("correct")
            flat = {"reward": verdict.get("reward"), **row}
            if not flt.keep(flat, failed, str(verdict.get("stop_reason"))):
                continue
            if reason and reason.lower() not in str(verdict.get("reason", "")).lower():
                continue
            samples.append({"index": i, "failed": failed, **row})
        return {"name": name, "file": str(path.relative_to(self.dir)), "total": len(read.rows),
                "correct": sum(bool((r.get("verdict") or {}).get("correct")) for r in read.rows),
                "samples": samples, "partial": read.partial,
                "stop_reasons": sorted({str((r.get("verdict") or {}).get("stop_reason")) for r in read.rows}),
                "reasons": sorted(reasons.items(), key=lambda kv: -kv[1])}
