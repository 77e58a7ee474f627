"""The one place a :class:`~relax_agent.records.Trajectory` is built, finished or failed.

A driver feeds the recorder the rendered prompt, each sampled turn exactly as the engine
returned it, and each observation's token delta; :meth:`TrajectoryRecorder.finish` makes the
record of a played episode, :meth:`TrajectoryRecorder.fail` the failed record of one that
could not be played (the tokens so far are kept for inspection).

Media episodes (a multimodal policy) hand the prompt and each observation delta with their media
(:class:`~relax_agent.records.MediaInputs`) and the processor's notes: the recorder keeps them beside
the tokens, in placeholder order, and the record's ``media`` is their concatenation. A text
episode records none, and its record's ``media`` is None.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from typing import Any

from relax_agent.records import MediaInputs, RewardStatus, StopReason, Trajectory, Turn
from relax_agent.rollout.driver import EpisodeSpec, EpisodeTimeout
from relax_agent.rollout.engines.base import Generation

log = logging.getLogger("relax_agent.media")


class TrajectoryRecorder:
    """Accumulates the token stream and messages of one episode.

    Args:
        spec: the episode (its ids go on the record).
    """

    def __init__(self, spec: EpisodeSpec):
        self.spec = spec
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[Turn] = []
        self.messages: list[dict[str, Any]] = []
        self.env_reason: str | None = None
        """The env's latest ``info["reason"]`` (set by the driver after each step)."""
        self.segments: list[MediaInputs] = []
        """The media of each recorded segment that has any, in token order."""
        self.notes: list[str] = []
        """One line per change the media processor made to a part (an audio clip cut), in order."""

    @property
    def num_tokens(self) -> int:
        """Tokens recorded so far (prompt, turns and observation deltas)."""
        return len(self.token_ids)

    @property
    def media(self) -> MediaInputs | None:
        """The media of every recorded segment so far, in placeholder order (None without media)."""
        return MediaInputs.concat(self.segments)

    def add_prompt(self, token_ids: Sequence[int], messages: Sequence[dict[str, Any]],
                   media: MediaInputs | None = None, notes: Sequence[str] = ()) -> None:
        """The rendered prompt: [P] token ids (masked out) and the messages it renders; with its
        media and the processor's notes (see :meth:`add_context`)."""
        self.add_context(token_ids, media, notes)
        self.messages.extend(messages)

    def add_turn(self, gen: Generation, opening: int = 0, closed: bool | None = None) -> None:
        """One sampled turn: its [n] token ids (masked in), log-probs, versions and routes, as generated
        (per-token versions are kept only when a weight update landed inside the turn). With the
        prefill's routes (``gen.prompt_routed_experts``, for a prompt that was the whole stream so
        far) the turn keeps those of the context tokens no earlier turn routed.

        The turn's assistant message is the next one added (:attr:`Turn.message_index`);
        ``opening``: forced context tokens just added before it; ``closed``: see :attr:`Turn.closed`."""
        versions = gen.token_versions if len(set(gen.token_versions)) > 1 else ()
        start = len(self.token_ids)
        self.turns.append(Turn(start, gen.token_ids, gen.logprobs, gen.policy_version,
                               gen.finish_reason, gen.routed_experts, versions, self._context_routes(gen, start),
                               len(self.messages), opening, closed))
        self.token_ids += gen.token_ids
        self.loss_mask += [1] * len(gen.token_ids)
        self.logprobs += list(gen.logprobs)

    def _context_routes(self, gen: Generation, start: int) -> Any:
        """[d, layers, top_k] prefill routes of tokens ``start - d .. start - 1`` not routed before; None without."""
        if gen.prompt_routed_experts is None:
            return None
        assert len(gen.prompt_routed_experts) == start - 1, "the prompt was the episode's stream so far"
        last = self.turns[-1] if self.turns else None
        covered = last.start + len(last.token_ids) if last is not None else 1  # token 0: no position scores it
        return gen.prompt_routed_experts[covered - 1:] if covered < start else None

    def add_context(self, token_ids: Sequence[int], media: MediaInputs | None = None,
                    notes: Sequence[str] = ()) -> None:
        """[d] tokens the policy did not sample (an observation delta): masked out, log-prob 0.

        ``media``: the items whose placeholders ``token_ids`` hold (None: none); ``notes``: the
        processor's changes to them (the episode's first is logged on the ``relax_agent.media``
        logger; all are kept in :attr:`notes`)."""
        self.token_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        if media is not None:
            self.segments.append(media)
        if notes and not self.notes:  # once per episode: the first cut, and how many in all in the metrics
            log.warning("episode %s: %s", self.spec.sample_id, notes[0])
        self.notes += notes

    def add_messages(self, messages: Sequence[dict[str, Any]]) -> None:
        """Messages of the conversation (the assistant's, the env's) for logs and rewards."""
        self.messages.extend(messages)

    def ended(self, stop: StopReason) -> StopReason:
        """``stop``, or "length" when the last response was cut off by ``max_new_tokens``."""
        return StopReason.LENGTH if self.turns and self.turns[-1].finish_reason == "length" else stop

    def finish(self, reward: float, metrics: dict[str, float], stop: StopReason) -> Trajectory:
        """The record of a played episode."""
        return self.record(reward=reward, metrics=metrics, stop_reason=stop, env_reason=self.env_reason)

    def fail(self, cause: str, status: RewardStatus = RewardStatus.ERROR,
             stop: StopReason = StopReason.ENV_ERROR) -> Trajectory:
        """The failed record: reward 0 with ``status`` (masked out of training), ``error=cause``;
        ``stop`` says who failed ("env_error", or "policy_error" for what the policy sampled)."""
        return self.record(reward=0.0, reward_status=status, stop_reason=stop, error=cause)

    def fail_with(self, exc: BaseException, during: str = "") -> Trajectory:
        """:meth:`fail` for an exception: timeouts get status "timeout", the rest "error";
        the cause is :func:`failure_cause`, prefixed by ``during`` (e.g. ``"make_env"``)."""
        cause = failure_cause(exc)
        status = RewardStatus.TIMEOUT if isinstance(exc, EpisodeTimeout) else RewardStatus.ERROR
        return self.fail(f"{during}: {cause}" if during else cause, status)

    def record(self, **fields: Any) -> Trajectory:
        """The record of the tokens, turns and messages so far with ``fields`` (reward, status, stop reason...)."""
        return Trajectory(
            sample_id=self.spec.sample_id, group_id=self.spec.group_id, task_id=self.spec.task_id,
            token_ids=tuple(self.token_ids), loss_mask=tuple(self.loss_mask), rollout_logprobs=tuple(self.logprobs),
            prompt_len=self.turns[0].start if self.turns else len(self.token_ids), turns=tuple(self.turns),
            messages=tuple(self.messages), media=self.media, **fields,
        )


_OWN_FILES = ("relax_agent/rollout/",)


def failure_cause(exc: BaseException) -> str:
    """What went wrong, for a failed record: a timeout's own message, else
    ``"{Type}: {message} at {file}:{line}"`` of the innermost frame (no place when that frame is
    the rollout package's own: the message says it all)."""
    if isinstance(exc, EpisodeTimeout):
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    frame = frames[-1] if frames else None
    own = frame is not None and any(part in frame.filename.replace("\\", "/") for part in _OWN_FILES)
    where = f" at {frame.filename}:{frame.lineno}" if frame and not own else ""
    return f"{type(exc).__name__}: {exc}{where}"


def failed_episode(spec: EpisodeSpec, exc: BaseException, during: str = "") -> Trajectory:
    """The failed record of an episode that could not start (e.g. ``make_env`` raised);
    ``during`` names the call that failed and prefixes the cause."""
    return TrajectoryRecorder(spec).fail_with(exc, during)

