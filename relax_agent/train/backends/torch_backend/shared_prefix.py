"""Shared-prefix training: the rows of a group that share a prompt run its tokens through the
model once.

A GRPO step trains G samples of each prompt; on a tool-use task the prompt (system text, tool
schemas, the user's turn) is most of each row, so a plain forward/backward computes the same
prompt G times. Here the micro-batch's common prefix is forwarded once (with gradient), its
key/value cache is repeated for the rows, and only each row's suffix is forwarded on top of it.
The log-probs and the gradient are those of the full forward (up to float summation order):
the prefix's activations enter every row's attention through the cache, and the backward pass
sums the rows' gradients into the single prefix computation. The same idea is Prefix Grouper
(Liu et al., arXiv 2506.05433).

:func:`plan_micro_batches` groups the rows of a batch by common prefix (an exact dynamic
programme over the rows in token order, minimising tokens forwarded) and splits each group under
the micro-batch caps; :func:`shared_prefix_forward` is the forward of one such micro-batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from relax_agent.errors import DataError
from relax_agent.train.batch import TrainBatch, check_micro_batch_caps

CLUSTER_COST_TOKENS = 32
"""Tokens' worth of overhead charged per shared-prefix group (its second forward call): a prefix
is shared only when it saves more than this."""


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward of :meth:`TorchTrainer.compute_gradients`.

    Attributes:
        batch: the rows, trimmed to their longest.
        prefix_len: tokens ``[0, prefix_len)`` are the same in every row and are forwarded once;
            0 for a plain forward.
    """

    batch: TrainBatch
    prefix_len: int = 0


