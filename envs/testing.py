"""The environment contract suite: run it against any env, ours or yours.

With pytest, subclass :class:`EnvContract` in a ``test_*.py`` file::

    class TestMyEnv(EnvContract):
        def make_env(self):
            return gymnasium.make("mypkg/MyEnv-v0", difficulty=1)

Without pytest: ``failures = run_contract(lambda: gymnasium.make("mypkg/MyEnv-v0"))`` returns
``{check_name: error}`` for every check that failed (empty when the env passes).

Each check builds a fresh env with the factory and closes it. The checks:

* ``gymnasium_checker``: gymnasium's own ``check_env`` passes on the unwrapped env, without warnings;
* ``step_before_reset``: the unwrapped env raises on ``step`` before any ``reset``;
* ``reset``: ``reset`` returns ``(messages, info)``; the messages lie in the observation space;
  ``info["tools"]`` is a list of OpenAI tool schemas;
* ``tasks``: ``env.unwrapped.tasks("train"|"heldout")`` are disjoint lists of tasks with unique
  ids, and ``reset(options={"task": t})`` starts an episode on one of each;
* ``determinism``: two envs reset with the same seed and fed the same actions return equal
  observations, rewards, flags and infos; a re-reset with that seed repeats the opening;
* ``step``: for each probe action (a final answer, a call of the first tool, a call of an unknown
  tool) ``step`` returns messages in the space, a finite float reward, bool flags and a dict info;
* ``episode_ends``: answering with plain text ends the episode (terminated or truncated) within
  :data:`MAX_PROBE_STEPS` steps;
* ``close``: ``close`` is idempotent and leaves no file descriptor or thread behind (measured on
  Linux after one warm-up episode, so caches and warm pools are not counted);
* ``async_api``: when the env defines ``async def areset/astep``, they give what ``reset``/``step`` give.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import inspect
import math
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium

from relax_agent.envs.base import HasTasks
from relax_agent.envs.spaces import is_message

Factory = Callable[[], gymnasium.Env]
Check = Callable[[Factory], None]
CHECKS: dict[str, Check] = {}
MAX_PROBE_STEPS = 64
"""Plain-text answers after which an episode must have ended (``episode_ends``)."""
ANSWER = {"role": "assistant", "content": "Answer: 0"}


def _check(fn: Check) -> Check:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


class _Opened:
    """``with _Opened(make_env) as env``: a fresh env, closed afterwards."""

    def __init__(self, make_env: Factory) -> None:
        self.env = make_env()

    def __enter__(self) -> gymnasium.Env:
        return self.env

    def __exit__(self, *exc: Any) -> None:
        self.env.close()


def tool_call(name: str, arguments: dict[str, Any] | None = None, call_id: str = "call_0") -> dict[str, Any]:
    """An assistant message with one OpenAI-format tool call."""
    function = {"name": name, "arguments": arguments or {}}
    return {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": function}]}


def probe_actions(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The actions ``step`` is probed with: a final answer, a call of the first tool in
    ``info["tools"]`` with no arguments, and a call of a tool that does not exist."""
    actions = [dict(ANSWER)]
    tools = info.get("tools") or []
    if tools:
        actions.append(tool_call(tools[0]["function"]["name"]))
    actions.append(tool_call("no_such_tool_for_the_contract"))
    return actions


