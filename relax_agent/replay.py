"""Replay a trained step and find where each episode first diverges from what it should have been.

Input: the step's token record (``rollouts/tokens/step_NNNNNN.jsonl.gz``, written by the loop with
``logging.token_record``): the arrays the trainer was given. Per episode, in order, the first failed
check is reported (turn, token index, expected and recorded value):

1. ``turn tokens``: each turn's sampled ids sit in ``token_ids`` at the turn's ``start``;
   ``turn log-probs``: the sequence's ``rollout_logprobs`` there are the turn's own.
2. ``loss mask``: the mask is 1 exactly on the sampled tokens (a shifted or widened mask trains
   tokens the policy never chose, or drops ones it did); ``messages``: each turn's recorded
   assistant message (``turns[k]["message"]``) is an assistant message, in turn order.
3. ``observation delta``: the tokens between two turns are what the chat template renders for the
   observation messages in between (:meth:`~relax_agent.rollout.chat.ChatRenderer.observation_delta`):
   a re-rendered or re-tokenized turn shows up here. The messages between turn k's assistant
   message and turn k+1's are the observation (the record's ``turns[k]["message"]``; older records
   are matched by the turn's decoded text). Agent-driven episodes (the agent endpoint) are judged
   the same way: the messages the agent sent back are the observation, the forced opening of a
   ``tool_choice`` (``turns[k]["opening"]`` tokens) is left out of the comparison.
4. ``media`` (media episodes, with a :class:`~relax_agent.multimodal.render.MediaRenderer`): the
   prompt's and every observation's media parts are processed again by the model's processor
   (from the messages, which keep them as data) and each delta re-rendered with its placeholders
   expanded, as rollout did; each item's kind, placeholder tokens and digest of its arrays must be
   the record's (:mod:`relax_agent.multimodal.record`). A dropped image is found at its first
   placeholder token: a delta divergence when its placeholders are gone, a ``media`` one when they
   stayed. The prompt's own tokens are not re-rendered (the env's tools are not recorded).
5. ``log-probs``: the policy of the version that sampled the episode (a checkpoint of that version,
   or the base model for version 0) scores the sampled tokens as recorded, within ``atol``; a media
   episode's forward gets its re-made media, as the trainer's did.

A record that cannot be read (not gzip, cut short, a line that is not an episode) or that holds no
episode is an error naming the file and line, never a pass.

Episodes a check cannot judge are reported as skipped for that check with the reason (an update
landing inside a turn, no weights of that version, messages that do not line up with the turns, a
media record written before media items were kept, a media part that cannot be processed again).
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_agent.errors import ConfigError, DataError

TURN_TOKENS, LOSS_MASK, DELTA, MEDIA, LOGPROBS = "turn tokens", "loss mask", "observation delta", "media", "log-probs"
TURN_LOGPROBS, MESSAGES = "turn log-probs", "messages"
RECORD_KEYS = ("sample_id", "sample_version", "token_ids", "loss_mask", "rollout_logprobs", "prompt_len", "turns",
               "messages")
"""Keys every token-record line has (:func:`~relax_agent.control.reporting.write_token_record`)."""


@dataclass(frozen=True)
class Divergence:
    """The first place an episode differs from its replay.

    Attributes:
        check: which check failed (``turn tokens``, ``turn log-probs``: the sequence's rollout
            log-probs at a turn are not the turn's own, ``loss mask``, ``messages``: the record's
            assistant messages are not where its turns say, ``observation delta``, ``media``,
            ``log-probs``).
        turn: 1-based assistant turn it belongs to (for a delta or its media: the turn the observation
            follows); None for the prompt.
        token: index into the episode's ``token_ids`` (a media item: its first placeholder token).
        expected: the replayed value (a token id, a mask bit, a log-prob, a media item as
            ``"{kind} of {n} tokens (digest {d})"``; None past the end or no item).
        recorded: the value in the record.
    """

    check: str
    turn: int | None
    token: int
    expected: Any
    recorded: Any

    def describe(self, decode: Callable[[Sequence[int]], str] | None = None) -> str:
        """One line naming the check, the turn and token, and the expected vs recorded value (with
        ``decode``, token ids of the token checks also as text)."""
        where = f"turn {self.turn}, token {self.token}" if self.turn is not None else f"token {self.token}"
        exp, rec = self.expected, self.recorded
        if decode is not None and self.check in (TURN_TOKENS, DELTA):
            exp = "end" if exp is None else f"{exp} {decode([exp])!r}" if isinstance(exp, int) else exp
            rec = "end" if rec is None else f"{rec} {decode([rec])!r}" if isinstance(rec, int) else rec
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
    """The token record of ``step``: ``<run_dir>/rollouts/tokens/step_<step:06d>.jsonl.gz``."""
    return Path(run_dir) / "rollouts" / "tokens" / f"step_{step:06d}.jsonl.gz"


def load_token_record(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
    """The step's records, one dict per sample.

    Raises:
        ConfigError: the run has no token record for that step (names the steps it has).
        DataError: the record is not gzip, is cut short, holds a line that is not a JSON object with
            every key of :data:`RECORD_KEYS`, or holds no episode (names the file and the line).
    """
    path = token_record_path(run_dir, step)
    if not path.exists():
        have = sorted(int(p.name[5:11]) for p in path.parent.glob("step_*.jsonl.gz")) if path.parent.exists() else []
        raise ConfigError(f"no token record for step {step} in {Path(run_dir)}: it has steps {have or 'none'} "
                          "(records are written with logging.token_record: true)")
    records, line_no = [], 0
    try:
        with gzip.open(path, "rt") as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    records.append(_record(json.loads(line), path, line_no))
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f"line {line_no + 1}" if isinstance(exc, (OSError, EOFError)) else f"line {line_no}"
        raise DataError(f"token record {path}, {where}: unreadable ({type(exc).__name__}: {exc}); "
                        "a cut or corrupt record cannot be replayed") from None
    if not records:
        raise DataError(f"token record {path} holds no episode: nothing to replay")
    return records


def _record(rec: Any, path: Path, line_no: int) -> dict[str, Any]:
    """``rec`` when it is a dict with every key of :data:`RECORD_KEYS`, else a DataError naming file and line."""
    missing = [k for k in RECORD_KEYS if k not in rec] if isinstance(rec, dict) else list(RECORD_KEYS)
    if missing:
        raise DataError(f"token record {path}, line {line_no}: not an episode record (missing {missing})")
    return rec


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
            got = lps[start + j] if start + j < len(lps) else None
            if got != lp:
                return Divergence(TURN_LOGPROBS, k, start + j, lp, got)
        for j in range(start, start + len(sampled)):
            expected_mask[j] = 1
    i = _first_mismatch(expected_mask, list(mask))
    if i is not None:
        return Divergence(LOSS_MASK, _turn_of(rec, i), i, expected_mask[i], mask[i])
    return None


def check_messages(rec: dict[str, Any]) -> Divergence | None:
    """Each turn's recorded assistant message (``turns[k]["message"]``) is an assistant message, in turn
    order (a removed or moved message diverges); records without these indexes are not judged here."""
    idx = [t.get("message") for t in rec["turns"]]
    if not idx or None in idx:
        return None
    messages = rec["messages"]
    ok = all(isinstance(i, int) and 0 <= i < len(messages) and isinstance(messages[i], dict)
             and messages[i].get("role") == "assistant" for i in idx) and all(a < b for a, b in itertools.pairwise(idx))
    if ok:
        return None
    found = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
    return Divergence(MESSAGES, None, rec["prompt_len"], f"assistant messages at {idx} (one per turn)",
                      f"assistant messages at {found}")


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
    at = _match_replies(messages, replies[:-1])
    return None if at is None else _between(messages, at)


def _match_replies(messages: Sequence[dict[str, Any]], replies: Sequence[str]) -> list[int] | None:
    at: list[int] = []
    i = 0
    for text in replies:
        while i < len(messages) and not (messages[i].get("role") == "assistant" and messages[i].get("content") == text):
            i += 1
        if i == len(messages):
            return None
        at.append(i)
        i += 1
    return at


def _between(messages: Sequence[dict[str, Any]], at: Sequence[int]) -> list[list[dict[str, Any]]]:
    out = []
    for pos in at:
        end = pos + 1
        while end < len(messages) and messages[end].get("role") != "assistant":
            end += 1
        out.append(list(messages[pos + 1:end]))
    return out


Messages = list[dict[str, Any]]


def turn_messages(rec: dict[str, Any], decode: Callable[..., str]) -> tuple[Messages, list[Messages], Messages] | None:
    """(prompt messages, the observation messages after each turn but the last, the assistant message
    of each turn but the last) of a record, or None when its messages cannot be lined up with its turns.

    A record that keeps each turn's assistant message index (``turns[k]["message"]``, any driver,
    the agent endpoint's included) is split there: the observations after turn k are the messages
    between its assistant message and turn k+1's. An older record is matched by text (turn k's
    message: the first assistant message after turn k-1's whose content is the turn's decoded
    text), which an agent endpoint's parsed replies do not pass."""
    messages, turns = rec["messages"], rec["turns"]
    idx = [t.get("message") for t in turns]
    if idx and None not in idx:  # the record says where each turn's message is: it holds, or nothing does
        if all(isinstance(i, int) and 0 <= i < len(messages) and messages[i].get("role") == "assistant" for i in idx) \
                and all(a < b for a, b in itertools.pairwise(idx)):
            return (list(messages[:idx[0]]), [list(messages[a + 1:b]) for a, b in itertools.pairwise(idx)],
                    [dict(messages[i]) for i in idx[:-1]])
        return None
    for skip in (True, False):  # the driver keeps special tokens in the text for parsers that read them
        replies = [decode(t["token_ids"], skip_special_tokens=skip) for t in turns]
        at = _match_replies(messages, replies[:-1])
        if at is None:
            continue
        first = at[0] if at else next(iter(_match_replies(messages, replies[:1]) or ()), None)
        if first is None:
            continue
        return list(messages[:first]), _between(messages, at), [dict(messages[i]) for i in at]
    return None


