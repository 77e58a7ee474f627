"""Replay a trained step and find where each episode first diverges from what it should have been.

Input: the step's token record (``rollouts/tokens/step_NNNNNN.jsonl.gz``, written by the loop with
``logging.token_record``): the arrays the trainer was given. Per episode, in order, the first failed
check is reported (turn, token index, expected and recorded value):

1. ``turn tokens``: each turn's sampled ids sit in ``token_ids`` at the turn's ``start``, and the
   sequence's ``rollout_logprobs`` there are the turn's own.
2. ``loss mask``: the mask is 1 exactly on the sampled tokens (a shifted or widened mask trains
   tokens the policy never chose, or drops ones it did).
3. ``observation delta``: the tokens between two turns are what the chat template renders for the
   observation messages in between (:meth:`~relax_agent.rollout.chat.ChatRenderer.observation_delta`):
   a re-rendered or re-tokenized turn shows up here.
4. ``log-probs``: the policy of the version that sampled the episode (a checkpoint of that version,
   or the base model for version 0) scores the sampled tokens as recorded, within ``atol``.

Episodes a check cannot judge are reported as skipped for that check with the reason (media
observations, an update landing inside a turn, no weights of that version, messages that do not
line up with the turns, as agent-driven episodes may).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from relax_agent.errors import ConfigError

TURN_TOKENS, LOSS_MASK, DELTA, LOGPROBS = "turn tokens", "loss mask", "observation delta", "log-probs"


@dataclass(frozen=True)
class Divergence:
    """The first place an episode differs from its replay.

    Attributes:
        check: which check failed (``turn tokens``, ``loss mask``, ``observation delta``, ``log-probs``).
        turn: 1-based assistant turn it belongs to (for a delta: the turn the observation follows);
            None for the prompt.
        token: index into the episode's ``token_ids``.
        expected: the replayed value (a token id, a mask bit, a log-prob; None past the end).
        recorded: the value in the record.
    """

    check: str
    turn: int | None
    token: int
    expected: Any
    recorded: Any

    def describe(self, decode: Callable[[Sequence[int]], str] | None = None) -> str:
        where = f"turn {self.turn}, token {self.token}" if self.turn is not None else f"token {self.token}"
        exp, rec = self.expected, self.recorded
        if decode is not None and self.check in (TURN_TOKENS, DELTA):
            exp = "end" if exp is None else f"{exp} {decode([exp])!r}"
            rec = "end" if rec is None else f"{rec} {decode([rec])!r}"
        return f"{self.check} at {where}: expected {exp}, recorded {rec}"


@dataclass
class EpisodeReport:
    """Replay result of one episode: its first divergence (None: it replays) and the checks skipped."""

    sample_id: str
    sample_version: int
    turns: int
    divergence: Divergence | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    max_logprob_diff: float | None = None


def token_record_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / "tokens" / f"step_{step:06d}.jsonl.gz"


def load_token_record(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
    """The step's records, one dict per sample.

    Raises:
        ConfigError: the run has no token record for that step (names the steps it has).
    """
    path = token_record_path(run_dir, step)
    if not path.exists():
        have = sorted(int(p.name[5:11]) for p in path.parent.glob("step_*.jsonl.gz")) if path.parent.exists() else []
        raise ConfigError(f"no token record for step {step} in {Path(run_dir)}: it has steps {have or 'none'} "
                          "(records are written with logging.token_record: true)")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _first_mismatch(expected: Sequence[Any], recorded: Sequence[Any]) -> int | None:
    for i in range(max(len(expected), len(recorded))):
        e = expected[i] if i < len(expected) else None
        r = recorded[i] if i < len(recorded) else None
        if e != r:
            return i
    return None


def check_structure(rec: dict[str, Any]) -> Divergence | None:
    """Checks 1 and 2: turns sit where they say, with their log-probs, under exactly the loss mask."""
    ids, mask, lps = rec["token_ids"], rec["loss_mask"], rec["rollout_logprobs"]
    expected_mask = [0] * len(ids)
    for k, turn in enumerate(rec["turns"], start=1):
        start, sampled = turn["start"], turn["token_ids"]
        i = _first_mismatch(sampled, ids[start:start + len(sampled)])
        if i is not None:
            got = ids[start + i] if start + i < len(ids) else None
            return Divergence(TURN_TOKENS, k, start + i, sampled[i] if i < len(sampled) else None, got)
        for j, lp in enumerate(turn["logprobs"]):
            if lps[start + j] != lp:
                return Divergence(TURN_TOKENS, k, start + j, lp, lps[start + j])
        for j in range(start, start + len(sampled)):
            expected_mask[j] = 1
    i = _first_mismatch(expected_mask, list(mask))
    if i is not None:
        return Divergence(LOSS_MASK, _turn_of(rec, i), i, expected_mask[i], mask[i])
    return None


def _turn_of(rec: dict[str, Any], index: int) -> int | None:
    """1-based turn whose span (sampled tokens and the observation after them) holds ``index``."""
    turn = None
    for k, t in enumerate(rec["turns"], start=1):
        if index >= t["start"]:
            turn = k
    return turn


def observations_between_turns(messages: Sequence[dict[str, Any]], replies: Sequence[str]) -> list[list[dict[str, Any]]] | None:
    """The observation messages after each turn's assistant message (one list per turn but the last),
    or None when the assistant messages cannot be matched to the turns.

    ``replies``: each turn's decoded text; turn k's message is the first assistant message after turn
    k-1's whose content is that text (a prompt may hold example assistant turns before them)."""
    found = _turn_messages(messages, replies)
    return None if found is None else [obs for _, obs in found]


