"""Episodes of a multimodal policy: the env driver's turn loop with media on every segment.

The same contract as :mod:`relax_agent.rollout.env_driver` (one :class:`Trajectory` per episode,
failures as data, ``step_timeout_s`` / ``episode_timeout_s`` / ``max_total_tokens``), with a
:class:`~relax_agent.multimodal.render.MediaRenderer` in place of the chat renderer: the prompt
and each observation delta come with the processor outputs of their media, the recorder keeps
them beside the tokens, and every engine call gets the episode's media so far
(``engine.generate(ids, params, media=...)``). An observation whose media cannot be rendered
(a placeholder the template dropped, an undecodable part) ends the episode as a failed record
naming the message. A reply holding a media placeholder token (the engine masks them; another
engine may not) ends it as a failed, masked record with stop reason "policy_error" naming the
token: it never reaches the trainer, whose media batch would refuse it.

Media are decoded and processed in a worker thread (:meth:`MediaRenderer.render_prompt_async`), so
one large image does not stall the other episodes on the event loop. An audio clip cut to the
model's window is logged once per episode (``relax_agent.media`` logger) and counted in the
trajectory's metrics (:data:`AUDIO_CLIPS_CUT`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from relax_agent.envs.tool_env import call_in_thread
from relax_agent.multimodal.render import MediaRenderer
from relax_agent.records import StopReason, Trajectory
from relax_agent.rollout.driver import Deadline, EpisodeSpec
from relax_agent.rollout.env_calls import EnvCalls, check_reset, check_step, close_env, numeric_info, step_timeout_cause
from relax_agent.rollout.parsers import ToolCallParser, decodes_special_tokens
from relax_agent.rollout.recorder import TrajectoryRecorder, failed_episode

AUDIO_CLIPS_CUT = "media/audio_clips_cut"
"""Trajectory metric: audio clips of the episode cut to the model's window (absent when none)."""


class _PolicyError(Exception):
    """The policy sampled what the episode cannot go on with; becomes a "policy_error" record."""


class MediaEnvDriver:
    """Plays each episode in a fresh env with a multimodal policy (a :class:`RolloutDriver`).

    Args:
        make_env: builds a fresh environment per episode.
        engine: an engine whose ``generate`` takes ``media=`` (:class:`~relax_agent.multimodal.engine.MediaEngine`).
        renderer: the media renderer.
        parser: tool-call parser.
    """

    def __init__(self, make_env: Callable[[], Any], engine: Any, renderer: MediaRenderer, parser: ToolCallParser):
        self.make_env = make_env
        self.engine = engine
        self.renderer = renderer
        self.parser = parser

    async def play(self, spec: EpisodeSpec, params: Any) -> Trajectory:
        """Build the env and play ``spec``; a constructor that raises or hangs gives a failed record."""
        deadline = Deadline(spec.episode_timeout_s)
        try:
            env = await deadline.call(call_in_thread(self.make_env), "make_env", spec.step_timeout_s, step_timeout_cause(spec))
        except Exception as exc:  # a broken env constructor is a failed episode, not a crashed run
            return failed_episode(spec, exc, during="make_env")
        rec = TrajectoryRecorder(spec)
        calls = EnvCalls(env, spec, deadline)
        try:
            obs, info = check_reset(await calls.reset(seed=spec.seed, options={"task": spec.task}))
            seg = await self.renderer.render_prompt_async(obs, info.get("tools", ()))
            rec.add_prompt(seg.token_ids, seg.messages, seg.media, seg.notes)
            reward, metrics, stop = await self._turns(rec, calls, spec, params, deadline)
        except _PolicyError as exc:  # the policy's fault, not the env's: masked all the same
            return rec.fail(str(exc), stop=StopReason.POLICY_ERROR)
        except Exception as exc:  # env bugs, timeouts, template and media refusals become data
            return rec.fail_with(exc)
        finally:
            await close_env(env, spec.step_timeout_s)
        if rec.notes:
            metrics = {**metrics, AUDIO_CLIPS_CUT: float(len(rec.notes))}
        return rec.finish(reward, metrics, stop)

    def _placeholders_in(self, token_ids: tuple[int, ...]) -> list[str]:
        """``"<token> (id N) xK"`` for each media placeholder id among sampled ``token_ids``."""
        kinds = self.renderer.family.kind_of_token()
        found = sorted({t for t in token_ids if t in kinds})
        tok = self.renderer.tokenizer
        return [f"{tok.convert_ids_to_tokens(t)} (id {t}) x{token_ids.count(t)}" for t in found]

    async def _turns(self, rec: TrajectoryRecorder, calls: EnvCalls, spec: EpisodeSpec, params: Any,
                     deadline: Deadline) -> tuple[float, dict[str, float], StopReason]:
        reward = 0.0
        metrics: dict[str, float] = {}
        for turn in range(spec.max_turns):
            budget = spec.max_total_tokens - rec.num_tokens
            if budget <= 0:
                return reward, metrics, StopReason.MAX_TOTAL_TOKENS
            seed = params.seed if params.seed is not None else spec.seed * 1009 + turn
            request = replace(params, max_new_tokens=min(params.max_new_tokens, budget), seed=seed)
            gen = await deadline.call(self.engine.generate(list(rec.token_ids), request, media=rec.media),
                                      f"engine.generate (turn {turn + 1})")
            rec.add_turn(gen)
            sampled = self._placeholders_in(gen.token_ids)
            if sampled:
                raise _PolicyError(f"the policy sampled media placeholder token(s) {sampled} in turn {turn + 1}: no "
                                   "media fills them, so the episode cannot be trained on (an engine masks these ids; "
                                   "this one did not)")
            if gen.finish_reason == "length" and rec.num_tokens >= spec.max_total_tokens:
                return reward, metrics, StopReason.MAX_TOTAL_TOKENS
            text = self.renderer.tokenizer.decode(gen.token_ids, skip_special_tokens=not decodes_special_tokens(self.parser))
            action = self.parser.parse(text).message()
            rec.add_messages([{**action, "content": text}])
            new_obs, step_reward, terminated, truncated, step_info = check_step(await calls.step(action))
            reward += step_reward
            metrics.update(numeric_info(step_info))
            rec.add_messages(new_obs)
            if terminated or truncated:
                return reward, metrics, rec.ended(StopReason.TERMINATED if terminated else StopReason.TRUNCATED)
            seg = await self.renderer.observation_delta_async(new_obs, closed=gen.finish_reason != "length",
                                                              calls=action["tool_calls"])
            if rec.num_tokens + len(seg.token_ids) >= spec.max_total_tokens:
                return reward, metrics, StopReason.MAX_TOTAL_TOKENS  # media are never cut: the whole delta or none
            rec.add_context(seg.token_ids, seg.media, seg.notes)
        return reward, metrics, rec.ended(StopReason.MAX_TURNS)
