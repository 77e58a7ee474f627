"""The env-driven rollout driver: env <-> policy multi-turn episodes, recorded token-in/token-out.

One :func:`run_episode` call plays one episode to the end and always returns a
:class:`Trajectory`: a crash in the environment becomes a failed-episode record carrying
its cause (``error``), never an exception that kills the group and never a dropped sample.
Envs with ``async def areset/astep`` are awaited on the event loop; synchronous envs run in a
daemon thread per call, so one slow tool never blocks other episodes and a call that hangs past
``step_timeout_s`` is abandoned (a failed record with reward status "timeout") without holding
up the run's shutdown. The whole episode, engine calls included, ends by ``episode_timeout_s``;
a call still running then is cancelled and abandoned, and the episode is a timed-out record
(an async env that ignores its cancellation cannot turn it back into a rewarded one).

Budget: ``max_total_tokens`` is checked before every engine call (the reply may use only what
is left) and before every env step (a reply cut by the budget is not sent to the env); an
observation that does not fit ends the episode with stop reason "max_total_tokens".

Media episodes (a multimodal policy) take the same loop: with a media renderer (a
:class:`MediaRendering`, :class:`~relax_agent.multimodal.render.MediaRenderer`) the prompt and each
observation delta come with the processor outputs of their media, processed in a worker thread so
one large image does not stall the other episodes on the event loop; the recorder keeps them beside
the tokens, and every engine call gets the episode's media so far
(``engine.generate(ids, params, media=...)``; a text episode's engine is called without ``media``).
An observation whose media cannot be rendered (a placeholder the template dropped, an undecodable
part) ends the episode as a failed record naming the message. A reply holding a media placeholder
token (an engine masks them; another may not) ends it as a failed, masked record with stop reason
"policy_error" naming the token: it never reaches the trainer, whose forward would refuse it. An
audio clip cut to the model's window is logged once per episode (``relax_agent.media`` logger) and
counted in the trajectory's metrics (:data:`AUDIO_CLIPS_CUT`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from relax_agent.envs.tool_env import call_in_thread
from relax_agent.records import StopReason, Trajectory
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.context import Episode, needs_new_context, open_context, summarise, turn_spans
from relax_agent.rollout.driver import Deadline, EpisodeSpec
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams
from relax_agent.rollout.env_calls import EnvCalls, check_reset, check_step, close_env, numeric_info, step_timeout_cause
from relax_agent.rollout.parsers import ToolCallParser, decodes_special_tokens, parse_reply
from relax_agent.rollout.recorder import TrajectoryRecorder, failed_episode

if TYPE_CHECKING:
    from relax_agent.multimodal.render import MediaSegment

AUDIO_CLIPS_CUT = "media/audio_clips_cut"
"""Trajectory metric: audio clips of the episode cut to the model's window (absent when none)."""


@runtime_checkable
class MediaRendering(Protocol):
    """A renderer whose prompts and observation deltas carry media
    (:class:`~relax_agent.multimodal.render.MediaRenderer`): the driver records their media and
    sends them to the engine.

    Attributes:
        tokenizer: decodes sampled turns.
        family: the policy's :class:`~relax_agent.multimodal.processor.MediaFamily` (its placeholder token ids).
    """

    tokenizer: Any
    family: Any

    async def render_prompt_async(self, messages: Sequence[dict[str, Any]],
                                  tools: Sequence[dict[str, Any]] = ()) -> MediaSegment:
        """The opening messages rendered, media expanded and processed."""
        ...

    async def observation_delta_async(self, new_messages: Sequence[dict[str, Any]], closed: bool = True,
                                      calls: Sequence[dict[str, Any]] = ()) -> MediaSegment:
        """The delta after a sampled turn, media expanded and processed."""
        ...


class _PolicyError(Exception):
    """The policy sampled what the episode cannot go on with; becomes a "policy_error" record."""


class EnvDriver:
    """Plays each episode in a fresh env built by ``make_env`` (the :class:`RolloutDriver` of env tasks).

    Args:
        make_env: builds a fresh environment per episode (episodes never share one); runs in a
            daemon thread, bounded by ``step_timeout_s``.
        engine: the inference engine; concurrent requests are batched by the engine (with a media
            renderer, one whose ``generate`` takes ``media=``).
        renderer: chat renderer for prompts and observation deltas, or a media renderer
            (:class:`MediaRendering`) for a multimodal policy.
        parser: tool-call parser.
    """

    def __init__(self, make_env: Callable[[], Any], engine: InferenceEngine, renderer: ChatRenderer | MediaRendering,
                 parser: ToolCallParser):
        self.make_env = make_env
        self.engine = engine
        self.renderer = renderer
        self.parser = parser

    async def play(self, spec: EpisodeSpec, params: SamplingParams) -> Trajectory:
        """Build the env and play ``spec`` in it; a constructor that raises or hangs gives a failed
        record whose cause starts with ``"make_env: "``."""
        deadline = Deadline(spec.episode_timeout_s)
        try:
            env = await deadline.call(call_in_thread(self.make_env), "make_env", spec.step_timeout_s,
                                      step_timeout_cause(spec))
        except Exception as exc:  # a broken env constructor is a failed episode, not a crashed run
            return failed_episode(spec, exc, during="make_env")
        return await run_episode(env, spec, self.engine, self.renderer, self.parser, params, deadline)


