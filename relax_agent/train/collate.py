"""From data-bus fields to training tensors: the advantages of a group, and a padded batch.

The trainer never sees a :class:`~relax_agent.records.Trajectory`: it reads the rows' fields
(:func:`relax_agent.records.rollout_schema`) as arrays and collates them here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from relax_agent import records as R
from relax_agent.errors import DataError
from relax_agent.train.algorithms import estimator_advantages, group_advantages
from relax_agent.train.batch import TrainBatch


def field_advantages(fields: Mapping[str, Any], group_ids: Sequence[str], std_normalize: bool = True,
                     estimator: str | None = None) -> torch.Tensor:
    """Group-level advantages [B] of rows given as fields ``reward`` [B], ``trainable`` [B] and
    ``policy_tokens`` [B] (or ``loss_mask``, B rows [T_i]), grouped by ``group_ids``.

    A row that is not trainable (reward error / timeout, episode error, overlong-masked) or has
    no policy token (the prompt alone filled ``max_total_tokens``) is left out of its group's
    statistics and gets 0.

    Args:
        estimator: ``trainer.advantage`` (see :func:`~relax_agent.train.algorithms.estimator_advantages`;
            the ``reinforce_pp`` ones still need the step's batch normalisation); None: GRPO, or
            Dr. GRPO when ``std_normalize`` is False.

    Raises:
        ConfigError: unknown estimator.
        DataError: a valid row's reward is not finite.
    """
    ids: dict[str, int] = {}
    group_index = torch.tensor([ids.setdefault(g, len(ids)) for g in group_ids], dtype=torch.long)
    if R.POLICY_TOKENS in fields:
        has_tokens = [int(n) > 0 for n in fields[R.POLICY_TOKENS]]
    else:
        has_tokens = [int(np.count_nonzero(m)) > 0 for m in fields[R.LOSS_MASK]]
    valid = torch.tensor([bool(ok) and tok for ok, tok in zip(fields[R.TRAINABLE], has_tokens, strict=True)], dtype=torch.bool)
    rewards = torch.tensor([float(r) if ok else 0.0 for r, ok in zip(fields[R.REWARD], valid.tolist(), strict=True)],
                           dtype=torch.float32)
    if estimator is None:
        return group_advantages(rewards, group_index, valid, std_normalize=std_normalize)
    return estimator_advantages(estimator, rewards, group_index, valid)


def with_segments(fields: Mapping[str, Any], side_branches: bool = True) -> tuple[dict[str, Any], int, int]:
    """``fields`` with a training row appended for every earlier context of every row (a multi-segment
    episode, ``rollout.context``) and, with ``side_branches`` (``rollout.agent.train_branches``), for
    every side segment; returns (fields, context rows appended, side-branch rows appended).

    Each row's ``trajectory`` (a :class:`~relax_agent.records.Trajectory` as the bus keeps it) carries
    its episode's earlier contexts (``context_segments``) and, for an agent episode, its side segments
    (replies off the trained chain: abandoned requests, unchosen ``n > 1`` siblings, side calls after
    the answer). An appended row trains with the advantage of its episode: the group's advantages are
    computed over the episodes only, so a segment changes no baseline and every sampled token of the
    episode trains once. A row that is not trainable, and a segment with no sampled token, adds
    nothing. Appended rows have no media and no recorded routes (zeros with an all-False routes mask
    when the step replays routes). The ``trajectory`` field is dropped.

    Raises:
        DataError: ``fields`` has no ``trajectory`` field.
    """
    if R.TRAJECTORY not in fields:
        raise DataError(f"segments are read from the {R.TRAJECTORY!r} field; got {sorted(fields)}")
    out = {k: list(v) for k, v in fields.items() if k != R.TRAJECTORY}
    trainable = fields.get(R.TRAINABLE)
    added = {"context": 0, "side": 0}
    for i, traj in enumerate(fields[R.TRAJECTORY]):
        if trainable is not None and not bool(trainable[i]):
            continue
        extra = [("context", seg) for seg in traj.context_segments]
        extra += [("side", seg) for seg in traj.side_segments] if side_branches else []
        for kind, seg in extra:
            if (kind == "side" and not seg.trainable) or not any(seg.loss_mask):
                continue
            _append_row(out, fields, i, seg)
            added[kind] += 1
    return out, added["context"], added["side"]


def _append_row(out: dict[str, Any], fields: Mapping[str, Any], i: int, seg: Any) -> None:
    """Append ``seg`` to ``out`` as a row with row ``i``'s advantage, no media and no recorded routes."""
    out[R.TOKEN_IDS].append(np.asarray(seg.token_ids, dtype=np.int64))
    out[R.LOSS_MASK].append(np.asarray(seg.loss_mask, dtype=np.int8))
    out[R.ROLLOUT_LOGPROBS].append(np.asarray(seg.rollout_logprobs, dtype=np.float32))
    out[R.ADVANTAGE].append(fields[R.ADVANTAGE][i])
    for name, value in ((R.TRAINABLE, True), (R.MEDIA, None)):
        if name in out:
            out[name].append(value)
    if R.ROUTED_EXPERTS in out:
        shape = np.asarray(fields[R.ROUTED_EXPERTS][i]).shape[1:]
        out[R.ROUTED_EXPERTS].append(np.zeros((len(seg.token_ids), *shape),
                                              dtype=np.asarray(fields[R.ROUTED_EXPERTS][i]).dtype))
        out[R.ROUTES_MASK].append(np.zeros(len(seg.token_ids), dtype=bool))


def collate_fields(fields: Mapping[str, Any], pad_token_id: int, advantages: Any = None) -> TrainBatch:
    """Right-pad rows given as fields into a :class:`TrainBatch`.

    Args:
        fields: ``token_ids``, ``loss_mask``, ``rollout_logprobs`` (B ragged rows [T_i]);
            ``advantage`` [B] unless ``advantages`` is given; optional ``trainable`` [B] (a
            row that is not trainable keeps its place with an all-zero loss mask); optional
            ``routed_experts`` (rows [T_i, layers, top_k]) with ``routes_mask`` (rows [T_i]);
            optional ``media`` (B rows, each a :class:`~relax_agent.records.MediaInputs` or None):
            when a row has media the batch's ``media`` carries every row's media (else it is None).
        pad_token_id: written into padding positions (masked out by ``attention_mask``).
        advantages: [B] overrides the ``advantage`` field.

    Raises:
        DataError: no rows, an empty row, a loss mask set on token 0, ragged fields of unequal
            lengths, advantages of another length, routes of different shapes or dtypes, routes
            without their routes mask.
    """
    tokens = fields[R.TOKEN_IDS]
    b = len(tokens)
    if not b:
        raise DataError("collate needs at least one row; got none")
    adv = torch.as_tensor(np.asarray(fields[R.ADVANTAGE] if advantages is None else advantages, dtype=np.float32).copy())
    adv = adv.reshape(-1)
    if adv.numel() != b:
        raise DataError(f"got {adv.numel()} advantages for {b} rows")
    lengths = [len(t) for t in tokens]
    if 0 in lengths:
        raise DataError(f"rows without tokens cannot be trained on: rows {[i for i, n in enumerate(lengths) if not n]}")
    trainable = fields.get(R.TRAINABLE)
    t_max = max(lengths)
    input_ids = torch.full((b, t_max), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, t_max), dtype=torch.long)
    loss_mask = torch.zeros((b, t_max), dtype=torch.bool)
    rollout_logprobs = torch.zeros((b, t_max), dtype=torch.float32)
    for i, n in enumerate(lengths):
        mask, lp = np.asarray(fields[R.LOSS_MASK][i]), np.asarray(fields[R.ROLLOUT_LOGPROBS][i])
        if len(mask) != n or len(lp) != n:
            raise DataError(f"row {i}: token_ids has {n} entries, loss_mask {len(mask)}, rollout_logprobs {len(lp)}")
        if mask[0]:
            raise DataError(f"row {i}: loss_mask is 1 on token 0 (which has no log-prob, nothing precedes it)")
        input_ids[i, :n] = torch.tensor(np.asarray(tokens[i], dtype=np.int64))
        attention_mask[i, :n] = 1
        rollout_logprobs[i, :n] = torch.tensor(lp.astype(np.float32))
        if trainable is None or bool(trainable[i]):
            loss_mask[i, :n] = torch.tensor(mask.astype(bool))
    routes = _collate_routes(fields, lengths, t_max)
    media = fields.get(R.MEDIA)
    if media is not None and any(m is not None for m in media):
        if len(media) != b:
            raise DataError(f"got {len(media)} media rows for {b} rows")
        return TrainBatch(input_ids, attention_mask, loss_mask, rollout_logprobs, adv, *routes, media=tuple(media))
    return TrainBatch(input_ids, attention_mask, loss_mask, rollout_logprobs, adv, *routes)