def row_caps(batch: TrainBatch) -> list[int]:
    """Per row, the longest prefix that may be shared: every position whose log-prob the loss
    reads must be predicted by the suffix forward, so the prefix ends before the row's first
    loss token's predecessor (``first - 1``), and before its last real token."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    caps = []
    for row, length in enumerate(lengths):
        scored = batch.loss_mask[row].nonzero()
        first = int(scored[0]) if len(scored) else int(length)
        caps.append(max(min(first, int(length)) - 1, 0))
    return caps


def _common_prefix(a: torch.Tensor, b: torch.Tensor, limit: int) -> int:
    """Length of the common prefix of 1-D ``a`` and ``b``, at most ``limit``."""
    n = min(limit, len(a), len(b))
    if n == 0:
        return 0
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


def _groups(batch: TrainBatch) -> list[tuple[list[int], int]]:
    """Rows grouped by shared prefix: ``[(rows, prefix_len)]``, prefix_len 0 for a row alone.

    Rows are sorted by their tokens, so the common prefix of any run of sorted rows is the least
    common prefix of neighbours; a dynamic programme then cuts the sorted rows into runs with the
    fewest tokens forwarded (a run of n rows costs ``L + sum(len - L) + CLUSTER_COST_TOKENS``).
    """
    ids, caps = batch.input_ids, row_caps(batch)
    lengths = [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]
    order = sorted(range(batch.size), key=lambda r: ids[r, :caps[r]].tolist())
    neighbour = [_common_prefix(ids[a], ids[b], min(caps[a], caps[b])) for a, b in zip(order, order[1:], strict=False)]
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sorted rows
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)
    for j in range(1, n + 1):
        shared, total = caps[order[j - 1]], 0
        for i in range(j - 1, -1, -1):  # the run order[i:j]
            total += lengths[order[i]]
            if i < j - 1:
                shared = min(shared, neighbour[i], caps[order[i]])
            size = j - i
            cost = total if size == 1 else total - (size - 1) * shared + CLUSTER_COST_TOKENS
            if best[i] + cost < best[j]:
                best[j], cut[j] = best[i] + cost, (i, shared if size > 1 else 0)
    out, j = [], n
    while j:
        i, shared = cut[j]
        out.append((sorted(order[i:j]), shared))
        j = i
    return sorted(out, key=lambda group: group[0][0])


def plan_micro_batches(batch: TrainBatch, micro_batch_size: int, max_tokens: int | None) -> list[MicroBatch]:
    """The micro-batches of a step, rows that share a prefix together.

    Each group's rows are split as :meth:`TrainBatch.micro_slices` splits a batch, except that the
    token cap counts the prefix once: ``prefix + rows x longest suffix`` <= ``max_tokens``. Rows
    without a partner form plain micro-batches, as without sharing. Each row is in exactly one
    micro-batch.

    Args:
        batch: the step's rows (text rows without routing replay; see :func:`can_share`).
        micro_batch_size: at most this many rows per micro-batch.
        max_tokens: cap on forwarded tokens per micro-batch (None: no cap).

    Raises:
        DataError: ``micro_batch_size`` < 1 or ``max_tokens`` < 1.
    """
    check_micro_batch_caps(micro_batch_size, max_tokens)
    lengths = [max(int(n), 1) for n in batch.attention_mask.sum(dim=1).tolist()]
    out: list[MicroBatch] = []
    alone: list[int] = []
    for rows, prefix in _groups(batch):
        if not prefix:
            alone.extend(rows)
            continue
        for chunk in _chunks(rows, prefix, lengths, micro_batch_size, max_tokens):
            out.append(MicroBatch(batch.select(chunk), prefix if len(chunk) > 1 else 0))
    if alone:
        out.extend(MicroBatch(mb) for mb in batch.select(sorted(alone)).split(micro_batch_size, max_tokens))
    return out


def _chunks(rows: Sequence[int], prefix: int, lengths: Sequence[int], size: int, max_tokens: int | None) -> list[list[int]]:
    out: list[list[int]] = [[]]
    longest = 0
    for row in rows:
        suffix = lengths[row] - prefix
        wider = max(longest, suffix)
        current = out[-1]
        if current and (len(current) == size or (max_tokens is not None
                                                 and prefix + (len(current) + 1) * wider > max_tokens)):
            out.append([])
            wider = suffix
        out[-1].append(row)
        longest = wider
    return out


def can_share(model: nn.Module, batch: TrainBatch) -> bool:
    """Whether :func:`plan_micro_batches` applies: a text batch (no media), no routing replay
    routes, a model whose forward takes a key/value cache, and no activation checkpointing
    (its recomputation would extend the cache a second time)."""
    if batch.media is not None or batch.routed_experts is not None:
        return False
    if _checkpointing(model):
        return False
    return _cache_kwarg(model) is not None


def _checkpointing(model: nn.Module) -> bool:
    """Whether activation checkpointing is on (transformers >= 5.24 name, then the older one)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _cache_kwarg(model: nn.Module) -> str | None:
    """The forward's cache argument: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def shared_prefix_forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          prefix_len: int, logits_from: int) -> torch.Tensor:
    """Logits of the full forward of ``input_ids`` from position ``logits_from`` on, computing the
    shared prefix ``input_ids[:, :prefix_len]`` once.

    Args:
        model: a Hugging Face causal LM (see :func:`can_share`).
        input_ids: [B, T] right-padded rows whose first ``prefix_len`` tokens are the same.
        attention_mask: [B, T], ones over the prefix.
        prefix_len: 1 <= prefix_len < T.
        logits_from: the first position whose logits are returned, >= ``prefix_len``.

    Returns:
        [B, T - logits_from, V] logits, differentiable through the prefix and the suffixes.

    Raises:
        DataError: the rows differ within the prefix, padding falls inside it, or
            ``logits_from`` < ``prefix_len``.
    """
    from transformers import DynamicCache

    from relax_agent.train.backends.torch_backend.logprobs import takes_logits_to_keep

    b, t = input_ids.shape
    if not 0 < prefix_len <= logits_from < t:
        raise DataError(f"need 0 < prefix_len <= logits_from < T; got prefix_len={prefix_len}, "
                        f"logits_from={logits_from}, T={t}")
    prefix = input_ids[:1, :prefix_len]
    if not (bool((input_ids[:, :prefix_len] == prefix).all()) and bool(attention_mask[:, :prefix_len].all())):
        raise DataError(f"the rows do not share their first {prefix_len} tokens")
    kwarg = _cache_kwarg(model)
    assert kwarg is not None  # can_share() checked it
    cache = DynamicCache(config=getattr(model, "config", None))
    keep = {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}
    model(input_ids=prefix, use_cache=True, **keep, **{kwarg: cache})
    cache.batch_repeat_interleave(b)
    positions = torch.arange(prefix_len, t, device=input_ids.device).expand(b, -1)
    if keep:
        keep = {"logits_to_keep": t - logits_from}
    logits = model(input_ids=input_ids[:, prefix_len:], attention_mask=attention_mask, position_ids=positions,
                   use_cache=True, **keep, **{kwarg: cache}).logits
    return logits[:, logits_from - prefix_len:] if logits.shape[1] != t - logits_from else logits
