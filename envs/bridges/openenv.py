"""``relax/OpenEnv-v0``: an `OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ environment server as a
relax-agent env (``env.id: "openenv:<target>"``).

    env = relax_agent.envs.make("openenv:http://127.0.0.1:8000")          # a running server
    env = relax_agent.envs.make("openenv:my_envs.guess:app")              # started here: a FastAPI app
    env = relax_agent.envs.make("openenv:my_envs.guess:GuessEnvironment") # ... or an Environment subclass
    env = relax_agent.envs.make("openenv:echo")                           # ... or an installed openenv-echo-env

A URL is used as it is; a module target or an installed environment's name is served by a local
uvicorn process on 127.0.0.1 that this process starts, shares between its env objects and always
stops (:mod:`relax_agent.envs.bridges.openenv_server`). Every episode is one WebSocket session on
the server, opened at ``reset`` and closed when the episode ends or the env is closed
(:mod:`relax_agent.envs.bridges.openenv_wire`), so concurrent episodes never share server state.

Mapping: the observation's text (:func:`~relax_agent.envs.bridges.openenv_wire.observation_text`)
is a user message; an action whose only field is a string takes the reply's text (the echo env's
``message``), any other action is offered as one tool (``tool_name``, its fields the parameters)
and the reply's call of it is the action. Each step's reward is the server's; the rollout driver
adds them up, so the episode reward is the server's return. Tasks are reset seeds.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

from relax_agent.envs.base import TextEnv
from relax_agent.envs.bfcl.data import check_split_args, split_tasks
from relax_agent.envs.tool_env import call_parts
from relax_agent.errors import ConfigError, EnvError

from .openenv_server import LocalServer, acquire, check_module, installed, normalize_name, release
from .openenv_wire import ActionRefused, Session, action_tool, base_url, fetch_schema, observation_text, reward_of
from .openenv_wire import text_field_of as only_text_field

ENV_ID = "relax/OpenEnv-v0"
URL_SCHEMES = ("http://", "https://", "ws://", "wss://")


def target_kind(env: str) -> tuple[str, str]:
    """``("url", base URL)``, ``("module", "<module>:<attr>")`` or ``("name", installed name)`` of ``env``.

    Raises:
        ConfigError: an empty target or a malformed URL.
    """
    env = (env or "").strip()
    if not env:
        raise ConfigError("env=''; expected an OpenEnv server URL, '<module>:<app or Environment class>' or the "
                          "name of an installed OpenEnv environment")
    if env.lower().startswith(URL_SCHEMES):
        return "url", base_url(env)
    if ":" in env:
        return "module", env
    return "name", normalize_name(env)


class _Held:
    """What an env object holds on a server: its episode's session and its reference to a local server.
    Once :meth:`release` ran (``close``), nothing can be attached any more: a reset still starting in
    another thread (an abandoned call) gives back what it gets."""

    def __init__(self) -> None:
        self.session: Session | None = None
        self.server: LocalServer | None = None
        self.closed = False
        self._lock = threading.Lock()

    def attach_server(self, server: LocalServer) -> None:
        with self._lock:
            if not self.closed:
                self.server = server
                return
        release(server)
        raise EnvError(f"{ENV_ID} was closed while its server started")

    def attach_session(self, session: Session) -> None:
        with self._lock:
            if not self.closed:
                self.session = session
                return
        session.close()
        raise EnvError(f"{ENV_ID} was closed while an episode started")

    def end_session(self) -> None:
        with self._lock:
            session, self.session = self.session, None
        if session is not None:
            session.close()

    def release(self) -> None:
        with self._lock:
            self.closed = True
            server, self.server = self.server, None
        self.end_session()
        if server is not None:
            release(server)


class OpenEnvEnv(TextEnv):
    """An OpenEnv server's environment, one WebSocket session per episode.

    Args:
        env: ``http://HOST:PORT`` of a running server; ``"<module>:<attr>"`` (a FastAPI app or an
            openenv ``Environment`` subclass, importable from the working directory) or the name of
            an installed ``openenv-<name>`` package (:func:`available`), served by a local process.
        num_tasks: reset seeds ``0 .. num_tasks-1``, the tasks of both splits.
        heldout_fraction: share of seeds held out (by a hash of the task id), in [0, 1].
        split: the split ``reset`` draws from when no task is given.
        reset_kwargs: more keyword arguments for the server's ``reset`` (beside ``seed``).
        text_field: send the reply's text in this action field (default: the action's only field,
            when it is a string; otherwise the action is a tool).
        tool_name: the name of the tool that stands for a structured action.
        observation_fields: the observation fields that make the message (default: the only string
            field, else all fields as JSON).
        instruction: text appended to the opening observation.
        max_steps: steps after which an episode the server has not ended is truncated.
        timeout_s: bound on every server call (connect, reset, step, schema).
        session_wait_s: how long ``reset`` waits for a free session on a full server.
        start_timeout_s: bound on a local server's start (import and ``/health``).
        keep_alive_s: seconds an unused local server waits for the next episode (0: stop it at the
            last ``close``).
        max_sessions: concurrent sessions a local ``Environment`` class target is served with (when it
            declares ``SUPPORTS_CONCURRENT_SESSIONS``).

    Raises:
        ConfigError: a malformed or unknown target, openenv-core missing for a local target
            (naming ``relax-agent[openenv]``), or an argument outside its range.
    """

    reward_description = ("the OpenEnv server's own reward: each step's observation reward (None counts 0.0), "
                          "summed over the episode by the rollout driver, i.e. the server's return; steps the "
                          "server refuses (invalid action fields) score 0.0")

    def __init__(self, env: str = "", *, num_tasks: int = 1000, heldout_fraction: float = 0.2, split: str = "train",
                 reset_kwargs: dict[str, Any] | None = None, text_field: str | None = None, tool_name: str = "act",
                 observation_fields: list[str] | None = None, instruction: str = "", max_steps: int = 32,
                 timeout_s: float = 30.0, session_wait_s: float = 60.0, start_timeout_s: float = 180.0,
                 keep_alive_s: float = 60.0, max_sessions: int = 64) -> None:
        super().__init__()
        check_split_args(split, heldout_fraction)
        _check_ranges(num_tasks=num_tasks, max_steps=max_steps, max_sessions=max_sessions, timeout_s=timeout_s,
                      session_wait_s=session_wait_s, start_timeout_s=start_timeout_s, keep_alive_s=keep_alive_s)
        if not isinstance(tool_name, str) or not tool_name.isidentifier():
            raise ConfigError(f"tool_name={tool_name!r}; expected a tool name such as 'act'")
        if observation_fields is not None and (not isinstance(observation_fields, (list, tuple))
                                               or not all(isinstance(f, str) for f in observation_fields)):
            raise ConfigError(f"observation_fields={observation_fields!r}; expected a list of field names")
        self.kind, self.target = target_kind(env)
        self._prepare_target(env)
        self.split, self.heldout_fraction = split, heldout_fraction
        self.reset_kwargs = dict(reset_kwargs or {})
        self.text_field, self.tool_name = text_field, tool_name
        self.observation_fields = list(observation_fields) if observation_fields else None
        self.instruction, self.max_steps = instruction, max_steps
        self.timeout_s, self.session_wait_s, self.start_timeout_s = timeout_s, session_wait_s, start_timeout_s
        self.keep_alive_s, self.max_sessions = keep_alive_s, max_sessions
        self._tasks = [{"id": f"seed-{i}", "seed": i} for i in range(num_tasks)]
        if not self.tasks(split):
            raise ConfigError(f"num_tasks={num_tasks} with heldout_fraction={heldout_fraction} leaves no {split!r} "
                              "task; raise num_tasks")
        self._schema: dict[str, Any] | None = None
        self._tools: list[dict[str, Any]] = []
        self._held = _Held()
        self._finalizer = weakref.finalize(self, self._held.release)
        self._steps = 0
        self._ended = True
        self._ended_at_reset = False

    def _prepare_target(self, env: str) -> None:
        from relax_agent.envs.bridges import require

        if self.kind == "url":
            try:
                import websockets.sync.client  # noqa: F401 - the only package a URL target needs
            except ImportError as exc:
                raise ConfigError(f"{ENV_ID} needs the 'websockets' package to talk to {self.target}: "
                                  f"pip install 'relax-agent[openenv]' ({exc})") from exc
            return
        require("openenv")
        if self.kind == "module":
            check_module(self.target)
            return
        names = installed()
        if self.target not in names:
            raise ConfigError(f"openenv:{env}: no installed OpenEnv environment {self.target!r} (installed: "
                              f"{sorted(names) or 'none'}); give a server URL (openenv:http://127.0.0.1:8000) or a "
                              "module target (openenv:my_envs.guess:app)")
        self.kind, self.target = "module", names[self.target]

    # -- tasks -----------------------------------------------------------------------------------
    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """``{"id": "seed-N", "seed": N}`` task dicts of ``split`` (disjoint by a hash of the id).

        Raises:
            DataError: unknown split.
        """
        return split_tasks(self._tasks, split, self.heldout_fraction)

    @property
    def url(self) -> str:
        """The server's base URL (a local server's once started; empty before)."""
        if self.kind == "url":
            return self.target
        return self._held.server.url if self._held.server is not None else ""

    @property
    def server_pid(self) -> int | None:
        """The process id of the local server this env uses (None for a URL target or before a reset)."""
        return self._held.server.pid if self._held.server is not None else None

    # -- episodes --------------------------------------------------------------------------------
    def _server_url(self) -> str:
        if self.kind == "url":
            return self.target
        server = self._held.server
        if server is None:
            server = acquire(self.target, max_sessions=self.max_sessions, keep_alive_s=self.keep_alive_s,
                             start_timeout_s=self.start_timeout_s)
            self._held.attach_server(server)
            return server.url
        return server.ensure(self.start_timeout_s)

    def _setup(self, url: str) -> None:
        """Read the action schema once: text field or tool."""
        if self._schema is not None:
            return
        schema = fetch_schema(url, self.timeout_s)
        action = schema["action"]
        fields = action.get("properties") or {}
        if self.text_field is not None and self.text_field not in fields:
            raise ConfigError(f"text_field={self.text_field!r}: the action of {url} has no such field (fields: "
                              f"{sorted(k for k in fields if k != 'metadata')})")
        self.text_field = self.text_field or only_text_field(action)
        self._tools = [] if self.text_field else [action_tool(action, self.tool_name)]
        self._schema = schema

    def _open(self, reset_data: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._open_once(reset_data)
        except EnvError:
            server = self._held.server
            if server is None or not _went_away(server):
                raise
        server.ensure(self.start_timeout_s)  # it crashed between episodes: once more, on a new one
        return self._open_once(reset_data)

    def _open_once(self, reset_data: dict[str, Any]) -> dict[str, Any]:
        url = self._server_url()
        self._setup(url)
        return self._new_session(url).open(reset_data)

    def _new_session(self, url: str) -> Session:
        session = Session(url, self.timeout_s, self.session_wait_s)
        self._held.attach_session(session)
        return session

    def _reset_task(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if self._held.closed:
            raise EnvError(f"{ENV_ID} is closed; make a new env")
        self._held.end_session()
        self._ended = True
        if not isinstance(task.get("seed"), int):
            raise EnvError(f"{ENV_ID} task needs an integer 'seed', got {task!r}")
        payload = self._open({**self.reset_kwargs, "seed": task["seed"]})
        self._steps, self._ended = 0, False
        self._ended_at_reset = bool(payload.get("done"))
        text = observation_text(payload.get("observation", {}), self.observation_fields)
        if self.instruction:
            text = f"{text}\n\n{self.instruction}" if text else self.instruction
        tools = json.loads(json.dumps(self._tools))
        return [{"role": "user", "content": text}], {"tools": tools, "task_id": task.get("id"), "seed": task["seed"]}

    def step(self, action: dict[str, Any]):
        """Send the reply (its text, or its call of the action tool) as one action.

        Returns:
            ``(messages, reward, terminated, truncated, info)``: the observation as a user message
            (text actions) or a tool message answering the call (tool actions; other calls get
            ``error: ...`` tool messages and are not sent); the server's reward (0.0 for a refused
            or unsent action); ``terminated`` when the server says done, or when a tool-action
            reply calls no tool; ``truncated`` at ``max_steps``. ``info``: ``steps`` so far and
            ``refused`` (1.0 when the server refused this step's action fields).

        Raises:
            EnvError: ``step`` before ``reset`` or after the episode ended, a non-dict action, or
                the server failing (dead, slow, an error other than a refused action).
        """
        session = self._held.session
        if session is None or self._ended:
            raise EnvError(f"{type(self).__name__}.step() needs a fresh episode: call reset() first")
        if not isinstance(action, dict):
            raise EnvError(f"action must be an assistant message dict, got {type(action).__name__}")
        self._steps += 1
        if self._ended_at_reset:
            return self._finish([], 0.0, True, False, 0.0)
        if self.text_field:
            data = {self.text_field: str(action.get("content") or "")}
            try:
                payload = self._send(session, data)
            except ActionRefused as exc:
                return self._finish([_user(f"error: the environment refused the action: {exc}")], 0.0, False,
                                    self._steps >= self.max_steps, 1.0)
            text = observation_text(payload.get("observation", {}), self.observation_fields)
            return self._finish([_user(text)], reward_of(payload), bool(payload.get("done")),
                                self._steps >= self.max_steps, 0.0)
        return self._tool_step(session, action)

    def _tool_step(self, session: Session, action: dict[str, Any]):
        calls = action.get("tool_calls") or []
        errors = action.get("parse_errors") or []
        if not isinstance(calls, list):
            raise EnvError(f"action['tool_calls'] must be a list, got {type(calls).__name__}")
        if not calls and not errors:
            return self._finish([], 0.0, True, False, 0.0)  # a reply without a call gives up the episode
        out: list[dict[str, Any]] = []
        payload: dict[str, Any] | None = None
        refused = 0.0
        for call in calls:
            cid, name, args = call_parts(call)
            if payload is not None or refused:
                text = "error: one action per turn; this call was not run"
            elif name != self.tool_name:
                text = f"error: unknown tool {name!r}; the only tool is {self.tool_name!r}"
            elif not isinstance(args, dict):
                text = "error: the arguments must be a JSON object of the action's fields"
            else:
                try:
                    payload = self._send(session, args)
                    text = observation_text(payload.get("observation", {}), self.observation_fields)
                except ActionRefused as exc:
                    refused, text = 1.0, f"error: the environment refused the action: {exc}"
            out.append({"role": "tool", "tool_call_id": cid, "name": name, "content": text})
        out += [{"role": "tool", "tool_call_id": "", "name": "", "content": f"error: could not parse a tool call: {e}"}
                for e in errors]
        if payload is None:
            return self._finish(out, 0.0, False, self._steps >= self.max_steps, refused)
        return self._finish(out, reward_of(payload), bool(payload.get("done")), self._steps >= self.max_steps, 0.0)

    def _send(self, session: Session, data: dict[str, Any]) -> dict[str, Any]:
        """One action to the server; a failure other than a refused action ends the episode."""
        try:
            return session.step(data)
        except ActionRefused:
            raise
        except BaseException:
            self._ended = True
            self._held.end_session()
            raise

    def _finish(self, messages: list[dict[str, Any]], reward: float, done: bool, at_limit: bool, refused: float):
        truncated = at_limit and not done
        if done or truncated:
            self._ended = True
            self._held.end_session()
        return messages, float(reward), bool(done), bool(truncated), {"steps": float(self._steps), "refused": refused}

    def close(self) -> None:
        """End the open session (the server closes its environment) and drop this env's hold on a
        local server (the last one stops it, see ``keep_alive_s``); idempotent and final (a reset
        after it raises EnvError), callable from any thread."""
        self._ended = True
        self._held.release()


def _went_away(server: LocalServer, wait_s: float = 1.0) -> bool:
    """Whether the local server's process has exited (waiting up to ``wait_s`` for one that is quitting)."""
    import subprocess

    proc = server.proc
    if proc is None:
        return True
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _check_ranges(**values: float) -> None:
    minimum = {"num_tasks": 1, "max_steps": 1, "max_sessions": 1, "keep_alive_s": 0}
    for key, value in values.items():
        low = minimum.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and (value >= low if low is not None else value > 0)
        if not ok or (key in ("num_tasks", "max_steps", "max_sessions") and not isinstance(value, int)):
            want = f"an integer >= {low}" if key in ("num_tasks", "max_steps", "max_sessions") else (
                "a number >= 0" if low is not None else "a number of seconds > 0")
            raise ConfigError(f"{key}={value!r}; expected {want}")


def available() -> list[str]:
    """Names of the installed OpenEnv environments this bridge can start locally (``env.id:
    "openenv:<name>"``): ``openenv-<name>`` packages that ship ``<name>/server/app.py``. openenv-core
    itself ships none (its ``openenv init`` template is a scaffold, not an importable env).

    Raises:
        ConfigError: openenv-core is not installed (naming the extra).
    """
    from relax_agent.envs.bridges import require

    require("openenv")
    return sorted(installed())


__all__ = ["ENV_ID", "OpenEnvEnv", "available", "target_kind"]
