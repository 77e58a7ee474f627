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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from relax_agent.envs.tool_env import call_in_thread
from relax_agent.records import StopReason, Trajectory
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import Deadline, EpisodeSpec
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams
from relax_agent.rollout.env_calls import EnvCalls, check_reset, check_step, close_env, numeric_info, step_timeout_cause
from relax_agent.rollout.parsers import ToolCallParser, decodes_special_tokens
from relax_agent.rollout.recorder import TrajectoryRecorder, failed_episode


class EnvDriver:
    """Plays each episode in a fresh env built by ``make_env`` (the :class:`RolloutDriver` of env tasks).

    Args:
        make_env: builds a fresh environment per episode (episodes never share one); runs in a
            daemon thread, bounded by ``step_timeout_s``.
        engine: the inference engine; concurrent requests are batched by the engine.
        renderer: chat renderer for prompts and observation deltas.
        parser: tool-call parser.
    """

    def __init__(self, make_env: Callable[[], Any], engine: InferenceEngine, renderer: ChatRenderer,
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


async def run_episode(env: Any, spec: EpisodeSpec, engine: InferenceEngine, renderer: ChatRenderer,
                      parser: ToolCallParser, params: SamplingParams, deadline: Deadline | None = None) -> Trajectory:
    """Play one episode of ``env`` with the policy behind ``engine``, then close ``env``.

    Args:
        deadline: the episode's end; default ``spec.episode_timeout_s`` from now.

    Returns:
        The trajectory; on an env failure, a record with ``error`` set and
        ``reward_status="error"`` (``"timeout"`` past ``step_timeout_s`` or
        ``episode_timeout_s``), masked out of training and counted in metrics. Its
        ``stop_reason`` is "length" when the last response was cut off by ``max_new_tokens``
        (the engine's finish reason), else "terminated", "truncated", "max_turns" or
        "max_total_tokens".
    """
    deadline = deadline or Deadline(spec.episode_timeout_s)
    rec = TrajectoryRecorder(spec)
    calls = EnvCalls(env, spec, deadline)
    try:
        obs, info = check_reset(await calls.reset(seed=spec.seed, options={"task": spec.task}))
        prompt = renderer.render_prompt(obs, info.get("tools", ()))
        rec.add_prompt(prompt.token_ids, prompt.messages)
        reward, metrics, stop = await _play_turns(rec, calls, spec, engine, renderer, parser, params, deadline)
    except Exception as exc:  # env bugs, timeouts and template refusals become data, not crashes
        return rec.fail_with(exc)
    finally:
        await close_env(env, spec.step_timeout_s)
    return rec.finish(reward, metrics, stop)


async def _play_turns(rec: TrajectoryRecorder, calls: EnvCalls, spec: EpisodeSpec, engine: InferenceEngine,
                      renderer: ChatRenderer, parser: ToolCallParser, params: SamplingParams,
                      deadline: Deadline) -> tuple[float, dict[str, float], StopReason]:
    """The turn loop after the prompt: (summed env reward, last numeric info, stop reason)."""
    reward = 0.0
    metrics: dict[str, float] = {}
    for turn in range(spec.max_turns):
        budget = spec.max_total_tokens - rec.num_tokens
        if budget <= 0:
            return reward, metrics, StopReason.MAX_TOTAL_TOKENS
        seed = params.seed if params.seed is not None else spec.seed * 1009 + turn
        request = replace(params, max_new_tokens=min(params.max_new_tokens, budget), seed=seed)
        gen = await deadline.call(engine.generate(list(rec.token_ids), request), f"engine.generate (turn {turn + 1})")
        rec.add_turn(gen)
        if gen.finish_reason == "length" and rec.num_tokens >= spec.max_total_tokens:
            return reward, metrics, StopReason.MAX_TOTAL_TOKENS  # cut by the budget: not an action for the env
        text = renderer.tokenizer.decode(gen.token_ids, skip_special_tokens=not decodes_special_tokens(parser))
        action = parser.parse(text).message()
        rec.add_messages([{**action, "content": text}])
        new_obs, step_reward, terminated, truncated, step_info = check_step(await calls.step(action))
        reward += step_reward
        metrics.update(numeric_info(step_info))
        if isinstance(step_info, dict) and step_info.get("reason") is not None:
            rec.env_reason = str(step_info["reason"])
        rec.add_messages(new_obs)
        if terminated or truncated:
            return reward, metrics, rec.ended(StopReason.TERMINATED if terminated else StopReason.TRUNCATED)
        delta = renderer.observation_delta(new_obs, closed=gen.finish_reason != "length", calls=action["tool_calls"])
        if rec.num_tokens + len(delta) >= spec.max_total_tokens:
            return reward, metrics, StopReason.MAX_TOTAL_TOKENS  # the observation leaves no room for a reply
        rec.add_context(delta)
    return reward, metrics, rec.ended(StopReason.MAX_TURNS)
