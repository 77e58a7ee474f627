"""Multi-turn episodes: env <-> policy, recorded token-in/token-out.

One :func:`run_episode` call plays one episode to the end and always returns a
:class:`Trajectory`: a crash in the environment becomes a failed-episode record carrying
its cause (``error``), never an exception that kills the group and never a dropped sample.
Envs with ``async def areset/astep`` are awaited on the event loop; synchronous envs run in a
daemon thread per call, so one slow tool never blocks other episodes and a call that hangs past
``step_timeout_s`` is abandoned (a failed record with reward status "timeout") without holding
up the run's shutdown.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from relax_agent.envs.spaces import is_message
from relax_agent.envs.tool_env import call_in_thread
from relax_agent.errors import EnvError
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams
from relax_agent.rollout.parsers import ToolCallParser
from relax_agent.records import Trajectory, Turn


@dataclass(frozen=True)
class EpisodeSpec:
    """Identity and limits of one episode.

    Attributes:
        sample_id / group_id / task_id: ids recorded on the trajectory.
        task: the task dict passed as ``env.reset(options={"task": task})``.
        seed: seed passed to ``env.reset``; turn k samples with engine seed ``seed * 1009 + k``.
        max_turns: assistant turns before the episode is truncated.
        max_total_tokens: token budget for prompt + turns + observations.
        step_timeout_s: most seconds one ``env.step`` may take before the episode fails.
    """

    sample_id: str
    group_id: str
    task_id: str
    task: dict[str, Any]
    seed: int
    max_turns: int = 1
    max_total_tokens: int = 2048
    step_timeout_s: float = 60.0


class _Recorder:
    """Accumulates the token stream of one episode."""

    def __init__(self, prompt_ids: tuple[int, ...]):
        self.token_ids = list(prompt_ids)
        self.loss_mask = [0] * len(prompt_ids)
        self.logprobs = [0.0] * len(prompt_ids)
        self.turns: list[Turn] = []

    def add_turn(self, token_ids: tuple[int, ...], logprobs: tuple[float, ...], version: int, finish: str,
                 routed_experts: Any = None) -> None:
        self.turns.append(Turn(len(self.token_ids), token_ids, logprobs, version, finish, routed_experts))
        self.token_ids += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.logprobs += list(logprobs)

    def add_context(self, token_ids: list[int] | tuple[int, ...]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)


_MAKE_WRAPPERS = frozenset({"TimeLimit", "OrderEnforcing", "PassiveEnvChecker"})
"""Wrappers ``gymnasium.make`` adds; the async path stands in for them (TimeLimit via the spec)."""


@dataclass
class _EnvCalls:
    """How the orchestrator calls one env: its async ``areset``/``astep`` when the env has them
    (the env's own, or the unwrapped env's under ``gymnasium.make``'s standard wrappers), else the
    sync methods in a worker thread."""

    env: Any
    timeout_s: float
    steps: int = 0

    def __post_init__(self) -> None:
        self.target, self.max_steps = _async_target(self.env)

    async def reset(self, **kwargs: Any) -> Any:
        self.steps = 0
        if self.target is not None:
            return await asyncio.wait_for(self.target.areset(**kwargs), self.timeout_s)
        return await asyncio.wait_for(call_in_thread(self.env.reset, **kwargs), self.timeout_s)

    async def step(self, action: dict[str, Any]) -> Any:
        self.steps += 1
        if self.target is None:
            return await asyncio.wait_for(call_in_thread(self.env.step, action), self.timeout_s)
        out = await asyncio.wait_for(self.target.astep(action), self.timeout_s)
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
                      parser: ToolCallParser, params: SamplingParams) -> Trajectory:
    """Play one episode of ``env`` with the policy behind ``engine``.

    Returns:
        The trajectory; on an env failure, a record with ``error`` set and
        ``reward_status="error"`` (masked out of training, counted in metrics). Its
        ``stop_reason`` is "length" when the last response was cut off by ``max_new_tokens``
        (the engine's finish reason), else "terminated", "truncated", "max_turns" or
        "max_total_tokens".
    """
    messages: list[dict[str, Any]] = []
    rec: _Recorder | None = None
    reward, metrics, stop = 0.0, {}, "max_turns"
    calls = _EnvCalls(env, spec.step_timeout_s)
    try:
        obs, info = _check_reset(await calls.reset(seed=spec.seed, options={"task": spec.task}))
        prompt = renderer.render_prompt(obs, info.get("tools", ()))
        messages = list(prompt.messages)
        rec = _Recorder(prompt.token_ids)
        for turn in range(spec.max_turns):
            budget = spec.max_total_tokens - len(rec.token_ids)
            if budget <= 0:
                stop = "max_total_tokens"
                break
            seed = params.seed if params.seed is not None else spec.seed * 1009 + turn
            gen = await engine.generate(list(rec.token_ids), replace(params, max_new_tokens=min(params.max_new_tokens, budget), seed=seed))
            rec.add_turn(gen.token_ids, gen.logprobs, gen.policy_version, gen.finish_reason, gen.routed_experts)
            text = renderer.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            action = parser.parse(text).message()
            messages.append({**action, "content": text})
            out = _check_step(await calls.step(action))
            new_obs, step_reward, terminated, truncated, step_info = out
            reward += step_reward
            metrics.update(_numeric(step_info))
            messages.extend(new_obs)
            if terminated or truncated:
                stop = "terminated" if terminated else "truncated"
                break
            if gen.finish_reason == "length":
                rec.add_context(renderer.end_of_turn_ids)
            rec.add_context(renderer.observation_delta(new_obs))
        else:
            stop = "max_turns"
        if stop != "max_total_tokens" and rec.turns and rec.turns[-1].finish_reason == "length":
            stop = "length"  # the last response was cut off by max_new_tokens (or the token budget)
    except Exception as exc:  # env bugs become data, not crashes
        return _failed(spec, rec, messages, exc)
    finally:
        await _close(env, spec.step_timeout_s)
    return Trajectory(
        sample_id=spec.sample_id, group_id=spec.group_id, task_id=spec.task_id,
        token_ids=tuple(rec.token_ids), loss_mask=tuple(rec.loss_mask),
        rollout_logprobs=tuple(rec.logprobs), prompt_len=rec.turns[0].start if rec.turns else len(rec.token_ids),
        turns=tuple(rec.turns), reward=reward, messages=tuple(messages), metrics=metrics, stop_reason=stop,
    )


async def _close(env: Any, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(call_in_thread(env.close), timeout_s)
    except Exception:  # closing must never mask the episode's own outcome (a hung close is abandoned)
        pass


def failed_episode(spec: EpisodeSpec, exc: BaseException, during: str = "") -> Trajectory:
    """The failed record of an episode that could not start (e.g. ``make_env`` raised);
    ``during`` names the call that failed and prefixes the cause."""
    traj = _failed(spec, None, [], exc)
    return replace(traj, error=f"{during}: {traj.error}") if during else traj


def _failed(spec: EpisodeSpec, rec: _Recorder | None, messages: list[dict[str, Any]], exc: BaseException) -> Trajectory:
    if isinstance(exc, asyncio.TimeoutError):
        cause = f"env call exceeded step_timeout_s={spec.step_timeout_s}"
    else:
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" at {frame.filename}:{frame.lineno}" if frame and frame.filename != __file__ else ""
        cause = f"{type(exc).__name__}: {exc}{where}"
    rec = rec or _Recorder(())
    return Trajectory(
        sample_id=spec.sample_id, group_id=spec.group_id, task_id=spec.task_id,
        token_ids=tuple(rec.token_ids), loss_mask=tuple(rec.loss_mask), rollout_logprobs=tuple(rec.logprobs),
        prompt_len=rec.turns[0].start if rec.turns else len(rec.token_ids), turns=tuple(rec.turns),
        reward=0.0, reward_status="timeout" if isinstance(exc, asyncio.TimeoutError) else "error",
        messages=tuple(messages), stop_reason="env_error", error=cause,
    )
