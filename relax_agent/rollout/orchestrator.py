"""Multi-turn episodes: env <-> policy, recorded token-in/token-out.

One :func:`run_episode` call plays one episode to the end and always returns a
:class:`Trajectory`: a crash in the environment becomes a failed-episode record carrying
its cause (``error``), never an exception that kills the group and never a dropped sample.
Synchronous envs run in worker threads so one slow tool never blocks other episodes.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable

from relax_agent.errors import EnvError
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams
from relax_agent.rollout.parsers import ToolCallParser
from relax_agent.rollout.trajectory import Trajectory, Turn


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

    def add_turn(self, token_ids: tuple[int, ...], logprobs: tuple[float, ...], version: int, finish: str) -> None:
        self.turns.append(Turn(len(self.token_ids), token_ids, logprobs, version, finish))
        self.token_ids += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.logprobs += list(logprobs)

    def add_context(self, token_ids: list[int] | tuple[int, ...]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)


async def _call_env(fn: Callable[..., Any], *args: Any, timeout_s: float, **kwargs: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*args, **kwargs), timeout_s)
    return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), timeout_s)


def _check_step(out: Any) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
    if not isinstance(out, tuple) or len(out) != 5:
        raise EnvError(f"env.step must return (observation, reward, terminated, truncated, info), got {type(out).__name__} of length {len(out) if isinstance(out, tuple) else '?'}")
    obs, reward, terminated, truncated, info = out
    if not isinstance(obs, (list, tuple)):
        raise EnvError(f"env.step observation must be a list of messages, got {type(obs).__name__}")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvError(f"env.step reward must be a number, got {reward!r}") from None
    if not math.isfinite(reward):
        raise EnvError(f"env.step returned a non-finite reward {reward!r}")
    return list(obs), reward, bool(terminated), bool(truncated), dict(info or {})


def _numeric(info: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in info.items() if isinstance(v, (int, float, bool)) and not isinstance(v, str)}


async def run_episode(env: Any, spec: EpisodeSpec, engine: InferenceEngine, renderer: ChatRenderer,
                      parser: ToolCallParser, params: SamplingParams) -> Trajectory:
    """Play one episode of ``env`` with the policy behind ``engine``.

    Returns:
        The trajectory; on an env failure, a record with ``error`` set and
        ``reward_status="error"`` (masked out of training, counted in metrics).
    """
    messages: list[dict[str, Any]] = []
    rec: _Recorder | None = None
    reward, metrics, stop = 0.0, {}, "max_turns"
    try:
        obs, info = await _call_env(env.reset, seed=spec.seed, options={"task": spec.task}, timeout_s=spec.step_timeout_s)
        prompt = renderer.render_prompt(obs, (info or {}).get("tools", ()))
        messages = list(prompt.messages)
        rec = _Recorder(prompt.token_ids)
        for turn in range(spec.max_turns):
            budget = spec.max_total_tokens - len(rec.token_ids)
            if budget <= 0:
                stop = "max_total_tokens"
                break
            seed = params.seed if params.seed is not None else spec.seed * 1009 + turn
            gen = await engine.generate(list(rec.token_ids), replace(params, max_new_tokens=min(params.max_new_tokens, budget), seed=seed))
            rec.add_turn(gen.token_ids, gen.logprobs, gen.policy_version, gen.finish_reason)
            text = renderer.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            action = parser.parse(text).message()
            messages.append({**action, "content": text})
            out = _check_step(await _call_env(env.step, action, timeout_s=spec.step_timeout_s))
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
    except Exception as exc:  # env bugs become data, not crashes
        return _failed(spec, rec, messages, exc)
    finally:
        await _close(env)
    return Trajectory(
        sample_id=spec.sample_id, group_id=spec.group_id, task_id=spec.task_id,
        token_ids=tuple(rec.token_ids), loss_mask=tuple(rec.loss_mask),
        rollout_logprobs=tuple(rec.logprobs), prompt_len=rec.turns[0].start if rec.turns else len(rec.token_ids),
        turns=tuple(rec.turns), reward=reward, messages=tuple(messages), metrics=metrics, stop_reason=stop,
    )


async def _close(env: Any) -> None:
    try:
        await asyncio.to_thread(env.close)
    except Exception:  # closing must never mask the episode's own outcome
        pass


def _failed(spec: EpisodeSpec, rec: _Recorder | None, messages: list[dict[str, Any]], exc: BaseException) -> Trajectory:
    if isinstance(exc, asyncio.TimeoutError):
        cause = f"env call exceeded step_timeout_s={spec.step_timeout_s}"
    else:
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" at {frame.filename}:{frame.lineno}" if frame else ""
        cause = f"{type(exc).__name__}: {exc}{where}"
    rec = rec or _Recorder(())
    return Trajectory(
        sample_id=spec.sample_id, group_id=spec.group_id, task_id=spec.task_id,
        token_ids=tuple(rec.token_ids), loss_mask=tuple(rec.loss_mask), rollout_logprobs=tuple(rec.logprobs),
        prompt_len=rec.turns[0].start if rec.turns else len(rec.token_ids), turns=tuple(rec.turns),
        reward=0.0, reward_status="timeout" if isinstance(exc, asyncio.TimeoutError) else "error",
        messages=tuple(messages), stop_reason="env_error", error=cause,
    )
