"""ToolEnv: a multi-turn environment whose tools are plain Python functions.

Write the tools as functions with type hints and a Google-style docstring; their JSON schemas
come from ``transformers.utils.get_json_schema``. Subclasses give the opening messages and judge
the final answer::

    class Calc(ToolEnv):
        def __init__(self):
            super().__init__(tools=[self.add])

        def add(self, a: float, b: float) -> float:
            '''Add two numbers.

            Args:
                a: The first number.
                b: The second number.
            '''
            return a + b

        def tasks(self, split="train"):
            return [{"id": "t0", "question": "What is 2 + 3?", "answer": 5}]

        def prompt(self, task):
            return [{"role": "user", "content": task["question"]}]

        def score(self, message):
            return float(message["content"].strip() == str(self.task["answer"])), {}

An assistant message with tool calls runs them (in order) and returns one ``tool`` message per
call; a message without tool calls is the final answer: :meth:`ToolEnv.score` judges it and the
episode ends. A tool that raises, gets bad arguments, is unknown or runs past ``tool_timeout_s``
yields a ``tool`` message starting with ``error:`` instead of crashing the episode. Tools may be
``async def``; :meth:`ToolEnv.astep` awaits them (the rollout driver prefers it), :meth:`ToolEnv.step`
runs them too, so the env works with plain gymnasium code.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from relax_agent.envs.base import TextEnv
from relax_agent.errors import ConfigError, EnvError

TRUNCATION_MARKER = "\n[... truncated {n} characters]"
"""Appended to an observation cut at ``max_observation_chars`` (``{n}``: characters dropped)."""


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI tool schema of ``fn`` (from its type hints and Google-style docstring).

    Raises:
        ConfigError: ``fn`` lacks a docstring, a type hint, or an ``Args:`` line for a parameter.
    """
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers raises its own exception types for each gap
        name = getattr(fn, "__name__", repr(fn))
        raise ConfigError(f"tool {name!r}: {exc} (tools need type hints and a docstring with an Args: section)") from exc
    schema["function"].pop("return", None)
    return schema