async def run_episode(env: Any, spec: EpisodeSpec, engine: InferenceEngine, renderer: ChatRenderer | MediaRendering,
                      parser: ToolCallParser, params: SamplingParams, deadline: Deadline | None = None) -> Trajectory:
    """Play one episode of ``env`` with the policy behind ``engine``, then close ``env``.

    Args:
        renderer: a chat renderer, or a media renderer (:class:`MediaRendering`): the episode's
            media are recorded and sent to ``engine`` (see the module docstring).
        deadline: the episode's end; default ``spec.episode_timeout_s`` from now.

    Returns:
        The trajectory; on an env failure, a record with ``error`` set and
        ``reward_status="error"`` (``"timeout"`` past ``step_timeout_s`` or
        ``episode_timeout_s``), masked out of training and counted in metrics. Its
        ``stop_reason`` is "length" when the last response was cut off by ``max_new_tokens``
        (the engine's finish reason), else "terminated", "truncated", "max_turns" or
        "max_total_tokens"; a media placeholder token in a reply gives a failed record with stop
        reason "policy_error". With audio clips cut to the model's window, the metrics count them
        (:data:`AUDIO_CLIPS_CUT`).
    """
    deadline = deadline or Deadline(spec.episode_timeout_s)
    ep = Episode(spec)
    calls = EnvCalls(env, spec, deadline)
    try:
        obs, info = check_reset(await calls.reset(seed=spec.seed, options={"task": spec.task}))
        ep.opening, ep.tools = list(obs), list(info.get("tools", ()))
        if isinstance(renderer, MediaRendering):  # media processed in a worker thread
            seg = await renderer.render_prompt_async(obs, info.get("tools", ()))
            ep.rec.add_prompt(seg.token_ids, seg.messages, seg.media, seg.notes)
        else:
            prompt = renderer.render_prompt(obs, info.get("tools", ()))
            ep.rec.add_prompt(prompt.token_ids, prompt.messages)
        reward, metrics, stop = await _play_turns(ep, calls, spec, engine, renderer, parser, params, deadline)
    except _PolicyError as exc:  # the policy's fault, not the env's: masked all the same
        return ep.finish(ep.rec.fail(str(exc), stop=StopReason.POLICY_ERROR))
    except Exception as exc:  # env bugs, timeouts, template and media refusals become data, not crashes
        return ep.finish(ep.rec.fail_with(exc))
    finally:
        await close_env(env, spec.step_timeout_s)
    if ep.rec.notes:
        metrics = {**metrics, AUDIO_CLIPS_CUT: float(len(ep.rec.notes))}
    return ep.finish(ep.rec.finish(reward, metrics, stop))


def _generate(engine: Any, token_ids: list[int], request: SamplingParams, rec: TrajectoryRecorder) -> Any:
    """``engine.generate``'s awaitable; with the episode's media so far when it has any (a text
    episode's engine is called exactly as a text engine expects)."""
    media = rec.media
    return engine.generate(token_ids, request) if media is None else engine.generate(token_ids, request, media=media)


def _placeholders_in(renderer: MediaRendering, token_ids: tuple[int, ...]) -> list[str]:
    """``"<token> (id N) xK"`` for each media placeholder id among sampled ``token_ids``."""
    kinds = renderer.family.kind_of_token()
    found = sorted({t for t in token_ids if t in kinds})
    tok = renderer.tokenizer
    return [f"{tok.convert_ids_to_tokens(t)} (id {t}) x{token_ids.count(t)}" for t in found]


async def _observation(renderer: ChatRenderer | MediaRendering, new_obs: Any, closed: bool,
                       calls: Any) -> tuple[Sequence[int], Any, Sequence[str]]:
    """(delta token ids [d], their media or None, the processor's notes) of an observation."""
    if isinstance(renderer, MediaRendering):
        seg = await renderer.observation_delta_async(new_obs, closed=closed, calls=calls)
        return seg.token_ids, seg.media, seg.notes
    return renderer.observation_delta(new_obs, closed=closed, calls=calls), None, ()


