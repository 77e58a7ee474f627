"""``relax/Verifiers-v0``: a `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ environment
(the 0.4 ``verifiers.v1`` stack: taskset, tasks, tools, ``Env.run`` turn logic, rewards) played by
relax-agent's policy::

    env = relax_agent.envs.make("verifiers:tests.e2e.data.vf_envs:load_lookup")   # = relax/Verifiers-v0
    messages, info = env.reset(seed=0)        # the task's system prompt and prompt; info["tools"]: its Toolset tools
    env.step({"role": "assistant", "content": "", "tool_calls": [...]})           # tool results, run by verifiers
    env.step({"role": "assistant", "content": "<answer>Paris</answer>"})          # reward: the trace's weighted rewards

``env`` names the environment: ``"<name>"`` is an installed taskset package (or a module in the
working directory) loaded by verifiers' own loader (``vf.load_environment``: the package's exported
``Taskset``, paired with its exported ``Env`` when it has one), with ``env_args`` as the taskset's
config fields (or a whole env config, ``{"taskset": {...}, "agent": {...}}``);
``"<module>:<function>"`` imports ``module`` (the working directory first) and calls
``function(**env_args)``, which returns a ``vf.Env`` or a ``vf.Taskset``.

relax-agent plays verifiers' ``null`` harness (the plain chat loop) in-process, step by step
(:mod:`relax_agent.envs.bridges.verifiers_harness`, :mod:`relax_agent.envs.bridges.verifiers_episode`): the opening messages are the task's system
prompt and prompt, tool calls (already parsed by relax-agent) run through the Toolset servers, a
reply without tool calls ends the agent's segment, an ``Env.run`` answers it with the next user
turn or ends the episode, ``@vf.stop`` hooks and the ``max_turns`` limit end it as verifiers does,
and the final step's reward is the trace's ``Trace.reward`` after ``Task.score`` and ``Env.finalize``
(each reward's score, unweighted, in ``info["vf_reward_<name>"]``, each metric in
``info["vf_metric_<name>"]``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from typing import Any

import gymnasium as gym

from relax_agent.envs.base import TextEnv
from relax_agent.envs.bfcl.data import check_split_args, split_tasks
from relax_agent.envs.bridges import require
from relax_agent.errors import ConfigError, DataError, EnvError

ENV_ID = "relax/Verifiers-v0"


def load(env: str, env_args: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """``(vf.Env or None, vf.Taskset)`` for an ``env`` name (see the module docstring).

    Raises:
        ConfigError: verifiers is not installed (naming the extra), the name cannot be loaded, or
            the function returns neither a ``vf.Env`` nor a ``vf.Taskset``.
    """
    require("verifiers")
    import verifiers.v1 as vf

    args = dict(env_args or {})
    module, sep, function = env.partition(":")
    try:
        if sep:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            loaded = getattr(importlib.import_module(module), function)(**args)
        else:
            raw = args if "taskset" in args else {"taskset": args}
            raw = {**raw, "taskset": {"id": env, **dict(raw["taskset"])}}
            loaded = vf.load_environment(vf.resolve_env_config(raw))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - import, validation and plugin errors all mean a bad name or args
        raise ConfigError(f"verifiers environment {env!r} with env_args {args}: {type(exc).__name__}: {exc} "
                          "(relax-agent envs list --bridge verifiers shows the installed ones)") from exc
    if isinstance(loaded, vf.Env):
        return loaded, loaded.taskset
    if isinstance(loaded, vf.Taskset):
        return None, loaded
    raise ConfigError(f"verifiers environment {env!r}: {function}() returned {type(loaded).__name__}; expected a "
                      "verifiers.v1.Env or a verifiers.v1.Taskset")


def _needs_runtime(fn: Any) -> bool:
    import inspect

    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def check_supported(env: Any, taskset: Any, tasks: list[Any]) -> None:
    """Refuse what the in-process bridge cannot play as verifiers would.

    Raises:
        ConfigError: tasks that need a container or an image, scoring hooks that need a runtime box,
            Toolsets it cannot serve (stateful or remote), or a role pinned to a harness other than
            ``null`` (relax-agent plays the plain chat loop).
    """
    from verifiers.v1.configs.agent import agent_config_fields

    from relax_agent.envs.bridges.verifiers_harness import check_toolset

    first = tasks[0]
    name = type(first).__name__
    imaged = [t.data.idx for t in tasks if t.data.image]
    if type(first).NEEDS_CONTAINER or imaged:
        raise ConfigError(f"verifiers task {name} needs a container (NEEDS_CONTAINER or data.image, e.g. task "
                          f"{imaged[:3]}); the relax-agent bridge runs no runtime boxes")
    hooks = [*first.hooks("metric"), *first.hooks("reward")]
    boxed = [fn.__name__ for fn in hooks if _needs_runtime(fn)]
    boxed += [judge.reward_name for judge in first.plugged_judges() if _needs_runtime(judge.score)]
    if boxed:
        raise ConfigError(f"verifiers task {name} scores with {boxed}, which need a runtime box; the relax-agent "
                          "bridge runs none (verifiers would skip them, changing the reward)")
    for toolset in [*type(taskset).toolsets(taskset.config), *first.toolsets(first.config)]:
        check_toolset(toolset)
    config = env.config if env is not None else None
    for role, spec in (agent_config_fields(config) if config is not None else {}).items():
        if spec.harness is not None and spec.harness.id != "null":
            raise ConfigError(f"verifiers env role {role!r} is pinned to harness {spec.harness.id!r}; relax-agent "
                              "plays the 'null' harness (the plain chat loop) only")


def _task_id(key: str) -> str:
    return "vf-" + hashlib.sha1(key.encode()).hexdigest()[:16]


def _as_observation(message: dict[str, Any]) -> dict[str, Any]:
    """A chat wire message as relax-agent's renderer takes it (tool-call arguments as objects)."""
    out = dict(message)
    calls = []
    for call in out.get("tool_calls") or []:
        function = dict(call.get("function") or {})
        try:
            arguments = json.loads(function.get("arguments") or "{}")
            function["arguments"] = arguments if isinstance(arguments, dict) else function.get("arguments")
        except (TypeError, json.JSONDecodeError):
            pass
        calls.append({**call, "function": function})
    if calls:
        out["tool_calls"] = calls
    return out


