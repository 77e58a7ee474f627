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

import inspect
import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from relax_agent.envs.spaces import is_message
from relax_agent.envs.tool_env import call_in_thread
from relax_agent.errors import EnvError
from relax_agent.records import StopReason, Trajectory
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import Deadline, EpisodeSpec, call_within
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams
from relax_agent.rollout.parsers import ToolCallParser
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
                                      _step_cause(spec))
        except Exception as exc:  # a broken env constructor is a failed episode, not a crashed run
            return failed_episode(spec, exc, during="make_env")
        return await run_episode(env, spec, self.engine, self.renderer, self.parser, params, deadline)


def _step_cause(spec: EpisodeSpec) -> str:
    return f"env call exceeded step_timeout_s={spec.step_timeout_s}"


_MAKE_WRAPPERS = frozenset({"TimeLimit", "OrderEnforcing", "PassiveEnvChecker"})
"""Wrappers ``gymnasium.make`` adds; the async path stands in for them (TimeLimit via the spec)."""


@dataclass
class _EnvCalls:
    """How the driver calls one env: its async ``areset``/``astep`` when the env has them (the
    env's own, or the unwrapped env's under ``gymnasium.make``'s standard wrappers), else the
    sync methods in a worker thread; each call bounded by ``step_timeout_s`` and the deadline."""

    env: Any
    spec: EpisodeSpec
    deadline: Deadline
    steps: int = 0

    def __post_init__(self) -> None:
        self.target, self.max_steps = _async_target(self.env)

    async def _call(self, awaitable: Any, what: str) -> Any:
        return await self.deadline.call(awaitable, what, self.spec.step_timeout_s, _step_cause(self.spec))

    async def reset(self, **kwargs: Any) -> Any:
        self.steps = 0
        if self.target is not None:
            return await self._call(self.target.areset(**kwargs), "env.reset")
        return await self._call(call_in_thread(self.env.reset, **kwargs), "env.reset")

    async def step(self, action: dict[str, Any]) -> Any:
        self.steps += 1
        what = f"env.step {self.steps}"
        if self.target is None:
            return await self._call(call_in_thread(self.env.step, action), what)
        out = await self._call(self.target.astep(action), what)
        if self.max_steps is not None and self.steps >= self.max_steps and isinstance(out, tuple) and len(out) == 5:
            obs, reward, terminated, _, info = out
            out = (obs, reward, terminated, True, info)  # what gymnasium's TimeLimit does
        return out


def _async_target(env: Any) -> tuple[Any, int | None]:
    """(object whose ``areset``/``astep`` to await, TimeLimit steps to apply) or (None, None)."""
    def has_async(obj: Any) -> bool:
        return all(inspect.iscoroutinefunction(getattr(obj, name, None)) for name in ("areset", "astep"))

    if has_async(env):
        return env, None
    chain, inner = [], env
    while hasattr(inner, "env") and inner is not getattr(inner, "unwrapped", inner):
        chain.append(type(inner).__name__)
        inner = inner.env
    if inner is env or not has_async(inner) or not set(chain) <= _MAKE_WRAPPERS:
        return None, None
    spec = getattr(env, "spec", None)
    return inner, (spec.max_episode_steps if "TimeLimit" in chain and spec is not None else None)


def _check_reset(out: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if not isinstance(out, tuple) or len(out) != 2:
        raise EnvError(f"env.reset must return (observation, info), got {_shape(out)}")
    obs, info = out
    return _check_messages(obs, "env.reset"), _check_info(info, "env.reset")


def _check_step(out: Any) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
    if not isinstance(out, tuple) or len(out) != 5:
        raise EnvError(f"env.step must return (observation, reward, terminated, truncated, info), got {_shape(out)}")
    obs, reward, terminated, truncated, info = out
    if isinstance(reward, bool) or not isinstance(reward, (int, float, np.number)) or np.ndim(reward) != 0:
        raise EnvError(f"env.step reward must be a number, got {type(reward).__name__} {reward!r}")
    reward = float(reward)
    if not math.isfinite(reward):
        raise EnvError(f"env.step returned a non-finite reward {reward!r}")
    return _check_messages(obs, "env.step"), reward, bool(terminated), bool(truncated), _check_info(info, "env.step")


def _shape(out: Any) -> str:
    return f"{type(out).__name__} of length {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__


def _check_messages(obs: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(obs, (list, tuple)):
        raise EnvError(f"{where} observation must be a list of chat messages, got {type(obs).__name__}")
    for i, msg in enumerate(obs):
        if not is_message(msg):
            raise EnvError(f"{where} observation[{i}] is not an OpenAI-format chat message: {str(msg)[:200]}")
    return list(obs)


def _check_info(info: Any, where: str) -> dict[str, Any]:
    if info is not None and not isinstance(info, dict):
        raise EnvError(f"{where} info must be a dict, got {type(info).__name__}")
    return dict(info or {})


def _numeric(info: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in info.items() if isinstance(v, (int, float, bool)) and not isinstance(v, str)}


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
    calls = _EnvCalls(env, spec, deadline)
    try:
        obs, info = _check_reset(await calls.reset(seed=spec.seed, options={"task": spec.task}))
        prompt = renderer.render_prompt(obs, info.get("tools", ()))
        rec.add_prompt(prompt.token_ids, prompt.messages)
        reward, metrics, stop = await _play_turns(rec, calls, spec, engine, renderer, parser, params, deadline)
    except Exception as exc:  # env bugs, timeouts and template refusals become data, not crashes
        return rec.fail_with(exc)
    finally:
        await _close(env, spec.step_timeout_s)
    return rec.finish(reward, metrics, stop)


async def _play_turns(rec: TrajectoryRecorder, calls: _EnvCalls, spec: EpisodeSpec, engine: InferenceEngine,
                      renderer: ChatRenderer, parser: ToolCallParser, params: SamplingParams,
                      deadline: Deadline) -> tuple[float, dict[str, float], StopReason]:
    """The turn loop after the prompt: (summed env reward, last numeric info, stop reason)."""
    reward, metrics = 0.0, {}
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
        text = renderer.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        action = parser.parse(text).message()
        rec.add_messages([{**action, "content": text}])
        new_obs, step_reward, terminated, truncated, step_info = _check_step(await calls.step(action))
        reward += step_reward
        metrics.update(_numeric(step_info))
        rec.add_messages(new_obs)
        if terminated or truncated:
            return reward, metrics, _ended(rec, StopReason.TERMINATED if terminated else StopReason.TRUNCATED)
        delta = renderer.observation_delta(new_obs, closed=gen.finish_reason != "length")
        if rec.num_tokens + len(delta) >= spec.max_total_tokens:
            return reward, metrics, StopReason.MAX_TOTAL_TOKENS  # the observation leaves no room for a reply
        rec.add_context(delta)
    return reward, metrics, _ended(rec, StopReason.MAX_TURNS)


def _ended(rec: TrajectoryRecorder, stop: StopReason) -> StopReason:
    """``stop``, or "length" when the last response was cut off by ``max_new_tokens``."""
    return StopReason.LENGTH if rec.turns and rec.turns[-1].finish_reason == "length" else stop


async def _close(env: Any, timeout_s: float) -> None:
    try:
        await call_within(call_in_thread(env.close), timeout_s, "env.close")
    except Exception:  # closing must never mask the episode's own outcome (a hung close is abandoned)
        pass
