"""The HF engine's running batch: each request's decode state and the rows' shared KV layout.

A :class:`Request` is one ``generate`` call (its sampling parameters, stop ids, random stream and
the tokens sampled so far); a :class:`Row` is a prefilled request about to join; a
:class:`Batch` holds the rows decoding together, their KV right-aligned in one cache, and builds
each decode step's inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.engines.hf.kv_cache import KV, RowKV, assemble, kv_of
from relax_agent.rollout.engines.hf.sampling import sample_tokens


@dataclass
class Request:
    """One generation request: prompt, sampling, stop ids, seed and the callback its result goes to."""

    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    seed: int
    deliver: Callable[[Generation | BaseException], None]
    on_token: Callable[[int, float, int], None] | None = None
    """Called from the worker with (token id, log-prob, policy version) as each token is sampled."""
    cancelled: bool = False
    done: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Per sampled token, the policy version that sampled it."""
    routes: list[Any] = field(default_factory=list)
    """Per sampled token, [layers, top_k] experts of the forward that scored it (MoE with record_routes)."""
    generator: torch.Generator | None = None
    """The row's random stream, seeded with ``seed`` when it is prefilled."""


@dataclass
class Row:
    """A prefilled request joining the batch: its KV ([1, kv_heads, length, head_dim] per layer),
    cached length (= the position of its next input token) and that next input token."""

    req: Request
    kv: KV
    length: int
    next_token: int


class Batch:
    """The rows decoding together and their KV cache.

    Layout: per layer, keys and values [rows, kv_heads, width, head_dim]; row ``i`` holds its
    ``lengths[i]`` real columns right-aligned (columns ``width - lengths[i]`` .. ``width - 1``),
    the columns before them are zero padding that the attention mask hides. Its next input token
    ``next_tokens[i]`` goes at position ``lengths[i]``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[Request] = []
        self.lengths: list[int] = []
        self.next_tokens: list[int] = []
        self.cache: DynamicCache | None = None
        self._sampling: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def width(self) -> int:
        """The KV cache's width in tokens (0 with no cache)."""
        if self.cache is None:
            return 0
        first: Any = self.cache.layers[0]  # an attention layer (transformers types its keys as optional)
        return first.keys.shape[-2]

    def merge(self, new: list[Row]) -> None:
        """Add prefilled rows: the batch's KV is copied once into buffers wide enough for every row."""
        if not new:
            return
        rows_kv = [self._row_views(i) for i in range(len(self.rows))] + [[(k[0], v[0]) for k, v in r.kv] for r in new]
        self.lengths += [r.length for r in new]
        self.cache = assemble(rows_kv, self.lengths)
        self.rows += [r.req for r in new]
        self.next_tokens += [r.next_token for r in new]
        self._sampling = None

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input_ids`` [rows, 1], ``attention_mask`` [rows, width + 1], ``position_ids`` [rows, 1]."""
        lengths = torch.tensor(self.lengths, device=self.device)
        columns = torch.arange(self.width + 1, device=self.device)
        attn = (columns[None, :] >= (self.width - lengths)[:, None]).long()
        input_ids = torch.tensor(self.next_tokens, dtype=torch.long, device=self.device)[:, None]
        return input_ids, attn, lengths[:, None]

    def stepped(self, cache: DynamicCache) -> None:
        """Take the cache a decode step returned (one more column for every row)."""
        self.cache = cache
        self.lengths = [n + 1 for n in self.lengths]

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`sample_tokens` for the rows, from ``logits`` [rows, vocab]."""
        if self._sampling is None:
            self._sampling = (
                torch.tensor([r.params.temperature for r in self.rows], device=self.device, dtype=torch.float32),
                torch.tensor([r.params.top_p for r in self.rows], device=self.device, dtype=torch.float32))
        generators = [r.generator for r in self.rows if r.generator is not None]
        assert len(generators) == len(self.rows)  # a row gets its generator when it is prefilled
        return sample_tokens(logits, *self._sampling, generators)

    def row_kv(self, i: int) -> KV:
        """Row ``i``'s real columns, copied out: [1, kv_heads, lengths[i], head_dim] per layer."""
        return [(k[None].clone(), v[None].clone()) for k, v in self._row_views(i)]

    def select(self, keep: list[int], tokens: list[int]) -> None:
        """Keep rows ``keep`` (their next input tokens from ``tokens``); drop padding no row needs."""
        if len(keep) < len(self.rows):
            self._sampling = None
            rows_kv = [self._row_views(i) for i in keep]
            self.rows = [self.rows[i] for i in keep]
            self.lengths = [self.lengths[i] for i in keep]
            self.cache = assemble(rows_kv, self.lengths) if keep else None
        self.next_tokens = [tokens[i] for i in keep]

    def _row_views(self, i: int) -> RowKV:
        assert self.cache is not None  # rows have columns only once the batch has a cache
        start = self.width - self.lengths[i]
        return [(k[i, :, start:], v[i, :, start:]) for k, v in kv_of(self.cache)]