def _closed(turn: dict[str, Any]) -> bool:
    """Whether the turn ends with the template's closing token (the record's ``closed``, else its finish reason)."""
    return turn["closed"] if turn.get("closed") is not None else turn["finish_reason"] != "length"


def check_deltas(rec: dict[str, Any], renderer: Any) -> tuple[Divergence | None, str | None]:
    """Check 3 (and, for a media episode, its media items); returns (divergence, reason skipped)."""
    div, why, _ = check_deltas_and_media(rec, renderer)
    return div, why


def _media_desc(kind: str, n: int, digest: str) -> str:
    return f"{kind} of {n} tokens (digest {digest})"


def check_deltas_and_media(rec: dict[str, Any], renderer: Any) -> tuple[Divergence | None, str | None, Any]:
    """Check 3 with media: returns (divergence, reason skipped, the episode's media re-made from its
    messages — a :class:`~relax_agent.records.MediaInputs`, None for a text episode or when not re-made).

    Text episodes: each observation delta is re-rendered with ``renderer`` and compared token by token.
    Media episodes (``renderer`` a :class:`~relax_agent.multimodal.render.MediaRenderer`, the record's
    ``media`` entry): the prompt's media parts and each observation's are processed again with the
    model's processor, each delta re-rendered with its placeholders expanded (as rollout did) and
    compared token by token, and every media item compared with the recorded one (kind, placeholder
    tokens, digest of its arrays) in token order: a dropped image shows up at its first placeholder
    token, as a delta token (its placeholders gone) or a ``media`` divergence (placeholders kept, its
    features gone)."""
    turns = rec["turns"]
    is_media = bool(rec.get("media_kinds"))
    if is_media and (rec.get("media") or {}).get("digests") is None:
        return None, ("media episode whose record keeps no media digests (written before they were kept, or arrays "
                      "of a layout the record does not split)"), None
    from relax_agent.multimodal.render import MediaRenderer

    if is_media and not isinstance(renderer, MediaRenderer):
        return None, "media episode replayed with a text renderer (the policy's config is not multimodal)", None
    if len(turns) < 2 and not is_media:
        return None, None, None
    decode = renderer.tokenizer.decode
    layout = turn_messages(rec, decode)
    if layout is None:  # a record with message indexes that do not hold fails check_messages first
        return None, "messages do not line up with the turns", None
    prompt_msgs, obs, sampled = layout
    ids = rec["token_ids"]
    made: list[Any] = []  # one-item MediaInputs, in token order
    if is_media:
        from relax_agent.multimodal.parts import part_kind
        from relax_agent.multimodal.record import item_starts

        parts = [p for m in prompt_msgs if isinstance(m.get("content"), list) for p in m["content"]
                 if isinstance(p, dict) and part_kind(p) is not None]
        try:
            items = [renderer.processor.process(p, f"prompt media part {j}") for j, p in enumerate(parts)]
        except Exception as exc:  # noqa: BLE001 - a part the record cannot give back: said, not raised
            return None, f"prompt media cannot be processed again ({type(exc).__name__}: {exc})", None
        starts = item_starts(ids[:rec["prompt_len"]], [i.kinds[0] for i in items], [i.num_tokens[0] for i in items],
                             renderer.family.kind_of_token())
        div = _compare_items(rec, items, starts or [rec["prompt_len"]] * len(items), 0, None)
        if div is not None:
            return div, None, None
        made += items
    for k in range(len(turns) - 1):
        end = turns[k]["start"] + len(turns[k]["token_ids"])
        recorded = ids[end:turns[k + 1]["start"] - int(turns[k + 1].get("opening") or 0)]
        try:
            seg = renderer.observation_delta(obs[k], closed=_closed(turns[k]), calls=sampled[k].get("tool_calls") or ())
        except Exception as exc:  # noqa: BLE001 - a delta the record cannot give back: said, not raised
            return None, f"observation after turn {k + 1} cannot be rendered again ({type(exc).__name__}: {exc})", None
        expected = list(seg.token_ids) if is_media else list(seg)
        i = _first_mismatch(expected, recorded)
        if i is not None:
            return Divergence(DELTA, k + 1, end + i, expected[i] if i < len(expected) else None,
                              recorded[i] if i < len(recorded) else None), None, None
        if is_media and seg.media is not None:
            from relax_agent.multimodal.record import item_starts, split_items

            items = split_items(seg.media)
            local = item_starts(expected, seg.media.kinds, seg.media.num_tokens, renderer.family.kind_of_token())
            assert local is not None  # a delta the renderer made holds its own items' placeholders
            div = _compare_items(rec, items, [end + j for j in local], len(made), k + 1)
            if div is not None:
                return div, None, None
            made += items
    if is_media:
        n = len(rec["media"]["kinds"])
        if n > len(made):  # recorded items no message holds (after the last delta checked)
            at = (rec["media"].get("starts") or [None] * n)[len(made)]
            r = rec["media"]
            return Divergence(MEDIA, _turn_of(rec, at) if at is not None else None, at if at is not None else len(ids),
                              None, _media_desc(r["kinds"][len(made)], r["num_tokens"][len(made)],
                                                r["digests"][len(made)])), None, None
        from relax_agent.records import MediaInputs

        return None, None, MediaInputs.concat(made)
    return None, None, None