def _collate_routes(fields: Mapping[str, Any], lengths: list[int], t_max: int) -> tuple[Any, Any]:
    """``(routed_experts [B, T, layers, top_k], routes_mask [B, T])`` right-padded; (None, None)
    without routes (no field, or no row with a recorded route)."""
    rows, masks = fields.get(R.ROUTED_EXPERTS), fields.get(R.ROUTES_MASK)
    if rows is None:
        return None, None
    if masks is None:
        raise DataError(f"{R.ROUTED_EXPERTS} needs {R.ROUTES_MASK} (the positions whose route was recorded)")
    present = [(i, np.asarray(r)) for i, r in enumerate(rows) if r is not None and len(r) and np.any(masks[i])]
    if not present:
        return None, None
    kinds = {(r.shape[1:], r.dtype) for _, r in present}
    if len(kinds) > 1:
        raise DataError(f"rows carry routed_experts of different [layers, top_k] / dtype: {sorted(map(str, kinds))}")
    shape, dtype = kinds.pop()
    out = np.zeros((len(lengths), t_max, *shape), dtype=dtype)
    mask = np.zeros((len(lengths), t_max), dtype=bool)
    for i, r in present:
        out[i, :len(r)] = r
        mask[i, :len(r)] = np.asarray(masks[i], dtype=np.bool_)
    return torch.from_numpy(out), torch.from_numpy(mask)