async def _play_turns(ep: Episode, calls: EnvCalls, spec: EpisodeSpec, engine: InferenceEngine,
                      renderer: ChatRenderer | MediaRendering, parser: ToolCallParser, params: SamplingParams,
                      deadline: Deadline) -> tuple[float, dict[str, float], StopReason]:
    """The turn loop after the prompt: (summed env reward, last numeric info, stop reason). With
    ``spec.context`` (``rollout.context``) a full context is followed by a new one (:mod:`relax_agent.rollout.context`).

    Raises:
        _PolicyError: a media policy's reply holds a media placeholder token.
    """
    media_renderer = renderer if isinstance(renderer, MediaRendering) else None
    reward = 0.0
    metrics: dict[str, float] = {}
    for turn in range(spec.max_turns):
        rec = ep.rec
        budget = spec.max_total_tokens - rec.num_tokens
        if budget <= 0:
            return reward, metrics, StopReason.MAX_TOTAL_TOKENS
        cap = spec.context.max_sampled_tokens if spec.context is not None else None
        if cap is not None:
            if ep.sampled_tokens >= cap:
                return reward, metrics, StopReason.MAX_SAMPLED_TOKENS
            budget = min(budget, cap - ep.sampled_tokens)
        seed = params.seed if params.seed is not None else spec.seed * 1009 + turn
        request = replace(params, max_new_tokens=min(params.max_new_tokens, budget), seed=seed)
        gen = await deadline.call(_generate(engine, list(rec.token_ids), request, rec),
                                  f"engine.generate (turn {turn + 1})")
        rec.add_turn(gen)
        sampled = _placeholders_in(media_renderer, gen.token_ids) if media_renderer is not None else []
        if sampled:
            raise _PolicyError(f"the policy sampled media placeholder token(s) {sampled} in turn {turn + 1}: no "
                               "media fills them, so the episode cannot be trained on (an engine masks these ids; "
                               "this one did not)")
        if gen.finish_reason == "length" and rec.num_tokens >= spec.max_total_tokens:
            return reward, metrics, StopReason.MAX_TOTAL_TOKENS  # cut by the budget: not an action for the env
        if gen.finish_reason == "length" and cap is not None and ep.sampled_tokens >= cap:
            return reward, metrics, StopReason.MAX_SAMPLED_TOKENS  # cut by the episode's budget
        text = renderer.tokenizer.decode(gen.token_ids, skip_special_tokens=not decodes_special_tokens(parser))
        action = parse_reply(parser, text, ep.tools).message()
        rec.add_messages([{**action, "content": text}])
        new_obs, step_reward, terminated, truncated, step_info = check_step(await calls.step(action))
        reward += step_reward
        metrics.update(numeric_info(step_info))
        if isinstance(step_info, dict) and step_info.get("reason") is not None:
            rec.env_reason = str(step_info["reason"])
        rec.add_messages(new_obs)
        if terminated or truncated:
            return reward, metrics, rec.ended(StopReason.TERMINATED if terminated else StopReason.TRUNCATED)
        closed = gen.finish_reason != "length"
        delta, media, notes = await _observation(renderer, new_obs, closed, action["tool_calls"])
        if await _context_full(ep, spec, renderer, parser, engine, params, deadline, new_obs, delta, closed,
                               action["tool_calls"]):
            if ep.rec is rec:  # no new context: the episode ends here
                return reward, metrics, ep.stop or StopReason.MAX_TOTAL_TOKENS
            continue
        if rec.num_tokens + len(delta) >= spec.max_total_tokens:
            return reward, metrics, StopReason.MAX_TOTAL_TOKENS  # no room for a reply (media are never cut)
        rec.add_context(delta, media, notes)
    return reward, metrics, ep.rec.ended(StopReason.MAX_TURNS)


async def _context_full(ep: Episode, spec: EpisodeSpec, renderer: Any, parser: ToolCallParser, engine: InferenceEngine,
                        params: SamplingParams, deadline: Deadline, pending: Any, delta: Sequence[int], closed: bool,
                        calls: Any) -> bool:
    """False while the pending observation and a reply fit the context (or ``rollout.context`` is
    ``truncate``); else True, with the next context started (``ep.rec`` is a new recorder) or, when none can
    be, ``ep.stop`` set and the context left as it is."""
    cfg = spec.context
    rec = ep.rec
    reserve = cfg.summary_max_tokens + ep.instruction_tokens(renderer) if cfg is not None and cfg.policy == "compact" else 0
    if not needs_new_context(cfg, rec, len(delta), spec.max_total_tokens, params.max_new_tokens, reserve):
        return False
    if ep.num_segments >= cfg.max_segments:
        ep.stop = StopReason.MAX_SEGMENTS
        return True
    spans, old_messages = turn_spans(rec), list(rec.messages)
    summary, shown = None, True
    if cfg.policy == "compact":
        summary, shown, why = await summarise(ep, cfg, engine, renderer, parser, params, pending, closed, calls,
                                              spec.max_total_tokens, deadline.call)
        if summary is None:
            rec.env_reason = f"rollout.context: {why}"
            return True
    why = open_context(ep, cfg, renderer, spans, old_messages, delta, summary, shown, spec.max_total_tokens,
                       params.max_new_tokens + reserve)  # compact: room for the next summary request too
    if why:
        ep.stop, rec.env_reason = StopReason.MAX_TOTAL_TOKENS, f"rollout.context: {why}"
    else:
        ep.rec.env_reason = rec.env_reason
    return True
