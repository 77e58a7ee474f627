"""Trajectory records: what one episode leaves on the data bus.

Token-in/token-out: ``token_ids`` is the prompt rendered once, then for each turn the exact
token ids the engine sampled, then the chat-template token delta of each observation.
Nothing is ever re-tokenized, so the trainer sees exactly what the policy generated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

RewardStatus = Literal["ok", "error", "timeout"]
"""ok: the reward is real (0 can be a wrong answer); error/timeout: the reward could not be
obtained; the sample is masked out of the policy gradient and counted."""


@dataclass(frozen=True)
class Turn:
    """One assistant turn as the engine produced it.

    Attributes:
        start: index in ``Trajectory.token_ids`` of the first sampled token.
        token_ids: [n] sampled token ids, exactly as the engine returned them.
        logprobs: [n] log-prob of each sampled token under the rollout policy.
        policy_version: weights version that sampled this turn.
        finish_reason: "stop" (EOS/stop token) or "length" (hit max_new_tokens).
        routed_experts: MoE routing replay only: [n, layers, top_k] uint8/int16 experts chosen,
            per MoE layer, by the forward pass that scored each sampled token; None otherwise.
    """

    start: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_version: int
    finish_reason: str
    routed_experts: Any = None


@dataclass(frozen=True)
class Trajectory:
    """One finished (or failed) episode.

    Attributes:
        sample_id: unique id of this sample, ``"{group_id}/{index}"``.
        group_id: id of the GRPO group (one task, G samples).
        task_id: id of the task in its dataset.
        token_ids: [T] prompt + sampled turns + observation deltas.
        loss_mask: [T] 1 on policy-sampled tokens, 0 on prompt and observation tokens.
        rollout_logprobs: [T] rollout log-prob of each policy token, 0.0 elsewhere.
        prompt_len: tokens in the rendered prompt (prefix of ``token_ids``).
        turns: the assistant turns in order.
        reward: scalar reward; meaningful only when ``reward_status == "ok"``.
        reward_status: "ok", "error" or "timeout" (see :data:`RewardStatus`).
        messages: the conversation as chat messages (for logs and reward services).
        metrics: per-episode scalars from the env/reward (e.g. ``correct``, ``well_formed``).
        stop_reason: why the episode ended: "terminated", "truncated", "length" (the last
            reply was cut at ``max_new_tokens``), "max_turns", "max_total_tokens", "env_error".
        error: cause when the episode failed (env exception, bad return); None otherwise.

    MoE routing replay: :attr:`routed_experts` [T, layers, top_k] and :attr:`routes_mask` [T]
    assemble the turns' routes at the turns' token positions.
    """

    sample_id: str
    group_id: str
    task_id: str
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    prompt_len: int
    turns: tuple[Turn, ...]
    reward: float
    reward_status: RewardStatus = "ok"
    messages: tuple[dict[str, Any], ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: str = "terminated"
    error: str | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert len(self.loss_mask) == n and len(self.rollout_logprobs) == n, "ragged trajectory"
        assert self.prompt_len <= n

    @property
    def trainable(self) -> bool:
        """True when the sample may enter the policy gradient (real reward, finite)."""
        return self.reward_status == "ok" and self.error is None and math.isfinite(self.reward)

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def policy_versions(self) -> tuple[int, ...]:
        return tuple(t.policy_version for t in self.turns)

    @property
    def routes_mask(self) -> np.ndarray:
        """[T] bool, True on the tokens of turns that carry ``routed_experts``."""
        mask = np.zeros(len(self.token_ids), dtype=bool)
        for turn in self.turns:
            if turn.routed_experts is not None:
                mask[turn.start:turn.start + len(turn.token_ids)] = True
        return mask

    @property
    def routed_experts(self) -> np.ndarray | None:
        """[T, layers, top_k] the turns' routes at their token positions, 0 elsewhere; None without routes."""
        routed = [t for t in self.turns if t.routed_experts is not None]
        if not routed:
            return None
        first = np.asarray(routed[0].routed_experts)
        out = np.zeros((len(self.token_ids), *first.shape[1:]), dtype=first.dtype)
        for turn in routed:
            out[turn.start:turn.start + len(turn.token_ids)] = turn.routed_experts
        return out
