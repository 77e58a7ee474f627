"""verifiers' ``null`` harness played in-process, with relax-agent as the model: one rollout (:class:`ChatRun`).

verifiers 0.4 (``verifiers.v1``) runs a rollout as a program (the *harness*) that calls the model
through an HTTP interception server, which records every turn on a :class:`verifiers.v1.Trace`,
runs the task's ``@vf.stop`` / ``@vf.intercept`` hooks and turn limits, and gates tool calls. Here
the same steps run in-process, step by step, with verifiers' own code wherever it is reachable:

* the conversation is the ``null`` harness's chat loop (``harnesses/utils/core.py``): the task's
  system prompt and prompt, the Toolset tools, a reply without tool calls ends the segment; a
  user's turn resumes it on the conversation so far (``Harness.resume``);
* each request is parsed by verifiers' chat dialect and checked by its ``RolloutSession`` (limits,
  stops, interceptors, tool gating), and each reply is committed to the trace's message graph
  (``graph.prepare_turn(...).commit``), as the interception server does;
* tools are the task's and taskset's ``vf.Toolset`` servers, called in-process through the MCP
  server they register with (same schemas, names ``<prefix>_<tool>``, results and errors);
* the rollout ends with ``Task.finalize`` and ``Task.score`` (``Rollout.close``).

The one model call that is not verifiers' is the policy's: ``driver.ask`` (see
:mod:`relax_agent.envs.bridges.verifiers_episode`) parks the request until relax-agent steps with the
sampled, already-parsed assistant message. This module imports verifiers at import time: only the
bridge's own modules import it, after ``require("verifiers")``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import verifiers.v1 as vf
from mcp.server.mcpserver import MCPServer
from verifiers import __version__
from verifiers.v1 import graph
from verifiers.v1.dialects.chat import ChatDialect, message_to_wire, parse_message
from verifiers.v1.errors import TaskError, ToolsetError, boundary
from verifiers.v1.harnesses.utils.compaction import bound_tool_message
from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content
from verifiers.v1.session import RolloutLimits, RolloutSession, hook_boundary
from verifiers.v1.state import state_cls
from verifiers.v1.trace import ModelCall, TimeSpan
from verifiers.v1.utils.decorators import discover_decorated, invoke

from relax_agent.errors import ConfigError

if TYPE_CHECKING:
    from relax_agent.envs.bridges.verifiers_episode import EpisodeDriver

MODEL = "relax-agent-policy"
"""The model name the traces record (the policy is relax-agent's)."""


class LoopThread:
    """A private asyncio event loop running in its own daemon thread, stopped and joined by :meth:`close`."""

    def __init__(self, name: str = "verifiers-bridge") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Schedule ``coro`` on the loop; the returned future settles with its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and wait for its result (blocking the calling thread)."""
        return self.submit(coro).result()

    async def acall(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and await its result without blocking the caller's loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel what still runs on the loop, stop it, join its thread and close it (idempotent). A loop still
        blocked after ``timeout_s`` (a tool that never yields) is left to its daemon thread."""
        if self.loop.is_closed():
            return
        try:
            self.submit(self._drain()).result(timeout_s)
        except Exception:  # noqa: BLE001, S110 - closing goes on whatever the episode's last state
            pass
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self.loop.close()

    async def _drain(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.loop.shutdown_asyncgens()
        await self.loop.shutdown_default_executor()


def check_toolset(toolset: Any) -> None:
    """Refuse a Toolset the in-process bridge cannot serve as verifiers would.

    Raises:
        ConfigError: its state is a ``vf.State`` subclass (synced over verifiers' HTTP state
            channel), or it points at a remote server (``config.url``).
    """
    name = type(toolset).__name__
    if state_cls(type(toolset)) is not vf.State:
        raise ConfigError(f"verifiers Toolset {name} keeps a {state_cls(type(toolset)).__name__} state, which verifiers "
                          "syncs over its HTTP state channel; the relax-agent bridge runs tools in-process and does "
                          "not support stateful toolsets (keep the state on the task's trace instead)")
    if getattr(toolset.config, "url", None):
        raise ConfigError(f"verifiers Toolset {name} points at a remote server ({toolset.config.url}); the relax-agent "
                          "bridge serves only in-process Toolsets")


class ToolBox:
    """Toolsets served in-process: each registers its ``@vf.tool`` methods with an MCP server, as its
    launched server would, and calls go straight to that server."""

    def __init__(self) -> None:
        self.servers: dict[str, MCPServer] = {}
        self.dispatch: dict[str, tuple[str, str]] = {}
        self.schemas: list[dict[str, Any]] = []

    async def add(self, toolsets: list[Any], task_data: Any = None) -> None:
        """Set up ``toolsets`` (``setup()``, and ``setup_task(task_data)`` for per-task ones) and list their tools.

        Raises:
            ConfigError: a toolset the bridge cannot serve (:func:`check_toolset`).
            ToolsetError: a setup hook failed, or two tools share a name.
        """
        for toolset in toolsets:
            check_toolset(toolset)
            name = toolset.server_name
            async with boundary(ToolsetError, f"tool server {name!r} setup"):
                await toolset.setup()
                if task_data is not None:
                    await toolset.setup_task(task_data)
            server = MCPServer(name or type(toolset).__name__, version=__version__)
            toolset.register(server)
            self.servers[name] = server
            for tool in await server.list_tools():
                full = f"{name}_{tool.name}" if name else tool.name
                if full in self.dispatch:
                    raise ToolsetError(f"duplicate tool name {full!r}; keep MCP tool names qualified")
                self.schemas.append({"type": "function", "function": {
                    "name": full, "description": tool.description or "", "parameters": tool.input_schema}})
                self.dispatch[full] = (name, tool.name)

    def merged(self, other: ToolBox) -> ToolBox:
        """A toolbox with this one's tools first, then ``other``'s (shared servers before per-task ones)."""
        box = ToolBox()
        for part in (self, other):
            box.servers.update(part.servers)
            box.dispatch.update(part.dispatch)
            box.schemas += part.schemas
        return box

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """The tool's result as chat content; a tool that raises gives its error text, as MCP reports it."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CallToolResult, TextContent

        server, raw = self.dispatch[name]
        try:
            result = await self.servers[server].call_tool(raw, arguments)
        except MCPError as exc:
            raise ToolsetError(f"tool {name!r}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - the MCP server hands the message back as an error result
            result = CallToolResult(content=[TextContent(type="text", text=str(exc))], is_error=True)
        return mcp_content_to_chat_content(getattr(result, "content", []))


class ChatRun:
    """One agent rollout: verifiers' ``Rollout`` with the ``null`` harness's chat loop run in-process.

    It has the surface :class:`verifiers.v1.Interaction` drives (``trace``, ``ok``, ``closed``,
    ``step``, ``close``, ``fail``, ``abort``, ``steer``).
    """

    def __init__(self, task: Any, config: Any, driver: EpisodeDriver, *, has_user: bool) -> None:
        self.task, self.driver, self.has_user = task, driver, has_user
        self.trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                              state=state_cls(type(task))(), agent=vf.AgentInfo(config=config))
        intercepts = [(hook_boundary(fn, allow_trace=False), fn) for fn in discover_decorated(task, "intercept")]
        stops = [(hook_boundary(fn, allow_trace=True), fn) for fn in task.hooks("stop")]
        self.session = RolloutSession(
            ctx=vf.ModelContext(model=MODEL, client=vf.EvalClientConfig()), trace=self.trace,
            trace_stops=[fn for kind, fn in stops if kind is vf.Trace],
            limits=RolloutLimits(max_turns=config.max_turns, max_input_tokens=config.max_input_tokens,
                                 max_output_tokens=config.max_output_tokens, max_total_tokens=config.max_total_tokens),
            request_interceptors=[fn for kind, fn in intercepts if kind is vf.Request],
            response_interceptors=[fn for kind, fn in intercepts if kind is vf.Response],
            request_stops=[fn for kind, fn in stops if kind is vf.Request],
            response_stops=[fn for kind, fn in stops if kind is vf.Response], gates_tools=True)
        self.data = task.data
        self.tools = ToolBox()
        self.failure: Exception | None = None
        self.closed = False
        self._opened = False

    @property
    def ok(self) -> bool:
        """Whether the exchange can go on: nothing failed and nothing stopped it."""
        return self.failure is None and self.trace.stop_condition is None

    def fail(self, error: Exception) -> None:
        """Record ``error`` as the rollout's outcome (on the trace; scoring is skipped)."""
        self.failure = error
        self.trace.record_error(error)

    async def open(self) -> bool:
        """Task setup (``runtime=None``: the bridge has no box), the task's tool servers, and the opening
        prompt's request interceptors; False when that failed or a hook already stopped the run."""
        self._opened = True
        try:
            if self.data.prompt is None and not self.has_user:
                raise TaskError("task has no prompt and no user to open the conversation")
            async with boundary(TaskError, "task setup"):
                await invoke(self.task.setup, {"trace": self.trace, "runtime": None})
            async with boundary(ToolsetError, "building tool servers"):
                toolsets = self.task.toolsets(self.task.config)
            await self.tools.add(toolsets, self.data)
            self.tools = (await self.driver.shared_tools()).merged(self.tools)
            if self.session.request_interceptors and self.data.prompt is not None:
                await self._prepare_prompt()
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - setup failures are the rollout's outcome, as in verifiers
            self.fail(exc)
            return False
        return not self.session.stopped

    async def _prepare_prompt(self) -> None:
        """``Rollout.open``'s pass of the request interceptors over the opening prompt."""
        prompt, system = self.data.prompt, self.data.system_prompt
        messages = [vf.UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt)
        if system is not None:
            messages.insert(0, vf.SystemMessage(content=system))
        prepared, rewrites = await self.session.prepare_users(vf.Request(messages=messages))
        self.trace.request_rewrites.extend(rewrites)
        out = prepared.messages[1:] if system is not None else prepared.messages
        single = isinstance(prompt, str) and len(out) == 1 and isinstance(out[0], vf.UserMessage)
        self.data = self.data.model_copy(update={"prompt": out[0].content if single else out})

    async def steer(self, message: str, *, message_id: str | None = None) -> dict:
        """Steering a running turn: the null harness does not support it.

        Raises:
            NotImplementedError: always (as verifiers' null harness session).
        """
        raise NotImplementedError("harness 'null' does not support steering")

    async def step(self, messages: Any = None, *, on_input: Any = None) -> bool:
        """One harness segment: launch on the task's prompt (``messages`` None), or resume the conversation
        with the user's ``messages``; True when the exchange can go on."""
        if not self._opened or self.closed or not self.ok:
            return False
        trace = self.trace
        turns_before, root_before = trace.num_turns, trace.root_reply
        trace.root_reply = None
        try:
            if messages is not None and self.session.request_interceptors:
                prepared, rewrites = await self.session.prepare_users(vf.Request(messages=messages))
                messages = prepared.messages
                trace.request_rewrites.extend(rewrites)
                if self.session.stopped:
                    return False
            self.session.on_turn_input = on_input
            await self._segment(messages)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the harness boundary records every rollout failure
            if not self.session.stopped:
                self.fail(exc)
            return False
        finally:
            self.session.on_turn_input = None
            if trace.num_turns == turns_before:
                trace.root_reply = root_before
        return self.ok and trace.num_turns > turns_before

    def _opening(self, messages: Any) -> list[dict[str, Any]]:
        """The chat program's first message list: the system prompt, then the prompt (launch) or the
        conversation so far plus the user's new messages (``Harness.resume``)."""
        system, prompt = self.data.system_prompt, self.data.prompt
        if messages is not None:
            branch = self.trace.branches[-1].messages if self.trace.branches else []
            prompt = [*(m for m in branch if m.role != "system" or system is None), *messages]
        conv: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            conv += [{"role": "user", "content": prompt}] if prompt else []
        elif prompt is not None:
            conv += [message_to_wire(m) for m in prompt]
        return conv

    async def _segment(self, messages: Any) -> None:
        """The null harness's ``run_chat_loop``: ask the model, run its tool calls, until a reply without calls."""
        conv = self._opening(messages)
        gated = bool(self.session.request_interceptors or self.session.request_stops)
        while True:
            reply = await self._model_call(conv)
            if reply is None:
                return
            conv.append(message_to_wire(reply))
            if not reply.tool_calls:
                return
            for call in reply.tool_calls:
                message: dict[str, Any] = {"role": "tool", "tool_call_id": call.id, "content": "", "name": call.name}
                error: str | None = None
                try:
                    arguments = json.loads(call.arguments or "{}")
                except json.JSONDecodeError as exc:
                    arguments, error = call.arguments, f"error: invalid JSON in tool arguments ({exc}); resend the call with valid JSON"
                if gated:
                    decision = await self.session.decide_tool(call.id, call.name, arguments)
                    if decision["action"] == "stop":
                        return
                    if decision["action"] == "deny":
                        conv.append(bound_tool_message(decision["message"]))
                        continue
                if error is None and not isinstance(arguments, dict):
                    error = (f"error: tool arguments must be a JSON object, got {type(arguments).__name__}; "
                             "resend as an object")
                if error is None:
                    error = None if call.name in self.tools.dispatch else f"error: unknown tool {call.name!r}"
                message["content"] = error if error is not None else await self._call_tool(call.name, arguments)
                conv.append(bound_tool_message(message))

    async def _call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        timeout = self.trace.agent.config.harness.tool_timeout
        try:
            return await asyncio.wait_for(self.tools.call(name, arguments), timeout)
        except TimeoutError as exc:
            raise ToolsetError(f"tool {name!r} did not answer within {timeout:g} s") from exc

    async def _model_call(self, conv: list[dict[str, Any]]) -> Any:
        """One intercepted model call, as verifiers' interception server handles it; None when a limit,
        a stop or a response hook ended the segment instead."""
        session, trace = self.session, self.trace
        if await session.refused() is not None:
            return None
        body: dict[str, Any] = {"messages": conv, **({"tools": self.tools.schemas} if self.tools.schemas else {})}
        request, rewrites, stopped = await session.rewrite_request(ChatDialect().parse_request(body))
        trace.request_rewrites.extend(rewrites)
        if stopped is not None:
            graph.prepare_turn(trace, request.messages, request.tools).commit_prompt()
            trace.stop(stopped)
            return None
        turn = graph.prepare_turn(trace, request.messages, request.tools)
        trace.preview(turn, turn.tail)
        if session.on_turn_input is not None:
            on_input, session.on_turn_input = session.on_turn_input, None
            on_input()
        started, node = time.time(), None
        try:
            message = parse_message(await self.driver.ask(request, self.tools.schemas))
            response = vf.Response(id=f"relax-{trace.num_turns}", created=int(started), model=MODEL, message=message,
                                   finish_reason="tool_calls" if message.tool_calls else "stop")
            response_rewrites: list[Any] = []
            if session.response_interceptors or session.response_stops:
                response, response_rewrites, stopped = await session.rewrite_response(response)
            if session.stopped:
                return None
            node = turn.commit(response)
        finally:
            if node is None:
                turn.abandon()
        session.consume_prepared(turn.tail)
        trace.response_rewrites.extend(response_rewrites)
        trace.calls.append(ModelCall(node=node, model=MODEL, endpoint="/chat/completions",
                                     finish_reason=response.finish_reason, time=TimeSpan(start=started, end=time.time())))
        if stopped is None:
            stopped = await session.gate_tool_calls(node)
        if stopped is not None:
            trace.stop(stopped)
            return None
        return response.message

    async def close(self) -> Any:
        """Finish the rollout (idempotent): task ``finalize`` and ``Task.score`` (skipped after a failure;
        a stopped run is scored), with the task's finalize/scoring timeouts; returns the trace."""
        if self.closed:
            return self.trace
        self.closed = True
        trace, timeout = self.trace, self.data.timeout
        try:
            if self.failure is None and self._opened:
                try:
                    async with asyncio.timeout(timeout.finalize), boundary(TaskError, "task finalize"):
                        await invoke(self.task.finalize, {"trace": trace, "runtime": None})
                except TimeoutError:
                    trace.record_timeout("finalize")
                try:
                    async with asyncio.timeout(timeout.scoring), boundary(TaskError, "scoring"):
                        await self.task.score(trace, None)
                except TimeoutError:
                    trace.record_timeout("scoring")
        except Exception as exc:  # noqa: BLE001 - recorded on the trace, as verifiers does
            self.fail(exc)
        finally:
            trace.is_completed, trace.ok = True, self.failure is None
        return trace

    async def abort(self) -> None:
        """Drop the rollout without finalizing or scoring."""
        self.closed = True


__all__ = ["MODEL", "ChatRun", "LoopThread", "ToolBox", "check_toolset"]