def truncate(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters plus :data:`TRUNCATION_MARKER` when longer."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + TRUNCATION_MARKER.format(n=len(text) - max_chars)


async def call_in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await ``fn(*args, **kwargs)`` run in a fresh daemon thread.

    Unlike ``asyncio.to_thread``, a call that never returns does not hold up ``asyncio.run``'s
    executor shutdown or interpreter exit: after a timeout (``asyncio.wait_for``) the thread is
    abandoned. Exceptions propagate to the awaiting task.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def work() -> None:
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            _post(loop, settle, False, exc)
        else:
            _post(loop, settle, True, out)

    threading.Thread(target=work, name=f"env-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed while the abandoned call was still running
        pass


def action_calls(action: Any) -> list[Any]:
    """The ``tool_calls`` of an assistant message (empty when it has none).

    Raises:
        EnvError: ``action`` is not a dict, or its ``tool_calls`` is not a list.
    """
    if not isinstance(action, dict):
        raise EnvError(f"action must be an assistant message dict, got {type(action).__name__}")
    calls = action.get("tool_calls") or []
    if not isinstance(calls, list):
        raise EnvError(f"action['tool_calls'] must be a list, got {type(calls).__name__}")
    return calls


def call_parts(call: Any) -> tuple[str, str, Any]:
    """(id, name, arguments) of an OpenAI-format or flat ``{"name", "arguments"}`` tool call; JSON-string
    arguments decoded (None when they are not valid JSON)."""
    if not isinstance(call, dict):
        return "", "", None
    function = call.get("function", call)
    function = function if isinstance(function, dict) else {}
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = None
    return str(call.get("id") or ""), str(function.get("name") or ""), args


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


class ToolEnv(TextEnv):
    """A :class:`TextEnv` whose tools are Python callables; subclasses implement ``tasks``,
    :meth:`prompt` and :meth:`score`.

    Args:
        tools: the callables offered to the model (functions or bound methods), each with type
            hints and a docstring; names must be unique.
        max_tool_calls_per_turn: calls run per assistant message; later ones get an error message.
        max_observation_chars: longest tool result or tool error (characters) before it is cut
            with :data:`TRUNCATION_MARKER` (the env's own short refusals are never cut).
        tool_timeout_s: seconds one tool call may take; a slower call becomes an error message
            (a sync tool's thread is abandoned, an async tool is cancelled).

    Raises:
        ConfigError: a limit out of range, duplicate tool names, or a tool without a schema.
    """

    def __init__(self, tools: Sequence[Callable[..., Any]] = (), *, max_tool_calls_per_turn: int = 4,
                 max_observation_chars: int = 2000, tool_timeout_s: float = 10.0) -> None:
        super().__init__()
        if max_tool_calls_per_turn < 1 or max_observation_chars < 1 or not tool_timeout_s > 0:
            raise ConfigError(
                "need max_tool_calls_per_turn >= 1, max_observation_chars >= 1 and tool_timeout_s > 0; got "
                f"{max_tool_calls_per_turn}, {max_observation_chars}, {tool_timeout_s}"
            )
        self.tools = {fn.__name__: fn for fn in tools}
        if len(self.tools) != len(tools):
            raise ConfigError(f"tool names must be unique, got {[fn.__name__ for fn in tools]}")
        self.tool_schemas = [tool_schema(fn) for fn in tools]
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.max_observation_chars = max_observation_chars
        self.tool_timeout_s = tool_timeout_s
        self.num_tool_calls = 0
        self.num_tool_errors = 0
        self._done = True

    # -- hooks -----------------------------------------------------------------------------------
    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The opening messages of an episode on ``task``."""
        raise NotImplementedError

    def score(self, message: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """Judge the final assistant message (one without tool calls): ``(reward, info)``."""
        raise NotImplementedError

    # -- gymnasium API ---------------------------------------------------------------------------
    def _reset_task(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.num_tool_calls = self.num_tool_errors = 0
        self._done = False
        tools = json.loads(json.dumps(self.tool_schemas))
        return self.prompt(task), {"tools": tools, "task_id": task.get("id")}

    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Async ``reset``: the same episode start, run in a worker thread so a subclass's
        blocking set-up never stalls the event loop (override with ``async def`` for async I/O)."""
        return await call_in_thread(self.reset, seed=seed, options=options)

    def step(self, action: dict[str, Any]):
        """Run the message's tool calls, or judge it as the final answer.

        Returns:
            With tool calls (or unparsable ones): ``(tool messages, 0.0, False, False, info)``.
            Without: ``([], reward, True, False, info)`` with ``score``'s info. ``info`` always
            holds ``tool_calls`` and ``tool_errors`` (counts so far in the episode).

        Raises:
            EnvError: ``step`` before ``reset`` or after the episode ended, or a non-dict action.
        """
        calls = self._begin_step(action)
        if calls is None:
            return self._finish(action)
        return self._observe([self._run_sync(c) for c in calls[: self.max_tool_calls_per_turn]], action, calls)

    async def astep(self, action: dict[str, Any]):
        """Async :meth:`step`: tools run one after another, async tools awaited on the caller's loop,
        sync tools and :meth:`score` in worker threads."""
        calls = self._begin_step(action)
        if calls is None:
            return await call_in_thread(self._finish, action)
        return self._observe([await self._run_async(c) for c in calls[: self.max_tool_calls_per_turn]], action, calls)

    # -- internals -------------------------------------------------------------------------------
    def _begin_step(self, action: Any) -> list[Any] | None:
        if self.task is None or self._done:
            raise EnvError(f"{type(self).__name__}.step() needs a fresh episode: call reset() first")
        calls = action_calls(action)
        return calls if calls or action.get("parse_errors") else None

    def _finish(self, action: dict[str, Any]):
        self._done = True
        reward, info = self.score(action)
        return [], float(reward), True, False, {**self._counts(), **info}

    def _counts(self) -> dict[str, float]:
        return {"tool_calls": float(self.num_tool_calls), "tool_errors": float(self.num_tool_errors)}

    def _observe(self, results: list[tuple[str, str, str]], action: dict[str, Any], calls: list[Any]):
        over = calls[self.max_tool_calls_per_turn:]
        results += [(*call_parts(c)[:2],
                     f"error: at most {self.max_tool_calls_per_turn} tool calls per turn; this call was not run")
                    for c in over]
        results += [("", "", f"error: could not parse a tool call: {e}") for e in action.get("parse_errors") or []]
        self.num_tool_calls += len(calls)
        self.num_tool_errors += sum(text.startswith("error:") for *_, text in results)
        obs = [{"role": "tool", "tool_call_id": cid, "name": name, "content": text} for cid, name, text in results]
        return obs, 0.0, False, False, self._counts()

    def _lookup(self, call: Any) -> tuple[str, str, Callable[..., Any] | None, Any, str | None]:
        cid, name, args = call_parts(call)
        fn = self.tools.get(name)
        if fn is None:
            return cid, name, None, args, f"error: unknown tool {name!r}; available: {sorted(self.tools)}"
        if not isinstance(args, dict):
            return cid, name, None, args, "error: arguments must be a JSON object"
        return cid, name, fn, args, None

    def _run_sync(self, call: Any) -> tuple[str, str, str]:
        cid, name, fn, args, error = self._lookup(call)
        if error is not None:
            return cid, name, error
        assert fn is not None  # _lookup returns a tool exactly when it returns no error
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                out = fn(**args)
                # asyncio.run takes coroutines only; another awaitable makes it raise, and that error
                # becomes the tool message like any other
                box["value"] = asyncio.run(out) if inspect.isawaitable(out) else out  # type: ignore[arg-type]
            except BaseException as exc:  # noqa: BLE001 - becomes the tool message
                box["error"] = exc

        thread = threading.Thread(target=work, name=f"tool-{name}", daemon=True)
        thread.start()
        thread.join(self.tool_timeout_s)
        if thread.is_alive():
            return cid, name, self._timeout_text(name)
        return cid, name, self._result_text(name, box.get("value"), box.get("error"))

    async def _run_async(self, call: Any) -> tuple[str, str, str]:
        cid, name, fn, args, error = self._lookup(call)
        if error is not None:
            return cid, name, error
        assert fn is not None  # _lookup returns a tool exactly when it returns no error
        try:
            if inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(fn(**args), self.tool_timeout_s)
            else:
                value = await asyncio.wait_for(call_in_thread(fn, **args), self.tool_timeout_s)
        except asyncio.TimeoutError:
            return cid, name, self._timeout_text(name)
        except Exception as exc:  # noqa: BLE001 - becomes the tool message
            return cid, name, self._result_text(name, None, exc)
        return cid, name, self._result_text(name, value, None)

    def _timeout_text(self, name: str) -> str:
        return f"error: tool {name!r} did not finish within {self.tool_timeout_s:g} s"

    def _result_text(self, name: str, value: Any, error: BaseException | None) -> str:
        if error is None:
            text = _to_text(value)
        elif isinstance(error, TypeError) and "argument" in str(error):
            text = f"error: bad arguments for {name!r}: {error}"
        else:
            text = f"error: {type(error).__name__}: {error}"
        return truncate(text, self.max_observation_chars)


__all__ = ["TRUNCATION_MARKER", "ToolEnv", "call_in_thread", "tool_schema", "truncate"]
