"""The HF engine's KV storage: batch buffers that grow in place, and the prefix cache across requests.

- :func:`assemble` lays rows' keys/values right-aligned into shared buffers with spare columns,
  which :class:`_GrowingLayer` fills one decode step at a time (no copy per step).
- :class:`PrefixCache` keeps the KV of recent prompts and finished sequences, found again by
  longest common token prefix (the next turn of an episode prefills only its new tokens).
- :func:`check_cache_layout` refuses models whose cache is not plain attention KV.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from relax_agent.errors import ConfigError

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each [rows, kv_heads, seq, head_dim]."""
RowKV = list[tuple[torch.Tensor, torch.Tensor]]
"""One row's per-layer (keys, values), each [kv_heads, seq, head_dim]."""

_SPARE_COLUMNS = 64
"""Columns a KV buffer holds beyond its content, for decode steps to write into."""


class PrefixCache:
    """KV of recent prompts and finished sequences, found again by longest common token prefix.

    An entry is ``ids`` [m] (CPU long) with keys and values [1, kv_heads, m, head_dim] per layer,
    computed under the engine's current weights (the engine clears the cache on every weight
    update). Bounded to ``max_tokens`` in total, least recently used first out; an entry whose
    ids are a prefix of a newer entry's is dropped (the newer one serves every lookup it would).

    Args:
        max_tokens: most tokens held over all entries.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[int, tuple[torch.Tensor, KV]] = OrderedDict()
        self._next_key = 0

    def lookup(self, ids: torch.Tensor, limit: int) -> tuple[int, KV | None]:
        """``(r, kv)``: the longest cached prefix of ``ids`` [n], cut to at most ``limit`` tokens,
        and its keys/values [1, kv_heads, r, head_dim] per layer (views); ``(0, None)`` on a miss."""
        best, best_key = 0, None
        for key, (cached, _) in self._entries.items():
            common = _common_prefix(cached, ids)
            if common > 0 and common >= best:  # ties: the most recent entry
                best, best_key = common, key
        reused = min(best, limit)
        if best_key is None or reused <= 0:
            return 0, None
        self._entries.move_to_end(best_key)
        kv = self._entries[best_key][1]
        return reused, [(k[:, :, :reused], v[:, :, :reused]) for k, v in kv]

    def insert(self, ids: torch.Tensor, kv: KV) -> None:
        """Hold ``kv`` (per layer [1, kv_heads, len(ids), head_dim]) for ``ids``, evicting LRU entries."""
        if len(ids) > self.max_tokens:
            return
        for key in [k for k, (cached, _) in self._entries.items()
                    if len(cached) <= len(ids) and _common_prefix(cached, ids) == len(cached)]:
            self._drop(key)
        self._entries[self._next_key] = (ids, kv)
        self._next_key += 1
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self.tokens = 0

    def _drop(self, key: int) -> None:
        ids, _ = self._entries.pop(key)
        self.tokens -= len(ids)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of the 1-D id tensors ``a`` and ``b``."""
    n = min(len(a), len(b))
    mismatch = (a[:n] != b[:n]).nonzero()
    return int(mismatch[0]) if len(mismatch) else n


def kv_of(cache: DynamicCache) -> KV:
    """The (keys, values) of each layer of ``cache``, not copied."""
    layers: list[Any] = cache.layers  # attention layers (transformers types their keys/values as optional)
    return [(layer.keys, layer.values) for layer in layers]


def cache_of(kv: KV | None) -> DynamicCache:
    """A ``DynamicCache`` holding ``kv`` (no copy), or an empty one for None."""
    cache = DynamicCache()
    for keys, values in kv or ():
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


class _GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose new columns are written in place into spare buffer capacity.

    ``DynamicLayer`` concatenates, copying the whole cache at every decode step; here a step
    writes one column per row. ``keys``/``values`` are views [rows, kv_heads, length, head_dim]
    of buffers with at least ``length`` columns, reallocated 25% larger when full.

    Args:
        keys, values: buffers [rows, kv_heads, capacity, head_dim].
        length: columns already filled.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self._buffers: tuple[torch.Tensor, ...] = (keys, values)
        self._length = length
        self._expose()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._length, self._length + key_states.shape[-2]
        if end > self._buffers[0].shape[-2]:
            self._buffers = tuple(_widened(buf, start, end + max(_SPARE_COLUMNS, end // 4)) for buf in self._buffers)
        self._buffers[0][:, :, start:end] = key_states
        self._buffers[1][:, :, start:end] = value_states
        self._length = end
        return self._expose()

    def _expose(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = (buf[:, :, :self._length] for buf in self._buffers)
        self.keys, self.values = keys, values
        return keys, values


def _widened(buf: torch.Tensor, filled: int, capacity: int) -> torch.Tensor:
    out = buf.new_empty((*buf.shape[:2], capacity, buf.shape[3]))
    out[:, :, :filled] = buf[:, :, :filled]
    return out


def assemble(rows_kv: list[RowKV], lengths: list[int]) -> DynamicCache:
    """A batch cache: row ``j``'s ``lengths[j]`` columns right-aligned in ``max(lengths)`` columns
    (zeros before them), in buffers with ``_SPARE_COLUMNS`` more for decode steps."""
    width = max(lengths)
    cache = DynamicCache()
    for layer in range(len(rows_kv[0])):
        ref = rows_kv[0][layer][0]
        buffers = []
        for side in (0, 1):
            buf = ref.new_empty((len(rows_kv), ref.shape[0], width + _SPARE_COLUMNS, ref.shape[2]))
            for j, (row, n) in enumerate(zip(rows_kv, lengths, strict=True)):
                buf[j, :, :width - n].zero_()
                buf[j, :, width - n:width] = row[layer][side]
            buffers.append(buf)
        cache.layers.append(_GrowingLayer(buffers[0], buffers[1], width))
    return cache


def check_cache_layout(model: Any) -> None:
    """Refuse models whose cache is not plain attention KV (linear attention, shared KV layers).

    The engine keeps a full ``DynamicLayer`` per layer (sliding-window layers included: the
    attention mask applies the window), which it splits and merges by rows.
    """
    odd = sorted({type(layer).__name__ for layer in DynamicCache(config=model.config).layers
                  if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)})
    if odd:
        raise ConfigError(f"engine.kind=hf keeps one attention KV cache per layer; this model "
                          f"({model.config.model_type}) needs cache layers {odd}")
