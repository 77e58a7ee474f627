"""What a step leaves behind for people: its metric row and its rollout dump."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from pathlib import Path
from typing import Any

import numpy as np

from relax_agent import metrics as M
from relax_agent import records as R
from relax_agent.records import Trajectory


def rollout_metrics(trajs: Sequence[Trajectory], rollout_s: float) -> dict[str, float]:
    """Step metrics of a batch of trajectories: :func:`episode_metrics` of their fields."""
    return episode_metrics(R.episode_fields(trajs), rollout_s)


def episode_metrics(fields: Mapping[str, Sequence], rollout_s: float) -> dict[str, float]:
    """Step metrics of a batch of episodes from their scalar fields (:data:`relax_agent.records.EPISODE_FIELDS`,
    [B] each, as the rollout wrote them to the bus): means over the episodes that did not fail, counts
    per stop reason, generated tokens per second of ``rollout_s`` (wall seconds of the step's rollouts)."""
    n = len(fields[R.FAILED])
    ok = ~np.asarray(fields[R.FAILED], dtype=bool)
    n_ok = max(int(ok.sum()), 1)
    generated = int(np.sum(fields[R.RESPONSE_TOKENS]))
    out = {
        M.REWARD: float(np.asarray(fields[R.REWARD], dtype=np.float64)[ok].sum()) / n_ok,
        M.ACCURACY: float(np.asarray(fields[R.CORRECT], dtype=np.float64)[ok].sum()) / n_ok,
        M.FORMAT_RATE: float(np.asarray(fields[R.WELL_FORMED], dtype=np.float64)[ok].sum()) / n_ok,
        M.TOKENS_PER_S: generated / max(rollout_s, 1e-9),
        "rollout/response_tokens": generated / max(n, 1),
        "rollout/failed": float(n - int(ok.sum())),
        "rollout/episodes": float(n),
        M.CROSSED_UPDATE_TURNS: int(np.sum(fields[R.CROSSED_UPDATE_TURNS])) / max(int(np.sum(fields[R.TURNS])), 1),
        "timing/rollout_s": rollout_s,
    }
    cut = float(np.sum(np.asarray(fields[R.AUDIO_CLIPS_CUT], dtype=np.float64)))
    if cut:
        out["rollout/audio_clips_cut"] = cut
    for reason, count in Counter(str(r) for r in fields[R.STOP_REASON]).items():
        out[f"stop/{reason}"] = float(count)
    return out


def write_rollout_dump(path: Path, rows: Iterable[tuple[Trajectory, int]], trained_at: int, kept: set[str],
                       dropped: set[str], decode: Callable[[Sequence[int]], str],
                       filtered: Set[str] = frozenset(), train_branches: bool = False) -> None:
    """``rollouts/step_NNNNNN.jsonl``: every sample of the step, failed ones included.

    ``rows``: ``(trajectory, sample_version)`` pairs. Each line records ``sample_version`` (engine
    policy version when its group started), ``trained_at_version`` (the trainer's version when
    the step trained), ``trained`` (it entered the gradient: trainable with a non-zero
    advantage), ``dropped_stale`` (its group finished too late for ``max_staleness`` and was
    not trained), ``filtered`` (dynamic sampling retired its group untrained: its rewards did not
    vary) and, per turn, ``token_versions`` (each token's policy version where a weight
    update landed inside the turn, else empty). A multi-segment episode's earlier contexts precede it,
    each with ``context_of`` (the episode's sample id), ``segment`` (0-based) and the episode's
    ``trained``. An agent-driven episode's side segments follow it,
    each with ``side_branch_of`` (the episode's sample id) and ``trained``: false, or with
    ``train_branches`` (``rollout.agent.train_branches``) its episode's, when the segment has a
    sampled token and a real reward.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for t, version in rows:
            row = {"sample_version": version, "trained_at_version": trained_at, "trained": t.sample_id in kept,
                   "dropped_stale": t.sample_id in dropped, "filtered": t.sample_id in filtered}
            for k, seg in enumerate(t.context_segments):  # earlier contexts train with their episode
                f.write(json.dumps({**_dump_row(seg, decode), **row, "context_of": t.sample_id, "segment": k}) + "\n")
            f.write(json.dumps({**_dump_row(t, decode), **row}) + "\n")
            for seg in t.side_segments:
                trained = train_branches and row["trained"] and seg.trainable and any(seg.loss_mask)
                f.write(json.dumps({**_dump_row(seg, decode), **row, "trained": trained,
                                    "side_branch_of": t.sample_id}) + "\n")


def _dump_row(t: Trajectory, decode: Callable[[Sequence[int]], str]) -> dict:
    return {"sample_id": t.sample_id, "task_id": t.task_id, "reward": t.reward,
            "reward_status": str(t.reward_status), "metrics": t.metrics, "stop_reason": str(t.stop_reason),
            "error": t.error, "policy_versions": t.policy_versions,
            "response": [decode(turn.token_ids) for turn in t.turns],
            "token_versions": [list(turn.token_versions) for turn in t.turns]}


def write_token_record(path: Path, rows: Iterable[tuple[Trajectory, int]],
                       kind_of_token: Mapping[int, str] | None = None) -> None:
    """``rollouts/tokens/step_NNNNNN.jsonl.gz``: per sample of the step (``(trajectory, sample_version)``
    pairs), exactly the arrays the trainer was given: ``token_ids`` [T], ``loss_mask`` [T],
    ``rollout_logprobs`` [T], ``prompt_len``, the ``turns`` (``start``, ``token_ids``, ``logprobs``,
    ``policy_version``, ``finish_reason``, ``message``: index of the turn's assistant message,
    ``opening``: forced context tokens before it, ``closed``) and the ``messages`` (media parts as
    JSON data, see :func:`~relax_agent.multimodal.record.json_safe_messages`). A media episode also
    gets ``media`` (:func:`~relax_agent.multimodal.record.media_record`: per item kind, placeholder
    tokens, first placeholder position with ``kind_of_token`` (placeholder id -> kind), digest of
    its processor outputs); the arrays are not copied, replay processes the messages' parts again.
    A multi-segment episode writes one line per context, in order (the earlier ones with sample ids
    ``{sample_id}/ctx{k}`` and ``stop_reason`` "context"), each replayed on its own.
    Written to a temporary name and renamed: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt") as f:
        for seg, version in ((s, v) for t, v in rows for s in t.segments):
            _write_token_line(f, seg, version, kind_of_token)
    tmp.replace(path)


def _write_token_line(f: Any, t: Trajectory, version: int, kind_of_token: Mapping[int, str] | None) -> None:
    """One context's line of the token record (see :func:`write_token_record`)."""
    messages = list(t.messages)
    media = None
    if t.media is not None:
        from relax_agent.multimodal.record import json_safe_messages, media_record

        messages = json_safe_messages(messages)
        media = media_record(t.media, t.token_ids, kind_of_token)
    f.write(json.dumps({
        "sample_id": t.sample_id, "task_id": t.task_id, "sample_version": version,
        "token_ids": list(t.token_ids), "loss_mask": list(t.loss_mask),
        "rollout_logprobs": list(t.rollout_logprobs), "prompt_len": t.prompt_len,
        "turns": [{"start": turn.start, "token_ids": list(turn.token_ids), "logprobs": list(turn.logprobs),
                   "policy_version": turn.policy_version, "finish_reason": turn.finish_reason,
                   "message": turn.message_index, "opening": turn.opening, "closed": turn.closed}
                  for turn in t.turns],
        "messages": messages, "trainable": t.trainable,
        "media_kinds": list(t.media.kinds) if t.media is not None else [], "media": media,
        "stop_reason": str(t.stop_reason),
    }, default=str) + "\n")
