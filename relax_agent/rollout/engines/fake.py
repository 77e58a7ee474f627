"""A scripted inference engine for rollout and trainer tests (no model, no threads).

Example::

    engine = FakeEngine([[10, 11, 2], [12, 2]])          # call 0 gets [10, 11, 2], call 1 [12, 2]
    engine = FakeEngine(lambda prompt, params: [len(prompt) % 7, 2])

Replies are cut at the first stop id (kept; ``finish_reason="stop"``) or at
``max_new_tokens`` (``"length"``); a reply that ends without a stop id also reports
``"length"``. Log-probs are :func:`fake_logprob` of (token, position), so tests can
predict them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from relax_agent.errors import EngineError
from relax_agent.rollout.engines.base import Generation, SamplingParams

Reply = Sequence[int] | Generation
"""Token ids to return (cut and scored by the engine), or a full :class:`Generation` (used as is,
with ``policy_version`` set to the engine's)."""


def fake_logprob(token_id: int, position: int) -> float:
    """Deterministic log-prob in [-2.0, -0.001] for ``token_id`` sampled at ``position`` (0-based in the reply)."""
    return -((token_id * 7919 + position * 104729) % 2000 + 1) / 1000.0


def echo_reply(stop_token_ids: Sequence[int]) -> Callable[[list[int], SamplingParams], list[int]]:
    """A reply function for :class:`FakeEngine` that needs no script: the prompt's last three
    tokens, then the first stop id (deterministic, so runs on the fake engine are exact)."""
    stop = int(stop_token_ids[0])

    def reply(prompt_ids: list[int], params: SamplingParams) -> list[int]:
        return [*prompt_ids[-3:], stop]

    return reply


@dataclass(frozen=True)
class FakeCall:
    """One recorded :meth:`FakeEngine.generate` call."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    policy_version: int


class FakeEngine:
    """Implements ``InferenceEngine`` with scripted replies.

    Args:
        replies: a list consumed one entry per call (in call order), or a callable
            ``(prompt_ids, params) -> reply``.
        stop_token_ids: always stop ids (``params.stop_token_ids`` add to them); default ``(2,)``,
            SmolLM2's ``<|im_end|>``.
        delay_s: awaited before each reply, to let concurrent episodes interleave.
        version: initial ``policy_version``.
    """

    def __init__(self, replies: Sequence[Reply] | Callable[[list[int], SamplingParams], Reply],
                 stop_token_ids: Sequence[int] = (2,), delay_s: float = 0.0, version: int = 0) -> None:
        self._replies = replies if callable(replies) else list(replies)
        self._stop = frozenset(stop_token_ids)
        self._delay_s = delay_s
        self._version = version
        self._closed = False
        self.calls: list[FakeCall] = []
        self.loaded: list[tuple[int, Mapping[str, Any]]] = []
        """(version, state_dict) of each :meth:`load_weights` call."""
        self.seeds: list[int] = []
        """Arguments of each :meth:`reseed` call."""

    @property
    def policy_version(self) -> int:
        """The version of the last :meth:`load_weights` (0 before any)."""
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Return the next scripted reply for ``prompt_ids``.

        Raises:
            EngineError: the engine is closed, or the reply list is exhausted.
        """
        reply = self._next_reply(prompt_ids, params)
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        if self._closed:
            raise EngineError("the engine was closed")
        return self._finish(reply, params)

    def generate_many(self, prompts: Sequence[Sequence[int]],
                      params: SamplingParams | Sequence[SamplingParams]) -> list[Generation]:
        """Blocking variant: one generation per prompt, in order."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        return [self._finish(self._next_reply(list(p), sp), sp) for p, sp in zip(prompts, per_prompt, strict=True)]

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Record ``(version, state_dict)`` in :attr:`loaded` and report ``version`` from now on."""
        self.loaded.append((version, state_dict))
        self._version = int(version)

    def reseed(self, seed: int) -> None:
        """Record ``seed`` in :attr:`seeds` (scripted replies do not depend on it)."""
        self.seeds.append(seed)

    def close(self) -> None:
        """Mark the engine closed."""
        self._closed = True

    def _next_reply(self, prompt_ids: list[int], params: SamplingParams) -> Reply:
        if self._closed:
            raise EngineError("the engine is closed")
        index = len(self.calls)
        self.calls.append(FakeCall(tuple(prompt_ids), params, self._version))
        if callable(self._replies):
            return self._replies(list(prompt_ids), params)
        if index >= len(self._replies):
            raise EngineError(f"FakeEngine has {len(self._replies)} scripted replies; call {index + 1} has none")
        return self._replies[index]

    def _finish(self, reply: Reply, params: SamplingParams) -> Generation:
        if isinstance(reply, Generation):
            return replace(reply, policy_version=self._version)
        stop = self._stop | frozenset(params.stop_token_ids)
        tokens: list[int] = []
        reason = "length"
        for tok in list(reply)[: params.max_new_tokens]:
            tokens.append(int(tok))
            if tok in stop:
                reason = "stop"
                break
        logprobs = tuple(fake_logprob(t, i) for i, t in enumerate(tokens))
        return Generation(tuple(tokens), logprobs, reason, self._version)
