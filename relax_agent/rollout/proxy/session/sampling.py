"""One choice of a request from the engine: streamed token by token when the engine can (to stop at
a marker or stream text), cut at the first stop marker, decoded as content and as the parser reads it."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from relax_agent.rollout.engines.base import Generation, InferenceEngine, SamplingParams
from relax_agent.rollout.proxy.session.text import IncrementalText, marker_cut, stop_hit

OnText = Callable[[int, str], None]
"""Streaming listener: (choice index, the reply's text so far, forced opening included)."""


class _StreamingEngine(Protocol):
    """An engine whose ``generate`` calls ``on_token(token_id, logprob, policy_version)`` as it samples
    (:func:`streams_tokens` tells)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_token: Callable[[int, float, int], object]) -> Generation: ...


def streams_tokens(engine: InferenceEngine) -> bool:
    """True when ``engine.generate`` takes ``on_token`` (the HF engine): tokens stream as sampled."""
    try:
        return "on_token" in inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class Sampled:
    """One choice as sampled: the generation, its text (special tokens skipped, as content is shown)
    and the text the parser reads (special tokens kept for a family parser whose call markers are
    special tokens; the same text otherwise)."""

    gen: Generation
    text: str
    parsed_text: str = ""
    stop_string: str | None = None


class Sampling:
    """:class:`~relax_agent.rollout.proxy.session.AgentSession`'s sampling of one choice."""

    engine: InferenceEngine
    _streams: bool
    _decode: Callable[[Sequence[int]], str]
    _parse_decode: Callable[[Sequence[int]], str]

    async def _sample(self, index: int, prompt: list[int], params: SamplingParams, markers: list[tuple[str, bool]],
                      forced_text: str, on_text: OnText | None) -> Sampled:
        """One choice: the engine's generation, cut at the first marker, and its text (forced opening included)."""
        tokens: list[int] = []
        lps: list[float] = []
        version = [self.engine.policy_version]
        loop = asyncio.get_running_loop()
        hit: asyncio.Future = loop.create_future()
        detok = IncrementalText(self._decode)

        def push(tok: int, lp: float, v: int) -> None:
            if hit.done():
                return
            tokens.append(tok)
            lps.append(lp)
            version[0] = v
            text = forced_text + detok.push(tok)
            cut = marker_cut(text, markers)
            if cut is not None:
                hit.set_result(len(tokens))
            if on_text is not None:
                on_text(index, text if cut is None else text[:cut])

        if self._streams and (markers or on_text is not None):
            gen_task = asyncio.ensure_future(cast(_StreamingEngine, self.engine).generate(
                prompt, params, on_token=lambda t, lp, v: loop.call_soon_threadsafe(push, t, lp, v)))
            try:
                await asyncio.wait({gen_task, hit}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                gen_task.cancel()
                raise
            if gen_task.done():
                gen = gen_task.result()
            else:  # a stop marker was sampled: abort the row, keep what it sampled
                gen_task.cancel()
                gen_task.add_done_callback(lambda t: t.cancelled() or t.exception())
                gen = Generation(tuple(tokens), tuple(lps), "stop", version[0])
        else:  # nothing to watch token by token (or the engine cannot stream): one call
            gen = await self.engine.generate(prompt, params)
            if on_text is not None:
                on_text(index, forced_text + self._decode(gen.token_ids))
        gen = self._cut(gen, markers, forced_text)
        text = forced_text + self._decode(gen.token_ids)
        cut = marker_cut(text, markers)
        parsed = forced_text + self._parse_decode(gen.token_ids)
        parsed_cut = marker_cut(parsed, markers)
        return Sampled(gen, text if cut is None else text[:cut], parsed if parsed_cut is None else parsed[:parsed_cut],
                       stop_hit(text, markers))

    def _cut(self, gen: Generation, markers: list[tuple[str, bool]], forced_text: str) -> Generation:
        """``gen`` up to the token that completes the first marker (finish reason "stop"), or as is."""
        if not markers or marker_cut(forced_text + self._decode(gen.token_ids), markers) is None:
            return gen
        for k in range(1, len(gen.token_ids) + 1):
            if marker_cut(forced_text + self._decode(gen.token_ids[:k]), markers) is not None:
                break
        if k == len(gen.token_ids) and gen.finish_reason == "stop":
            return gen
        routes = gen.routed_experts[:k] if gen.routed_experts is not None else None
        return Generation(gen.token_ids[:k], gen.logprobs[:k], "stop", gen.policy_version, routes)