def _turn_messages(messages: Sequence[dict[str, Any]],
                   replies: Sequence[str]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]] | None:
    """(turn k's assistant message, the observations after it) for each turn but the last (see
    :func:`observations_between_turns`)."""
    at: list[int] = []
    i = 0
    for text in replies[:-1]:
        while i < len(messages) and not (messages[i].get("role") == "assistant" and messages[i].get("content") == text):
            i += 1
        if i == len(messages):
            return None
        at.append(i)
        i += 1
    out = []
    for k, pos in enumerate(at):
        end = pos + 1
        while end < len(messages) and messages[end].get("role") != "assistant":
            end += 1
        out.append((dict(messages[pos]), list(messages[pos + 1:end])))
    return out


def check_deltas(rec: dict[str, Any], renderer: Any) -> tuple[Divergence | None, str | None]:
    """Check 3; returns (divergence, reason skipped)."""
    turns = rec["turns"]
    if len(turns) < 2:
        return None, None
    if rec.get("media_kinds"):
        return None, "media episode (observations hold media the record does not keep)"
    decode = renderer.tokenizer.decode
    found = None
    for skip in (True, False):  # the driver keeps special tokens in the text for parsers that read them
        found = found or _turn_messages(rec["messages"], [decode(t["token_ids"], skip_special_tokens=skip) for t in turns])
    if found is None:
        return None, "messages do not line up with the turns (an agent-driven episode?)"
    ids = rec["token_ids"]
    for k in range(len(turns) - 1):
        end = turns[k]["start"] + len(turns[k]["token_ids"])
        recorded = ids[end:turns[k + 1]["start"]]
        sampled, obs = found[k]
        expected = renderer.observation_delta(obs, closed=turns[k]["finish_reason"] != "length",
                                              calls=sampled.get("tool_calls") or ())
        i = _first_mismatch(list(expected), recorded)
        if i is not None:
            return Divergence(DELTA, k + 1, end + i, expected[i] if i < len(expected) else None,
                              recorded[i] if i < len(recorded) else None), None
    return None, None