def _compare_items(rec: dict[str, Any], items: Sequence[Any], starts: Sequence[int], first: int,
                   turn: int | None) -> Divergence | None:
    """The first of ``items`` (re-made, recorded as items ``first..``) whose kind, token count or
    digest differs from the record's, at its first placeholder token (``starts``)."""
    from relax_agent.multimodal.record import item_digest

    r = rec["media"]
    for j, (item, at) in enumerate(zip(items, starts, strict=True)):
        want = _media_desc(item.kinds[0], item.num_tokens[0], item_digest(item))
        q = first + j
        got = _media_desc(r["kinds"][q], r["num_tokens"][q], r["digests"][q]) if q < len(r["kinds"]) else None
        if want != got:
            return Divergence(MEDIA, turn, at, want, got)
    return None


def check_logprobs(rec: dict[str, Any], model: Any, temperature: float, atol: float,
                   media: Any = None) -> tuple[Divergence | None, float]:
    """Check 4 with ``model`` (the policy of the episode's version; ``media``: the episode's
    :class:`~relax_agent.records.MediaInputs`, fed to the forward as the trainer does); returns
    (divergence, max |diff|)."""
    import torch

    from relax_agent.train.backends.torch_backend import token_logprobs

    ids = torch.tensor([rec["token_ids"]])
    with torch.no_grad():
        logp = token_logprobs(model, ids, torch.ones_like(ids), temperature,
                              media=[media] if media is not None else None)[0].double()
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
        rep.divergence = check_structure(rec) or check_messages(rec)
        media = None
        if rep.divergence is None:
            rep.divergence, why, media = check_deltas_and_media(rec, renderer)
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
        if rec.get("media_kinds") and media is None:
            rep.skipped[LOGPROBS] = "media episode whose media were not re-made from its messages"
            continue
        rep.divergence, rep.max_logprob_diff = check_logprobs(rec, models[version], temperature, atol, media)
    return reports