def _is_tool_schema(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return (isinstance(function, dict) and tool.get("type") == "function" and isinstance(function.get("name"), str)
            and isinstance(function.get("parameters", {}), dict))


def _equivalent(a: Any, b: Any) -> bool:
    """gymnasium's ``data_equivalence``, with NaN equal to NaN (so a NaN reward is reported as
    non-finite by ``step``, not as nondeterminism)."""
    from gymnasium.utils.env_checker import data_equivalence

    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (tuple, list)) and type(a) is type(b) and len(a) == len(b):
        return all(_equivalent(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return all(_equivalent(a[k], b[k]) for k in a)
    return data_equivalence(a, b)


def _check_obs(env: gymnasium.Env, obs: Any, where: str) -> None:
    _expect(isinstance(obs, list), f"{where}: observation must be a list of messages, got {type(obs).__name__}")
    bad = [m for m in obs if not is_message(m)]
    _expect(not bad, f"{where}: not OpenAI-format chat messages: {str(bad)[:300]}")
    _expect(env.observation_space.contains(obs), f"{where}: observation not in {env.observation_space}")


def _check_reset_out(env: gymnasium.Env, out: Any, where: str = "reset") -> tuple[list[Any], dict[str, Any]]:
    _expect(isinstance(out, tuple) and len(out) == 2, f"{where} must return (observation, info), got {type(out).__name__}")
    obs, info = out
    _check_obs(env, obs, where)
    _expect(isinstance(info, dict), f"{where}: info must be a dict, got {type(info).__name__}")
    tools = info.get("tools")
    _expect(isinstance(tools, list), f"{where}: info['tools'] must be a list of tool schemas (may be empty), got {tools!r}")
    bad = [t for t in tools if not _is_tool_schema(t)]
    _expect(not bad, f"{where}: info['tools'] entries must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}, got {str(bad)[:300]}")
    return obs, info


def _check_step_out(env: gymnasium.Env, out: Any, where: str = "step") -> tuple[Any, float, bool, bool, dict[str, Any]]:
    _expect(isinstance(out, tuple) and len(out) == 5,
            f"{where} must return (observation, reward, terminated, truncated, info), got {type(out).__name__}")
    obs, reward, terminated, truncated, info = out
    _check_obs(env, obs, where)
    _expect(isinstance(reward, (int, float)) and not isinstance(reward, bool), f"{where}: reward must be a float, got {type(reward).__name__}")
    _expect(math.isfinite(reward), f"{where}: reward must be finite, got {reward!r}")
    _expect(isinstance(terminated, bool) and isinstance(truncated, bool),
            f"{where}: terminated/truncated must be bool, got {type(terminated).__name__}/{type(truncated).__name__}")
    _expect(isinstance(info, dict), f"{where}: info must be a dict, got {type(info).__name__}")
    return out


@_check
def check_gymnasium_checker(make_env: Factory) -> None:
    """gymnasium.utils.env_checker.check_env passes on the unwrapped env and warns nothing."""
    from gymnasium.utils.env_checker import check_env

    with _Opened(make_env) as env, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped, skip_render_check=True)
    messages = [str(w.message) for w in caught if "WARN:" in str(w.message)]  # gymnasium.logger.warn's prefix
    _expect(not messages, f"gymnasium's env checker warned: {messages}")


@_check
def check_step_before_reset(make_env: Factory) -> None:
    """``step`` before ``reset`` raises (on the unwrapped env: async callers bypass OrderEnforcing)."""
    with _Opened(make_env) as env:
        try:
            env.unwrapped.step(dict(ANSWER))
        except Exception:  # noqa: BLE001 - any clear error is fine
            return
        raise AssertionError("step() before reset() did not raise")


@_check
def check_reset(make_env: Factory) -> None:
    """reset returns (messages in the space, info with tool schemas); works without options too."""
    with _Opened(make_env) as env:
        _check_reset_out(env, env.reset(seed=0), "reset(seed=0)")
        _check_reset_out(env, env.reset(), "reset()")


@_check
def check_tasks(make_env: Factory) -> None:
    """train/heldout task lists: dicts with unique ids, disjoint; reset(options={"task": t}) takes them."""
    with _Opened(make_env) as env:
        inner = env.unwrapped
        if not isinstance(inner, HasTasks):  # (an if, not _expect: it narrows ``inner`` for the type checker)
            raise AssertionError("env.unwrapped.tasks(split) is missing (the trainer samples tasks from it)")
        train, heldout = inner.tasks("train"), inner.tasks("heldout")
        for name, split in (("train", train), ("heldout", heldout)):
            _expect(isinstance(split, list) and all(isinstance(t, dict) and "id" in t for t in split),
                    f"tasks({name!r}) must be a list of dicts with an 'id'")
            ids = [t["id"] for t in split]
            _expect(len(set(ids)) == len(ids), f"tasks({name!r}) has repeated ids")
        _expect(bool(train), "tasks('train') is empty")
        overlap = {t["id"] for t in train} & {t["id"] for t in heldout}
        _expect(not overlap, f"train and heldout share task ids: {sorted(overlap)[:5]}")
        for task in (train[0], *heldout[:1]):
            _check_reset_out(env, env.reset(seed=0, options={"task": task}), f"reset(options={{'task': {task['id']!r}}})")


def _play(make_env: Factory, seed: int) -> list[Any]:
    with _Opened(make_env) as env:
        out: list[Any] = [env.reset(seed=seed)]
        for action in probe_actions(out[0][1]):
            out.append(env.reset(seed=seed))
            out.append(env.step(copy.deepcopy(action)))
        return out


@_check
def check_determinism(make_env: Factory) -> None:
    """Same seed, same actions -> same observations, rewards, flags and infos (two fresh envs)."""
    for seed in (0, 1):
        first, second = _play(make_env, seed), _play(make_env, seed)
        for i, (a, b) in enumerate(zip(first, second, strict=True)):
            _expect(_equivalent(a, b), f"seed {seed}, call {i}: two envs differ:\n{str(a)[:300]}\n{str(b)[:300]}")
        _expect(_equivalent(first[0], first[1]), f"seed {seed}: reset(seed) twice on one env gave different openings")


@_check
def check_step(make_env: Factory) -> None:
    """Every probe action gives a well-formed step (finite float reward, bool flags, dict info)."""
    with _Opened(make_env) as env:
        _, info = env.reset(seed=0)
        for action in probe_actions(info):
            env.reset(seed=0)
            _check_step_out(env, env.step(copy.deepcopy(action)), f"step({str(action)[:120]})")


@_check
def check_episode_ends(make_env: Factory) -> None:
    """Plain-text answers end the episode within MAX_PROBE_STEPS steps."""
    with _Opened(make_env) as env:
        env.reset(seed=0)
        for _ in range(MAX_PROBE_STEPS):
            _, _, terminated, truncated, _ = _check_step_out(env, env.step(dict(ANSWER)))
            if terminated or truncated:
                return
        raise AssertionError(f"episode did not end after {MAX_PROBE_STEPS} plain-text answers")


def _resources() -> tuple[int, int]:
    gc.collect()  # sockets and files nothing holds any more, closed when collected: not the env's
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    return fds, threading.active_count()


def _episode(make_env: Factory) -> None:
    env = make_env()
    env.reset(seed=0)
    env.step(dict(ANSWER))
    env.close()
    env.close()  # idempotent


CLOSE_WINDOWS = 3
"""Windows of 3 episodes :func:`check_close` plays: the counts are the whole process's, so a descriptor or
thread another part of the process opened meanwhile can make one window grow; a leak grows every window."""


@_check
def check_close(make_env: Factory) -> None:
    """close() twice does not raise; an episode leaves no file descriptor or thread behind (counted after a
    garbage collection: a socket nothing references any more is the collector's, not a leak of the env).

    The counts are the process's, so they are taken over up to :data:`CLOSE_WINDOWS` windows of 3 episodes
    each: the check passes once a window ends with no more descriptors and threads than it began with, and
    fails, naming every window's growth, when all of them grew (what an env that leaks does)."""
    _episode(make_env)  # warm-up: caches, lazily opened data, shared pools
    grew = []
    for _ in range(CLOSE_WINDOWS):
        before = _resources()
        for _ in range(3):
            _episode(make_env)
        after = _resources()
        if after[0] <= before[0] and after[1] <= before[1]:
            return
        grew.append(f"descriptors {before[0]} -> {after[0]}, threads {before[1]} -> {after[1]}")
    raise AssertionError(f"open file descriptors or live threads grew in each of {CLOSE_WINDOWS} windows of 3 "
                         f"closed episodes: {'; '.join(grew)}")


@_check
def check_async_api(make_env: Factory) -> None:
    """``async def areset/astep`` (when defined) match ``reset``/``step``."""
    with _Opened(make_env) as env:
        inner = env.unwrapped
        areset, astep = getattr(inner, "areset", None), getattr(inner, "astep", None)
        if not (areset or astep):
            return
        if not (inspect.iscoroutinefunction(areset) and inspect.iscoroutinefunction(astep)):
            raise AssertionError("define both areset and astep, as async def")
        sync_out = [env.reset(seed=0), inner.step(dict(ANSWER))]

        async def play() -> list[Any]:
            return [await areset(seed=0), await astep(dict(ANSWER))]

        async_out = asyncio.run(play())
        _check_reset_out(env, async_out[0], "areset")
        _check_step_out(env, async_out[1], "astep")
        _expect(_equivalent(sync_out, async_out), f"async and sync API differ:\n{sync_out}\n{async_out}")


def run_check(make_env: Factory, name: str) -> None:
    """Run one check by name; raises AssertionError (or the env's own error) when it fails."""
    CHECKS[name](make_env)


def run_contract(make_env: Factory, checks: list[str] | None = None) -> dict[str, str]:
    """Run the checks (default: all) and return ``{name: error}`` for those that failed."""
    failures = {}
    for name in checks or list(CHECKS):
        try:
            run_check(make_env, name)
        except Exception as exc:  # noqa: BLE001 - reported per check
            failures[name] = f"{type(exc).__name__}: {exc}"
    return failures


class EnvContract:
    """Pytest mixin: subclass it in a ``Test*`` class and implement :meth:`make_env`."""

    skip_checks: tuple[str, ...] = ()
    """Check names this env opts out of (say why in the test)."""

    def make_env(self) -> gymnasium.Env:
        """A fresh env (``gymnasium.make(...)`` or the class itself)."""
        raise NotImplementedError

    def test_contract(self, env_contract_check: str) -> None:
        """Run one contract check (parametrized by the ``env_contract_check`` fixture) on :meth:`make_env`;
        skipped when the check is in ``skip_checks``."""
        if env_contract_check in self.skip_checks:
            import pytest

            pytest.skip(f"{type(self).__name__} opts out of {env_contract_check!r}")
        run_check(self.make_env, env_contract_check)

    def pytest_generate_tests(self, metafunc) -> None:  # noqa: ANN001 - pytest hook
        """Parametrize ``env_contract_check`` with every check name."""
        if "env_contract_check" in metafunc.fixturenames:
            metafunc.parametrize("env_contract_check", list(CHECKS))


__all__ = ["CHECKS", "EnvContract", "MAX_PROBE_STEPS", "probe_actions", "run_check", "run_contract", "tool_call"]