class VerifiersEnv(TextEnv):
    """A verifiers environment's tasks, played through its turn logic, tools and rewards.

    Args:
        env: ``"<name>"`` (an installed taskset, loaded by verifiers) or ``"<module>:<function>"``
            returning a ``vf.Env`` or ``vf.Taskset``.
        env_args: the taskset's config fields (``"<name>"``) or the function's keyword arguments.
        num_tasks: tasks taken from the taskset (the first ``num_tasks``); needed for an infinite
            taskset, None takes all of a finite one.
        split: the split ``reset`` draws from when no task is given ("train" or "heldout").
        heldout_fraction: share of tasks held out (by the hash of verifiers' task key) when
            ``heldout_args`` is None.
        heldout_args: when set, the held-out tasks are those of a second taskset loaded with
            ``env_args`` updated by these (``{"split": "test"}``, say); tasks it shares with the
            first are dropped from "train".
        max_turns: caps every agent's model turns with verifiers' own ``max_turns`` limit (a run that
            reaches it is stopped and scored, as in verifiers); None keeps the env's.

    Raises:
        ConfigError: verifiers missing, a bad name or arguments, an unsupported env
            (:func:`check_supported`), or an argument outside the values above.
    """

    reward_description = (
        "verifiers' own score of the finished rollout: the sum of the task's weighted @vf.reward functions "
        "(Trace.reward, after Task.score and the env's finalize), given on the step that ends the episode; "
        "0.0 on the steps before."
    )

    def __init__(self, env: str = "", env_args: dict[str, Any] | None = None, num_tasks: int | None = None,
                 split: str = "train", heldout_fraction: float = 0.2, heldout_args: dict[str, Any] | None = None,
                 max_turns: int | None = None) -> None:
        super().__init__()
        if not env or not isinstance(env, str):
            raise ConfigError(f"env={env!r}; expected 'verifiers:<name>' or 'verifiers:<module>:<function>'")
        if num_tasks is not None and num_tasks < 1:
            raise ConfigError(f"num_tasks={num_tasks!r}; expected a positive integer or None")
        if max_turns is not None and max_turns < 1:
            raise ConfigError(f"max_turns={max_turns!r}; expected a positive integer or None")
        check_split_args(split, heldout_fraction)
        self.name, self.split, self.heldout_fraction, self.max_turns = env, split, heldout_fraction, max_turns
        self.vf_env, self.taskset = load(env, env_args)
        train = self._load_tasks(self.taskset, num_tasks)
        check_supported(self.vf_env, self.taskset, list(train.values()))
        if heldout_args is None:
            self._splits = {s: split_tasks(self._dicts(train), s, heldout_fraction) for s in ("train", "heldout")}
            self._tasks = train
        else:
            heldout = self._load_tasks(load(env, {**(env_args or {}), **heldout_args})[1], num_tasks)
            self._tasks = {**train, **heldout}
            self._splits = {"train": self._dicts({k: t for k, t in train.items() if k not in heldout}),
                            "heldout": self._dicts(heldout)}
        self._loop: Any = None
        self._driver: Any = None
        self._last: Any = None
        self._final: Any = None
        self._turns = 0

    def _load_tasks(self, taskset: Any, num_tasks: int | None) -> dict[str, Any]:
        if taskset.INFINITE and num_tasks is None:
            raise ConfigError(f"verifiers taskset {type(taskset).__name__} is infinite; set num_tasks")
        tasks: dict[str, Any] = {}
        for task in taskset.take(num_tasks) if num_tasks is not None else taskset:
            tasks.setdefault(_task_id(task.key), task)  # keys are unique by verifiers' contract; repeats dropped
        if not tasks:
            raise ConfigError(f"verifiers taskset {type(taskset).__name__} ({self.name!r}) yielded no tasks")
        return tasks

    @staticmethod
    def _dicts(tasks: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"id": tid, "index": t.data.idx, "key": t.key, **({"name": t.data.name} if t.data.name else {})}
                for tid, t in tasks.items()]

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """``{"id", "index", "key", "name"?}`` dicts of ``split`` (``index``: the position in the taskset).

        Raises:
            DataError: unknown split.
        """
        if split not in self._splits:
            raise DataError(f"unknown split {split!r}; expected one of {sorted(self._splits)}")
        return [dict(t) for t in self._splits[split]]

    # -- episodes ------------------------------------------------------------------------------
    def _runner(self) -> tuple[Any, Any]:
        from relax_agent.envs.bridges.verifiers_episode import EpisodeDriver
        from relax_agent.envs.bridges.verifiers_harness import LoopThread

        if self._loop is None:
            self._loop = LoopThread()
            self._driver = EpisodeDriver(self.vf_env, self.taskset, self.max_turns)
        return self._loop, self._driver

    def _pick(self, seed: int | None, options: dict[str, Any] | None) -> tuple[dict[str, Any], Any]:
        gym.Env.reset(self, seed=seed)
        task = (options or {}).get("task")
        if task is None:
            pool = self.tasks(self.split)
            task = pool[int(self.np_random.integers(len(pool)))]
        vtask = self._tasks.get(str(task.get("id"))) if isinstance(task, dict) else None
        if vtask is None:
            raise DataError(f"task {str(task)[:120]} is not one of this verifiers env's tasks (see tasks(split))")
        self.task, self._last, self._final, self._turns = task, None, None, 0
        return task, vtask

    def _opened(self, task: dict[str, Any], out: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        from relax_agent.envs.bridges.verifiers_episode import Ask

        info: dict[str, Any] = {"task_id": task["id"], "tools": []}
        if isinstance(out, Ask):
            self._last = out
            return [_as_observation(m) for m in out.messages], {**info, "tools": json.loads(json.dumps(out.tools))}
        self._final = out  # the episode ended before any model call: the next step reports it
        data = self._tasks[task["id"]].data
        opening = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if data.prompt is not None:
            opening.append({"role": "user", "content": data.prompt_text})
        return opening, info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode on ``options["task"]`` (or a task of ``split`` drawn with ``seed``), dropping one still
        running, and play it to the first model call.

        Returns:
            (the messages of that call: system prompt, prompt; info with ``tools`` and ``task_id``).

        Raises:
            DataError: the task is not one of :meth:`tasks`.
            EnvError: the verifiers env broke the bridge's rules (see :meth:`step`).
        """
        task, vtask = self._pick(seed, options)
        loop, driver = self._runner()
        return self._opened(task, loop.call(driver.start(vtask)))

    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Async :meth:`reset`: the verifiers episode runs on the env's own loop, awaited without blocking."""
        task, vtask = self._pick(seed, options)
        loop, driver = self._runner()
        return self._opened(task, await loop.acall(driver.start(vtask)))

    def _reply(self, action: Any) -> dict[str, Any]:
        """The assistant message on the chat wire (tool-call arguments as JSON text)."""
        if self.task is None or (self._last is None and self._final is None):
            raise EnvError("VerifiersEnv.step() needs a fresh episode: call reset() first")
        if not isinstance(action, dict):
            raise EnvError(f"action must be an assistant message dict, got {type(action).__name__}")
        calls = action.get("tool_calls") or []
        if not isinstance(calls, list):
            raise EnvError(f"action['tool_calls'] must be a list, got {type(calls).__name__}")
        wire: dict[str, Any] = {"role": "assistant", "content": action.get("content") or ""}
        if action.get("reasoning_content"):
            wire["reasoning_content"] = action["reasoning_content"]
        out = []
        for i, call in enumerate(calls):
            if not isinstance(call, dict):
                raise EnvError(f"action['tool_calls'][{i}] must be a dict, got {type(call).__name__}")
            function = call.get("function", call)
            function = function if isinstance(function, dict) else {}
            arguments = function.get("arguments")
            out.append({"id": str(call.get("id") or f"call_{self._turns}_{i}"), "type": "function",
                        "function": {"name": str(function.get("name") or ""),
                                     "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments or {})}})
        if out:
            wire["tool_calls"] = out
        self._turns += 1
        return wire

    def _stepped(self, out: Any):
        from relax_agent.envs.bridges.verifiers_episode import Ask

        if isinstance(out, Ask):
            before = len(self._last.messages) + 1
            if len(out.messages) < before:
                raise EnvError(f"verifiers env rewrote the conversation ({len(out.messages)} messages after "
                               f"{before}); relax-agent needs each request to extend the last one")
            self._last = out
            return [_as_observation(m) for m in out.messages[before:]], 0.0, False, False, {"vf_turns": self._turns}
        return self._finish(out)

    def _finish(self, out: Any):
        self._last, self._final = None, None
        if out.errors:
            raise EnvError(f"verifiers episode of {self.name!r} failed: {'; '.join(out.errors)[:2000]}")
        info: dict[str, Any] = {"vf_turns": self._turns}
        for trace in out.traces:
            info |= {f"vf_reward_{k}": r.score for k, r in trace.rewards.items() if r is not None}
            info |= {f"vf_metric_{k}": v for k, v in trace.metrics.items() if v is not None}
            info["reason"] = trace.stop_condition
        return [], out.reward, True, False, info

    def step(self, action: dict[str, Any]):
        """Answer the pending model call with ``action`` (relax-agent's parsed assistant message) and play on.

        Returns:
            Before the episode ends: ``(the next request's new messages: tool results, user turns; 0.0, False,
            False, info)``. At its end: ``([], Trace.reward, True, False, info)``, info holding each reward's
            score (``vf_reward_<name>``), each metric (``vf_metric_<name>``) and the stop condition (``reason``).

        Raises:
            EnvError: step before reset or after the end, a malformed action, a failed verifiers rollout
                (its errors quoted), a second rollout in one episode (multi-agent envs), or a rewritten history.
        """
        wire = self._reply(action)
        if self._final is not None:
            return self._finish(self._final)
        loop, driver = self._runner()
        return self._stepped(loop.call(driver.advance(wire)))

    async def astep(self, action: dict[str, Any]):
        """Async :meth:`step`, awaited on the caller's loop while the episode runs on the env's own."""
        wire = self._reply(action)
        if self._final is not None:
            return self._finish(self._final)
        loop, driver = self._runner()
        return self._stepped(await loop.acall(driver.advance(wire)))

    def close(self) -> None:
        """Drop the running episode and stop the env's event loop thread (idempotent)."""
        loop, self._loop, self._driver = self._loop, None, None
        self._last = self._final = None
        if loop is not None:
            loop.close()


def _hub_packages() -> set[str]:
    """Top-level modules of installed distributions that require verifiers (unconditionally)."""
    from importlib.metadata import distributions, packages_distributions

    from packaging.requirements import InvalidRequirement, Requirement

    wanted = set()
    for dist in distributions():
        for line in dist.requires or []:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.name.lower() == "verifiers" and not (req.marker and "extra" in str(req.marker)):
                wanted.add(dist.metadata["Name"])
    return {module for module, dists in packages_distributions().items() if wanted & set(dists)}


def available() -> list[str]:
    """The verifiers environments installed (``env.id: "verifiers:<name>"``): verifiers' built-in tasksets and the
    installed packages that depend on verifiers, each kept when verifiers' own loader finds its ``Taskset``.

    Raises:
        ConfigError: verifiers is not installed (naming the extra).
    """
    require("verifiers")
    import pkgutil

    from verifiers.v1 import tasksets
    from verifiers.v1.utils.loaders import taskset_class

    names = {m.name for m in pkgutil.iter_modules(tasksets.__path__)} | _hub_packages()
    found = []
    for name in sorted(names - {"verifiers"}):
        try:
            taskset_class(name)
        except Exception:  # noqa: BLE001,S112 - not a taskset (or its own dependencies are missing): not offered
            continue
        found.append(name)
    return found


__all__ = ["ENV_ID", "VerifiersEnv", "available", "check_supported", "load"]