def replay_step(cfg: Any, run_dir: str | Path, step: int, logprobs: bool = True, atol: float = 2e-3) -> list[EpisodeReport]:
    """Replay step ``step`` of the run in ``run_dir`` configured by ``cfg`` (a ``RelaxConfig``).

    Raises:
        ConfigError: no token record for the step; ModelLoadError: a checkpoint does not load.
    """
    from relax_agent.models import is_media_policy, load_policy, load_tokenizer
    from relax_agent.rollout.chat import ChatRenderer

    records = load_token_record(run_dir, step)
    tokenizer = load_tokenizer(cfg.model)
    r = cfg.rollout
    media = is_media_policy(cfg.model)
    renderer: Any = ChatRenderer(tokenizer, r.tools_in, r.system_prompt, r.tool_example, accepts_media=media)
    if media:
        from transformers import AutoConfig

        from relax_agent.models import load_media_processor
        from relax_agent.multimodal.render import MediaRenderer

        processor = load_media_processor(cfg.model, AutoConfig.from_pretrained(cfg.model.path),
                                         max_image_pixels=r.max_image_pixels, max_video_frames=r.max_video_frames)
        renderer = MediaRenderer(renderer, processor)
    have = checkpoint_versions(run_dir)

    def load_model(version: int) -> Any:
        if version == 0:
            return load_policy(cfg.model)[0]
        if version not in have:
            return None
        return load_policy(cfg.model.model_copy(update={"path": str(have[version]), "gguf_file": None}))[0]

    return replay_records(records, renderer, load_model if logprobs else None, r.temperature, atol)
