"""Episodes longer than one context: where a new context starts and what it holds (``rollout.context``).

An env-driven episode records its token stream in a :class:`~relax_agent.rollout.recorder.TrajectoryRecorder`.
With ``policy: truncate`` an episode whose context is full ends (stop reason "max_total_tokens"). With
``drop_oldest`` or ``compact`` it goes on in a new context (a *segment*), and the episode becomes a list of
contexts: :class:`Episode` keeps them, and the finished :class:`~relax_agent.records.Trajectory` is the last one
with the earlier ones as its ``context_segments``.

A new context starts when the next observation and a whole reply (``rollout.max_new_tokens``; for
``compact`` and room after it for the summary request) would not fit in ``rollout.max_total_tokens``. It is rendered as:

- the task's opening messages (the env's reset observation, with the system prompt and tools), rendered
  again with the generation prompt; for ``compact`` followed by a user message holding the summary;
- the latest whole turns that fit, copied token for token from the old context (each turn's sampled tokens
  and the observation delta after it: an assistant turn and its tool results are never split, and the
  tokens are those the policy saw), masked out (they trained in the old context);
- the pending observation's delta, then the policy samples the next reply.

``compact`` first asks the policy for a summary in the old context: the observation and the instruction
(``rollout.context.instruction``) are appended and a reply of at most ``summary_max_tokens`` is sampled; it
is a turn of the old context and trains with the episode like any other. An empty summary, one cut at its
cap, or one holding a tool call ends the episode (stop reason "summary_failed", ``env_reason`` says which),
with the reward so far: a recorded failure the policy is trained on, never a crash.

Peers: slime trains fan-out samples; prime-rl / verifiers train multi-trace episodes with auto-compaction;
Relax exports multi-context episodes; rLLM turns compaction off in training. Here every sampled token of
every context (the summaries included) trains once with the episode's advantage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from relax_agent.records import StopReason, Trajectory
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.parsers import decodes_special_tokens
from relax_agent.rollout.recorder import TrajectoryRecorder

SEGMENTS = "context/segments"
"""Trajectory metric: contexts the episode used (absent for an episode of one)."""
SUMMARIES = "context/summaries"
"""Trajectory metric: summaries the policy wrote (``compact``)."""


class Episode:
    """The contexts of one episode, the last one current.

    Args:
        spec: the episode; earlier contexts get sample ids ``{sample_id}/ctx{k}``.
        opening: the env's reset observation (the task's opening messages, before rendering).
        tools: the tools the env offered at reset.
    """

    def __init__(self, spec: EpisodeSpec, opening: Sequence[dict[str, Any]] = (), tools: Sequence[dict[str, Any]] = ()):
        self.spec = spec
        self.opening = list(opening)
        self.tools = list(tools)
        self.rec = TrajectoryRecorder(spec)
        self.earlier: list[TrajectoryRecorder] = []
        self.summaries = 0
        self.stop: StopReason | None = None
        """Why the episode ends at a full context when no new one could start (set by the driver)."""
        self._instruction_tokens: int | None = None

    def instruction_tokens(self, renderer: Any) -> int:
        """Tokens of ``compact``'s summary request after a turn (measured once per episode)."""
        if self._instruction_tokens is None:
            cfg = self.spec.context
            ask = [{"role": "user", "content": cfg.instruction if cfg is not None else ""}]
            self._instruction_tokens = len(renderer.observation_delta(ask, closed=False))
        return self._instruction_tokens

    @property
    def num_segments(self) -> int:
        """Contexts so far, the current one included."""
        return len(self.earlier) + 1

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy sampled over every context so far."""
        return sum(sum(r.loss_mask) for r in (*self.earlier, self.rec))

    def start_segment(self) -> TrajectoryRecorder:
        """Close the current context (its sample id becomes ``{sample_id}/ctx{k}``) and start an empty one."""
        old = self.rec
        old.spec = dataclasses.replace(self.spec, sample_id=f"{self.spec.sample_id}/ctx{len(self.earlier)}")
        self.earlier.append(old)
        self.rec = TrajectoryRecorder(self.spec)
        return old

    def finish(self, traj: Trajectory) -> Trajectory:
        """``traj`` (the current context's record) with the earlier contexts attached: each with the
        episode's reward, reward status, error and metrics, stop reason "context"."""
        if not self.earlier:
            return traj
        metrics = {**traj.metrics, SEGMENTS: float(self.num_segments)}
        if self.summaries:
            metrics[SUMMARIES] = float(self.summaries)
        earlier = tuple(dataclasses.replace(r.record(reward=traj.reward, reward_status=traj.reward_status,
                                                     error=traj.error, metrics=metrics, stop_reason=StopReason.CONTEXT))
                        for r in self.earlier)
        return dataclasses.replace(traj, metrics=metrics, context_segments=earlier)


def turn_spans(rec: TrajectoryRecorder) -> list[tuple[int, int, int]]:
    """[(token start, token end, first message index)] of each whole turn of ``rec``: a turn's sampled tokens
    with the observation delta after it (the last turn ends with its sampled tokens) and its messages (its
    assistant message and the env's after it)."""
    out = []
    for k, turn in enumerate(rec.turns):
        end = rec.turns[k + 1].start - rec.turns[k + 1].opening if k + 1 < len(rec.turns) else turn.start + len(turn.token_ids)
        assert turn.message_index is not None, "the env driver records each turn's assistant message"
        out.append((turn.start - turn.opening, end, turn.message_index))
    return out


def kept_turns(spans: Sequence[tuple[int, int, int]], room: int, most: int | None = None) -> int:
    """Index of the first turn of the longest tail of ``spans`` whose tokens fit in ``room`` (at most
    ``most`` turns; None: any number); ``len(spans)`` when not even the last turn fits."""
    first = len(spans)
    used = 0
    for k in range(len(spans) - 1, -1, -1):
        if most is not None and len(spans) - k > most:
            break
        used += spans[k][1] - spans[k][0]
        if used > room:
            break
        first = k
    return first


def needs_new_context(cfg: Any, rec: TrajectoryRecorder, delta_len: int, max_total_tokens: int, max_new_tokens: int,
                      reserve: int = 0) -> bool:
    """Whether the pending observation (``delta_len`` tokens) and a whole reply, and for ``compact`` after it
    the summary request (``reserve`` tokens), no longer fit in the current context. Always False for
    ``truncate``."""
    if cfg is None or cfg.policy == "truncate":
        return False
    return rec.num_tokens + delta_len + max_new_tokens + reserve > max_total_tokens


async def summarise(ep: Episode, cfg: Any, engine: Any, renderer: Any, parser: Any, params: Any,
                    pending: Sequence[dict[str, Any]], closed: bool, calls: Sequence[dict[str, Any]],
                    max_total_tokens: int, call: Any) -> tuple[str | None, bool, str]:
    """``compact``: ask the policy for its summary in the current context; returns (summary or None, whether
    the pending observation was shown before the request, why it failed: "" on success).

    The observation ``pending`` and the instruction are appended to the context (the instruction alone when
    both leave less than ``summary_max_tokens``: the observation then opens the new context after its turn) and the summary is sampled as
    a turn of it (``call(awaitable, what)`` runs the engine call under the episode's deadline). On failure
    ``ep.stop`` says how the episode ends: "max_total_tokens" when not even the request fits, else
    "summary_failed"."""
    rec = ep.rec
    instruction = {"role": "user", "content": cfg.instruction}
    options = []  # (request, its delta, tokens left for the summary): with the observation first
    for ask in ([*pending, instruction], [instruction]):
        delta = renderer.observation_delta(ask, closed=closed, calls=calls)
        options.append((ask, delta, max_total_tokens - rec.num_tokens - len(delta)))
    ask, delta, left = next((o for o in options if o[2] >= cfg.summary_max_tokens), max(options, key=lambda o: o[2]))
    if left < 1:
        ep.stop = StopReason.MAX_TOTAL_TOKENS
        return None, False, (f"the summary request ({len(delta)} tokens) does not fit in the "
                             f"{max_total_tokens - rec.num_tokens} tokens left of the context")
    shown = len(ask) > 1
    if not shown:  # the turn's results are not in this context: its messages end at the turn
        del rec.messages[len(rec.messages) - len(pending):]
    rec.add_messages([instruction])
    rec.add_context(delta)
    request = dataclasses.replace(params, max_new_tokens=min(cfg.summary_max_tokens, left))
    gen = await call(engine.generate(list(rec.token_ids), request), f"engine.generate (summary {ep.summaries + 1})")
    rec.add_turn(gen)
    text = renderer.tokenizer.decode(gen.token_ids, skip_special_tokens=not decodes_special_tokens(parser))
    rec.add_messages([{"role": "assistant", "content": text}])
    ep.summaries += 1
    parsed = parser.parse(text)
    why = ""
    if gen.finish_reason == "length":
        why = f"the summary was cut at {request.max_new_tokens} tokens (rollout.context.summary_max_tokens)"
    elif parsed.tool_calls:
        why = f"the summary holds a tool call ({parsed.tool_calls[0].get('function', {}).get('name', '?')!r})"
    elif not parsed.content.strip():
        why = "the summary is empty"
    if why:
        ep.stop = StopReason.SUMMARY_FAILED
        return None, shown, why
    return parsed.content.strip(), shown, ""


def open_context(ep: Episode, cfg: Any, renderer: Any, spans: Sequence[tuple[int, int, int]],
                 old_messages: Sequence[dict[str, Any]], pending_delta: Sequence[int], summary: str | None,
                 summarised_pending: bool, max_total_tokens: int, max_new_tokens: int) -> str:
    """Start the episode's next context (see the module doc); returns "" or why none fits.

    Args:
        spans: :func:`turn_spans` of the current context before any summary request.
        old_messages: the current context's messages up to and including the pending observation.
        pending_delta: [d] the pending observation's tokens after the last turn.
        summary: ``compact``'s summary (None: ``drop_oldest``).
        summarised_pending: the summary was written after the pending observation (else the last turn
            and its observation must be kept).
        max_new_tokens: room the new context must leave after the pending observation (a reply; for
            ``compact`` at least the next summary request).
    """
    old = ep.rec
    opening = list(ep.opening)
    if summary is not None:
        opening.append({"role": "user", "content": cfg.summary_prefix + summary})
    prompt = renderer.render_prompt(opening, ep.tools)
    room = max_total_tokens - len(prompt.token_ids) - len(pending_delta) - max_new_tokens
    most = cfg.keep_last_turns if summary is not None else None
    first = kept_turns(spans, room, most if summarised_pending or most is None else max(most, 1))
    if first == len(spans) and (summary is None or not summarised_pending):
        return (f"the opening messages ({len(prompt.token_ids)} tokens), the last turn and its observation do not fit "
                f"in rollout.max_total_tokens={max_total_tokens} with a reply of {max_new_tokens}")
    if first == len(spans) and len(prompt.token_ids) + max_new_tokens > max_total_tokens:
        return (f"the opening messages and the summary ({len(prompt.token_ids)} tokens) leave no room for a reply of "
                f"{max_new_tokens} in rollout.max_total_tokens={max_total_tokens}")
    ep.start_segment()
    ep.rec.add_prompt(prompt.token_ids, prompt.messages)
    if first < len(spans):  # whole turns, token for token as the policy saw them, then the pending observation
        ep.rec.add_context(old.token_ids[spans[first][0]:spans[-1][1]])
        ep.rec.add_messages(old_messages[spans[first][2]:])
        ep.rec.add_context(pending_delta)
    return ""
