"""Records shared by rollout and trainer, owned by neither: turns, trajectories, stop reasons,
reward status, and the data-bus schema they travel in.

Token-in/token-out: ``token_ids`` is the prompt rendered once, then for each turn the exact
token ids the engine sampled, then the chat-template token delta of each observation.
Nothing is ever re-tokenized, so the trainer sees exactly what the policy generated.

On the data bus a trajectory travels as *fields* (:data:`ROLLOUT_SCHEMA`): the trainer reads
token ids, loss mask, rollout log-probs, advantages and routed experts as arrays, never the
object; the whole :class:`Trajectory` rides along as a dump-only field for the rollout files.
A multimodal sample's processor outputs (:class:`MediaInputs`) travel in the ``media`` field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from relax_agent.data.schema import FieldSpec


class RewardStatus(str, Enum):
    """Outcome of scoring one sample.

    ``ok``: the reward is real (0.0 can be a wrong answer); ``error`` / ``timeout``: it could
    not be obtained (the scorer raised, the service was unreachable or too slow); such a sample
    is masked out of the policy gradient and counted, never scored 0.
    """

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"

    def __str__(self) -> str:
        return self.value


class StopReason(str, Enum):
    """Why an episode ended."""

    TERMINATED = "terminated"
    """The env said the task is over."""
    TRUNCATED = "truncated"
    """The env (or its TimeLimit) cut the episode."""
    LENGTH = "length"
    """The last reply was cut at ``max_new_tokens`` (or the token budget)."""
    MAX_TURNS = "max_turns"
    """``env.max_turns`` assistant turns were played."""
    MAX_TOTAL_TOKENS = "max_total_tokens"
    """The episode's token budget ``rollout.max_total_tokens`` was used up."""
    ENV_ERROR = "env_error"
    """The episode failed (env exception, bad return, timeout); ``error`` names the cause."""
    POLICY_ERROR = "policy_error"
    """The policy sampled what the episode cannot go on with (a media placeholder token no media
    fills); ``error`` names it. Failed and masked like ``env_error``, but the env is not at fault."""
    CONTEXT = "context"
    """Not an end: an earlier segment of a multi-segment episode stopped here because its context was
    full (``rollout.context``), and the episode went on in a new context."""
    MAX_SEGMENTS = "max_segments"
    """The episode used ``rollout.context.max_segments`` contexts and the last one was full."""
    MAX_SAMPLED_TOKENS = "max_sampled_tokens"
    """The episode sampled ``rollout.context.max_sampled_tokens`` tokens over all its segments."""
    SUMMARY_FAILED = "summary_failed"
    """``rollout.context.policy: compact``: the policy's summary was empty, cut at its token cap or
    held a tool call; ``env_reason`` says which. The episode keeps its reward so far and trains."""

    def __str__(self) -> str:
        return self.value


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
        token_versions: [n] policy version of each token when a weight update landed inside
            this turn (``policy_version`` is then the oldest); empty when one version sampled it all.
        context_routed_experts: MoE routing replay from an engine that reports its prefill's routes
            (the HF engine serving a multimodal policy): [d, layers, top_k] experts for the d context tokens right
            before this turn that no earlier turn routed (prompt, observation deltas, their media
            tokens): row i is token ``start - d + i``, routed at position ``start - d + i - 1``
            by this turn's prefill. The first token of an episode has none (no position scores it).
            None otherwise.
        message_index: index in ``Trajectory.messages`` of this turn's assistant message (the
            recorder sets it); None when not known (records made before it was kept).
        opening: context tokens right before ``start`` that the agent endpoint appended to force a
            tool call's opening (``tool_choice``); 0 otherwise.
        closed: the turn ends with the template's closing token (the next observation delta then
            does not start with one); None: ``finish_reason != "length"`` tells.
    """

    start: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_version: int
    finish_reason: str
    routed_experts: Any = None
    token_versions: tuple[int, ...] = ()
    context_routed_experts: Any = None
    message_index: int | None = None
    opening: int = 0
    closed: bool | None = None

    @property
    def context_start(self) -> int:
        """Index of the first token :attr:`context_routed_experts` covers (``start`` when it has none)."""
        return self.start - (0 if self.context_routed_experts is None else len(self.context_routed_experts))

    @property
    def crossed_update(self) -> bool:
        """Whether tokens of this turn were sampled under more than one policy version."""
        return len(set(self.token_versions)) > 1


MEDIA_KINDS = ("image", "video", "audio")
"""Kinds of media item a multimodal policy takes (the order of ``mm_token_type_ids`` 1, 2, 3)."""


@dataclass(frozen=True)
class MediaInputs:
    """Processor outputs of one sample's media items, in the order their placeholder tokens
    appear in the sample's token ids (each item was processed once, when its message was rendered).

    Attributes:
        kinds: [n] kind of each item, one of :data:`MEDIA_KINDS`.
        num_tokens: [n] placeholder tokens each item occupies in the token ids (the encoder
            produces exactly that many feature vectors for it).
        arrays: model input name -> numpy array, concatenated along dim 0 over the items that
            have it, in item order. Qwen family: ``pixel_values`` [patches, C*t*p*p] float32 with
            ``image_grid_thw`` [images, 3] int64; ``pixel_values_videos`` / ``video_grid_thw``
            likewise; ``input_features`` [clips, mels, frames] float32 with
            ``feature_attention_mask`` [clips, frames] int64.
        digests: [n] :func:`~relax_agent.multimodal.record.item_digest` of each item, kept by
            :meth:`summary` (whose ``arrays`` are empty); None where the arrays are present (or
            their per-item layout is unknown).
    """

    kinds: tuple[str, ...]
    num_tokens: tuple[int, ...]
    arrays: Mapping[str, np.ndarray]
    digests: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        assert len(self.kinds) == len(self.num_tokens), "one token count per media item"

    def __len__(self) -> int:
        return len(self.kinds)

    def summary(self) -> MediaInputs:
        """The items without their arrays: kinds, token counts and each item's digest (what the run's
        records keep; the arrays travel to the trainer in the bus's ``media`` field)."""
        from relax_agent.errors import DataError
        from relax_agent.multimodal.record import item_digest, split_items

        try:
            digests: tuple[str, ...] | None = tuple(item_digest(i) for i in split_items(self))
        except DataError:  # a layout not known here: the records keep no digests, as before
            digests = None
        return MediaInputs(self.kinds, self.num_tokens, {}, digests)

    @staticmethod
    def concat(parts: Sequence[MediaInputs | None]) -> MediaInputs | None:
        """The items of ``parts`` in order (None and empty parts skipped); None when no item is left."""
        kept = [p for p in parts if p is not None and len(p)]
        if not kept:
            return None
        if len(kept) == 1:
            return kept[0]
        names = sorted({k for p in kept for k in p.arrays})
        arrays = {k: np.concatenate([p.arrays[k] for p in kept if k in p.arrays], axis=0) for k in names}
        return MediaInputs(tuple(k for p in kept for k in p.kinds), tuple(n for p in kept for n in p.num_tokens),
                           arrays)


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
            reply was cut at ``max_new_tokens``), "max_turns", "max_total_tokens", "env_error",
            "policy_error".
        error: cause when the episode failed (env exception, bad return); None otherwise.
        media: multimodal policies: the processor outputs of every media item in ``token_ids``
            (prompt and observations, in order); None for text-only episodes.
        env_reason: the env's last ``info["reason"]`` (why the episode scored as it did, e.g. BFCL's
            checker message), when the env gives one; None otherwise.
        side_segments: agent-driven episodes: the segments off the trained chain (replies the agent
            did not keep: abandoned requests, unchosen ``n > 1`` siblings, side calls after the answer,
            rewritten histories), sample ids ``{sample_id}/seg{k}``, the episode's reward; never trained,
            written to the rollout dump after the episode (``side_branch_of``). Empty otherwise.
        context_segments: a multi-segment episode (``rollout.context``; an agent that rewrote its
            history): the earlier contexts, in order, each a trajectory of its own tokens, turns and
            messages (sample ids ``{sample_id}/ctx{k}``, stop reason "context", the episode's reward).
            This trajectory is the last context. Every segment trains with the episode's advantage
            (each sampled token once); the group's advantages are computed over the episodes.

    MoE routing replay: :attr:`routed_experts` [T, layers, top_k] and :attr:`routes_mask` [T]
    assemble the turns' routes at the turns' token positions, and their context routes
    (``Turn.context_routed_experts``) at the context tokens before each turn.
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
    reward_status: RewardStatus = RewardStatus.OK
    messages: tuple[dict[str, Any], ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: StopReason = StopReason.TERMINATED
    error: str | None = None
    media: MediaInputs | None = None
    env_reason: str | None = None
    side_segments: tuple[Trajectory, ...] = ()
    context_segments: tuple[Trajectory, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "reward_status", RewardStatus(self.reward_status))
        object.__setattr__(self, "stop_reason", StopReason(self.stop_reason))
        n = len(self.token_ids)
        assert len(self.loss_mask) == n and len(self.rollout_logprobs) == n, "ragged trajectory"
        assert self.prompt_len <= n

    def for_records(self) -> Trajectory:
        """This episode without its heavy arrays: media as :meth:`MediaInputs.summary` and the turns
        without routed experts (both travel to the trainer in their own bus fields). What the bus's
        ``trajectory`` field holds, for the loop's metrics, dumps and token records."""
        turns = tuple(t if t.routed_experts is None and t.context_routed_experts is None
                      else dataclasses.replace(t, routed_experts=None, context_routed_experts=None) for t in self.turns)
        media = None if self.media is None else self.media.summary()
        side = tuple(seg.for_records() for seg in self.side_segments)
        ctx = tuple(seg.for_records() for seg in self.context_segments)
        return dataclasses.replace(self, turns=turns, media=media, side_segments=side, context_segments=ctx)

    @property
    def segments(self) -> tuple[Trajectory, ...]:
        """Every context of the episode in order: :attr:`context_segments`, then this one."""
        return (*self.context_segments, self)

    @property
    def trainable(self) -> bool:
        """True when the sample may enter the policy gradient (real reward, finite)."""
        return self.reward_status == "ok" and self.error is None and math.isfinite(self.reward)

    @property
    def num_policy_tokens(self) -> int:
        """Tokens the policy sampled (the ones ``loss_mask`` marks), in this context only."""
        return sum(self.loss_mask)

    @property
    def episode_policy_tokens(self) -> int:
        """Tokens the policy sampled over every context of the episode."""
        return sum(seg.num_policy_tokens for seg in self.segments)

    @property
    def policy_versions(self) -> tuple[int, ...]:
        """The policy version of each turn, in order."""
        return tuple(t.policy_version for t in self.turns)

    @property
    def routes_mask(self) -> np.ndarray:
        """[T] bool, True on the tokens of turns that carry ``routed_experts`` and on the context
        tokens their ``context_routed_experts`` cover."""
        mask = np.zeros(len(self.token_ids), dtype=bool)
        for turn in self.turns:
            if turn.routed_experts is not None:
                mask[turn.context_start:turn.start + len(turn.token_ids)] = True
        return mask

    @property
    def routed_experts(self) -> np.ndarray | None:
        """[T, layers, top_k] the turns' routes (and context routes) at their token positions, 0
        elsewhere; None without routes."""
        routed = [t for t in self.turns if t.routed_experts is not None]
        if not routed:
            return None
        first = np.asarray(routed[0].routed_experts)
        out = np.zeros((len(self.token_ids), *first.shape[1:]), dtype=first.dtype)
        for turn in routed:
            out[turn.start:turn.start + len(turn.token_ids)] = turn.routed_experts
            if turn.context_routed_experts is not None:
                out[turn.context_start:turn.start] = turn.context_routed_experts
        return out


# -- the data-bus schema ----------------------------------------------------------------------

TOKEN_IDS = "token_ids"
LOSS_MASK = "loss_mask"
ROLLOUT_LOGPROBS = "rollout_logprobs"
REWARD = "reward"
TRAINABLE = "trainable"
ADVANTAGE = "advantage"
ROUTED_EXPERTS = "routed_experts"
ROUTES_MASK = "routes_mask"
MEDIA = "media"
TRAJECTORY = "trajectory"
POLICY_TOKENS = "policy_tokens"

TRAIN_FIELDS = (TOKEN_IDS, LOSS_MASK, ROLLOUT_LOGPROBS, ADVANTAGE, MEDIA)
"""What the trainer reads to build a batch (``media`` is None on text-only rows; plus
:data:`ROUTED_EXPERTS` / :data:`ROUTES_MASK` for routing replay)."""
ROUTE_FIELDS = (ROUTED_EXPERTS, ROUTES_MASK)

# per-episode scalars the rollout writes, so that step metrics and overlong shaping read fields, not
# the pickled trajectory (which only the rollout dump reads)
STOP_REASON = "stop_reason"
TURNS = "turns"
RESPONSE_TOKENS = "response_tokens"
LONGEST_REPLY = "longest_reply"
TRUNCATED = "truncated"
CORRECT = "correct"
WELL_FORMED = "well_formed"
FAILED = "failed"
ERROR = "error"
CROSSED_UPDATE_TURNS = "crossed_update_turns"
AUDIO_CLIPS_CUT = "audio_clips_cut"

EPISODE_FIELDS = (REWARD, STOP_REASON, TURNS, RESPONSE_TOKENS, LONGEST_REPLY, TRUNCATED, CORRECT, WELL_FORMED,
                  FAILED, ERROR, CROSSED_UPDATE_TURNS, AUDIO_CLIPS_CUT)
"""What the step metrics read of each row (see :func:`episode_fields`)."""
TRUNCATED_STOPS = (StopReason.LENGTH, StopReason.MAX_TOTAL_TOKENS, StopReason.MAX_SEGMENTS,
                   StopReason.MAX_SAMPLED_TOKENS)
"""Stop reasons of a sample cut by a length limit (the reply's ``max_new_tokens``, the context's
``max_total_tokens``, the episode's ``rollout.context`` caps)."""


def rollout_schema(route_shape: tuple[int, int] | None = None, route_dtype: str = "uint8") -> dict[str, FieldSpec]:
    """The fields of a rollout partition, one row per sample (the row's policy version is the
    bus's own ``versions`` column: the engine version when the sample's group started).

    - ``token_ids`` [T] int64, ``loss_mask`` [T] int8 (1 on policy tokens), ``rollout_logprobs``
      [T] float32 (0 off policy tokens), all ragged;
    - ``reward`` float32 scalar and ``trainable`` bool (the reward is real: status ok, finite,
      no episode error), written by the rollout; ``policy_tokens`` int32 scalar (sampled tokens,
      what the advantage consumer needs of the loss mask);
    - ``advantage`` float32 scalar, written by the advantage consumer once a group is complete;
    - ``routed_experts`` [T, layers, top_k] and ``routes_mask`` [T] bool (MoE routing replay,
      only with ``route_shape=(layers, top_k)``);
    - ``media``: per-sample processor outputs, a :class:`MediaInputs` (object; None for
      text-only samples);
    - the episode's scalars (:func:`episode_fields`): ``stop_reason`` (object: the stop reason's
      value), ``turns``, ``response_tokens`` (sampled over all turns), ``longest_reply`` (tokens of
      the longest assistant reply), ``crossed_update_turns`` int32; ``truncated`` (stopped by a
      length limit) and ``failed`` (not trainable as played: error, failed or non-finite reward)
      bool; ``correct`` (the env's verdict, 0 for a failed episode), ``well_formed``,
      ``audio_clips_cut`` float32; ``error`` (object: the episode's error or None);
    - ``trajectory``: the :class:`Trajectory` as recorded (:meth:`Trajectory.for_records`), read
      only by the rollout dump, the token record and side-branch training.
    """
    schema = {
        TOKEN_IDS: FieldSpec("int64", ragged=True),
        LOSS_MASK: FieldSpec("int8", ragged=True),
        ROLLOUT_LOGPROBS: FieldSpec("float32", ragged=True),
        REWARD: FieldSpec("float32"),
        TRAINABLE: FieldSpec("bool"),
        POLICY_TOKENS: FieldSpec("int32"),
        ADVANTAGE: FieldSpec("float32"),
        MEDIA: FieldSpec("object"),
        TRAJECTORY: FieldSpec("object"),
        STOP_REASON: FieldSpec("object"),
        TURNS: FieldSpec("int32"),
        RESPONSE_TOKENS: FieldSpec("int32"),
        LONGEST_REPLY: FieldSpec("int32"),
        TRUNCATED: FieldSpec("bool"),
        CORRECT: FieldSpec("float32"),
        WELL_FORMED: FieldSpec("float32"),
        FAILED: FieldSpec("bool"),
        ERROR: FieldSpec("object"),
        CROSSED_UPDATE_TURNS: FieldSpec("int32"),
        AUDIO_CLIPS_CUT: FieldSpec("float32"),
    }
    if route_shape is not None:
        schema[ROUTED_EXPERTS] = FieldSpec(route_dtype, tuple(route_shape), ragged=True)
        schema[ROUTES_MASK] = FieldSpec("bool", ragged=True)
    return schema


def route_layout(trajs: Sequence[Trajectory]) -> tuple[tuple[int, ...], str] | None:
    """``((layers, top_k), dtype name)`` of the first recorded routes among ``trajs``; None without routes."""
    for t in trajs:
        for turn in t.turns:
            if turn.routed_experts is not None:
                r = np.asarray(turn.routed_experts)
                return tuple(r.shape[1:]), r.dtype.name
    return None


def episode_fields(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """The per-episode scalar fields of ``trajs`` ([B] each; see :func:`rollout_schema`) and ``reward``
    ([B] float32, 0 for a failed episode): everything the step metrics and overlong shaping need.
    Turns and response tokens count every context of a multi-segment episode."""
    return {
        REWARD: np.asarray([t.reward if t.trainable else 0.0 for t in trajs], dtype=np.float32),
        STOP_REASON: [str(t.stop_reason) for t in trajs],
        TURNS: np.asarray([sum(len(s.turns) for s in t.segments) for t in trajs], dtype=np.int32),
        RESPONSE_TOKENS: np.asarray([sum(len(turn.token_ids) for s in t.segments for turn in s.turns) for t in trajs],
                                    dtype=np.int32),
        LONGEST_REPLY: np.asarray([max((len(turn.token_ids) for s in t.segments for turn in s.turns), default=0)
                                   for t in trajs], dtype=np.int32),
        TRUNCATED: np.asarray([t.stop_reason in TRUNCATED_STOPS for t in trajs], dtype=bool),
        CORRECT: np.asarray([float(t.metrics.get("correct", 0.0)) if t.trainable else 0.0 for t in trajs],
                            dtype=np.float32),
        WELL_FORMED: np.asarray([float(t.metrics.get("well_formed", 0.0)) for t in trajs], dtype=np.float32),
        FAILED: np.asarray([not t.trainable for t in trajs], dtype=bool),
        ERROR: [t.error for t in trajs],
        CROSSED_UPDATE_TURNS: np.asarray([sum(turn.crossed_update for turn in t.turns) for t in trajs], dtype=np.int32),
        AUDIO_CLIPS_CUT: np.asarray([float(t.metrics.get("media/audio_clips_cut", 0.0)) for t in trajs],
                                    dtype=np.float32),
    }


def trajectory_fields(trajs: Sequence[Trajectory], routes: tuple[tuple[int, ...], str] | None = None) -> dict[str, Any]:
    """The rollout fields of ``trajs`` (one row each; see :func:`rollout_schema`), without the
    advantage, which a later consumer writes.

    ``routes``: ``((layers, top_k), dtype)`` (see :func:`route_layout`) adds the routing-replay
    fields; a trajectory without recorded routes gets zeros ``[T, layers, top_k]`` and an
    all-False mask.
    """
    out: dict[str, Any] = {
        TOKEN_IDS: [np.asarray(t.token_ids, dtype=np.int64) for t in trajs],
        LOSS_MASK: [np.asarray(t.loss_mask, dtype=np.int8) for t in trajs],
        ROLLOUT_LOGPROBS: [np.asarray(t.rollout_logprobs, dtype=np.float32) for t in trajs],
        TRAINABLE: np.asarray([t.trainable for t in trajs], dtype=bool),
        POLICY_TOKENS: np.asarray([t.episode_policy_tokens for t in trajs], dtype=np.int32),
        MEDIA: [t.media for t in trajs],
        TRAJECTORY: [t.for_records() for t in trajs],
        **episode_fields(trajs),
    }
    if routes is not None:
        shape, dtype = routes
        out[ROUTED_EXPERTS] = [t.routed_experts if t.routed_experts is not None
                               else np.zeros((len(t.token_ids), *shape), dtype=dtype) for t in trajs]
        out[ROUTES_MASK] = [t.routes_mask for t in trajs]
    return out