def check_logprobs(rec: dict[str, Any], model: Any, temperature: float, atol: float) -> tuple[Divergence | None, float]:
    """Check 4 with ``model`` (the policy of the episode's version); returns (divergence, max |diff|)."""
    import torch

    from relax_agent.train.backends.torch_backend import token_logprobs

    ids = torch.tensor([rec["token_ids"]])
    with torch.no_grad():
        logp = token_logprobs(model, ids, torch.ones_like(ids), temperature)[0].double()
    recorded = torch.tensor(rec["rollout_logprobs"], dtype=torch.float64)
    mask = torch.tensor(rec["loss_mask"], dtype=torch.bool)
    diff = torch.where(mask, (logp - recorded).abs(), torch.zeros_like(logp))
    worst = float(diff.max()) if mask.any() else 0.0
    over = torch.nonzero(diff > atol)
    if len(over):
        i = int(over[0, 0])
        return Divergence(LOGPROBS, _turn_of(rec, i), i, round(float(logp[i]), 6), round(float(recorded[i]), 6)), worst
    return None, worst


def checkpoint_versions(run_dir: str | Path) -> dict[int, Path]:
    """policy version -> model folder of each checkpoint in ``run_dir/checkpoints``."""
    out = {}
    for state in sorted(Path(run_dir).glob("checkpoints/step_*/state.json")):
        try:
            out[int(json.loads(state.read_text())["policy_version"])] = state.parent / "model"
        except (ValueError, KeyError, OSError):
            continue
    return out


def replay_records(records: list[dict[str, Any]], renderer: Any, load_model: Callable[[int], Any] | None,
                   temperature: float, atol: float) -> list[EpisodeReport]:
    """Run the checks on ``records``; ``load_model(version)`` returns the policy of a version or None
    when no weights of it exist (``load_model=None``: no log-prob check)."""
    models: dict[int, Any] = {}
    reports = []
    for rec in records:
        version = int(rec["sample_version"])
        rep = EpisodeReport(rec["sample_id"], version, len(rec["turns"]))
        reports.append(rep)
        rep.divergence = check_structure(rec)
        if rep.divergence is None:
            rep.divergence, why = check_deltas(rec, renderer)
            if why:
                rep.skipped[DELTA] = why
        if rep.divergence is not None or load_model is None:
            if load_model is None:
                rep.skipped[LOGPROBS] = "not asked (--no-logprobs)"
            continue
        versions = {t["policy_version"] for t in rec["turns"]}
        if versions != {version} and len(versions) > 1:
            rep.skipped[LOGPROBS] = f"turns sampled by versions {sorted(versions)}"
            continue
        version = versions.pop() if versions else version
        if version not in models:
            models[version] = load_model(version)
        if models[version] is None:
            rep.skipped[LOGPROBS] = f"no weights of version {version} (no checkpoint holds it)"
            continue
        rep.divergence, rep.max_logprob_diff = check_logprobs(rec, models[version], temperature, atol)
    return reports


def replay_step(cfg: Any, run_dir: str | Path, step: int, logprobs: bool = True, atol: float = 2e-3) -> list[EpisodeReport]:
    """Replay step ``step`` of the run in ``run_dir`` configured by ``cfg`` (a ``RelaxConfig``).

    Raises:
        ConfigError: no token record for the step; ModelLoadError: a checkpoint does not load.
    """
    from relax_agent.models import load_policy, load_tokenizer
    from relax_agent.rollout.chat import ChatRenderer

    records = load_token_record(run_dir, step)
    tokenizer = load_tokenizer(cfg.model)
    r = cfg.rollout
    renderer = ChatRenderer(tokenizer, r.tools_in, r.system_prompt, r.tool_example)
    have = checkpoint_versions(run_dir)

    def load_model(version: int) -> Any:
        if version == 0:
            return load_policy(cfg.model)[0]
        if version not in have:
            return None
        return load_policy(cfg.model.model_copy(update={"path": str(have[version]), "gguf_file": None}))[0]

    return replay_records(records, renderer, load_model if logprobs else None, r.temperature, atol)
