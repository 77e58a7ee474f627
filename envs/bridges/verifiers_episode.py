"""One verifiers episode at a time, with relax-agent's policy as the model (:class:`EpisodeDriver`).

An episode is verifiers' ``Env.run_episode`` without its serving machinery: ``Env.setup``,
``Env.run(task, agents)`` (a bare taskset: one ``agent`` that runs the task, as ``SingleAgentEnv``),
``Env.finalize``. Each role is a :class:`BridgeAgent` whose ``run`` and ``interaction`` open a
:class:`~relax_agent.envs.bridges.verifiers_harness.ChatRun`; every model call lands in
:meth:`EpisodeDriver.ask`, which hands it to relax-agent and waits for the policy's reply. The
driver's coroutines run on the env's private loop
(:class:`~relax_agent.envs.bridges.verifiers_harness.LoopThread`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.agent import Interaction
from verifiers.v1.configs.agent import agent_config_fields, resolve_agent
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import boundary
from verifiers.v1.utils.loaders import harness_config_type

from relax_agent.envs.bridges.verifiers_harness import MODEL, ChatRun, ToolBox
from relax_agent.errors import ConfigError, EnvError


class BridgeAgent:
    """One env role, played by relax-agent's policy through the null harness: ``run(task)`` and
    ``interaction(task)`` as on :class:`verifiers.v1.Agent`, one rollout per episode."""

    def __init__(self, name: str, config: Any, driver: EpisodeDriver, traces: list[Any]) -> None:
        self.name, self.driver, self._traces = name, driver, traces
        self.config = resolve_agent(config, model=MODEL, harness=harness_config_type("null")(id="null"))
        self.trainable = True

    def _new_run(self, task: Any, runtime: Any, *, has_user: bool) -> ChatRun:
        if runtime is not None:
            raise EnvError(f"verifiers env placed agent {self.name!r} in a borrowed runtime; the relax-agent bridge "
                           "runs no runtime boxes")
        self.driver.claim(self.name)
        run = ChatRun(task, self.config, self.driver, has_user=has_user)
        run.trace.agent.name, run.trace.agent.trainable = self.name, self.trainable
        return run

    async def run(self, task: Any, *, runtime: Any = None, **_: Any) -> Any:
        """One segment on the task's prompt, then finalize and score (``Agent.run``); returns the trace."""
        run = self._new_run(task, runtime, has_user=False)
        try:
            if await run.open():
                await run.step()
                if run.ok:
                    run.trace.stop("agent_completed")
            trace = await run.close()
        except BaseException:
            await run.abort()
            raise
        self._traces.append(trace)
        return trace

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, *, runtime: Any = None, **_: Any) -> AsyncIterator[Any]:
        """verifiers' :class:`~verifiers.v1.Interaction` over a bridge rollout (``Agent.interaction``): the
        caller is the user; leaving closes the exchange (``user_closed``), finalizes and scores."""
        run = self._new_run(task, runtime, has_user=True)
        interaction = Interaction(run)  # type: ignore[arg-type]  # ChatRun has the Rollout surface it drives
        if not await run.open() and run.failure is not None:
            self._traces.append(await run.close())
            raise run.failure
        try:
            yield interaction
        except Exception as exc:
            run.fail(exc)
            raise
        except BaseException:
            await run.abort()
            raise
        finally:
            trace = run.trace if run.closed else await interaction.close()
            self._traces.append(trace)


@dataclass
class Finished:
    """An episode that ended: its traces (one here), verifiers' reward and why it stopped."""

    traces: list[Any]
    errors: list[str] = field(default_factory=list)

    @property
    def reward(self) -> float:
        """The summed weighted rewards of the traces (``Trace.reward``)."""
        return float(sum(trace.reward for trace in self.traces))


@dataclass
class Ask:
    """The harness waits for the policy: the request's messages (chat wire dicts) and tool schemas."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


class EpisodeDriver:
    """Plays episodes of a verifiers env with relax-agent's policy as the model; every method is a
    coroutine for the private loop (:class:`LoopThread`).

    Args:
        env: a ``vf.Env`` (its ``setup``/``run``/``finalize`` drive the episode), or None to play a bare
            taskset with one ``agent`` (``SingleAgentEnv``).
        taskset: the ``vf.Taskset`` the tasks come from (its ``toolsets`` are shared by the episodes).
        max_turns: caps every role's model turns (verifiers' ``max_turns`` limit); None keeps the roles' own.
    """

    def __init__(self, env: Any, taskset: Any, max_turns: int | None = None) -> None:
        self.env, self.taskset, self.max_turns = env, taskset, max_turns
        self.config = env.config if env is not None else vf.SingleAgentEnvConfig()
        self._shared: ToolBox | None = None
        self._episode: asyncio.Task[Finished] | None = None
        self._asks: asyncio.Queue[Ask] | None = None
        self._reply: asyncio.Future[dict[str, Any]] | None = None
        self._runs: list[str] = []

    async def shared_tools(self) -> ToolBox:
        """The taskset's shared tool servers, set up once per driver."""
        if self._shared is None:
            box = ToolBox()
            await box.add(type(self.taskset).toolsets(self.taskset.config))
            self._shared = box
        return self._shared

    def claim(self, role: str) -> None:
        """Register the episode's rollout.

        Raises:
            EnvError: a second rollout in the same episode (several agents, best-of-n, a re-run): a
                relax-agent episode is one conversation.
        """
        if self._runs:
            raise EnvError(f"verifiers env started a second rollout (role {role!r}) after {self._runs[0]!r} in one "
                           "episode; the relax-agent bridge plays one conversation per episode (no multi-agent envs)")
        self._runs.append(role)

    async def ask(self, request: Any, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """Hand the request to relax-agent and wait for its reply (an assistant message on the chat wire)."""
        if self._reply is not None or self._asks is None:
            raise EnvError("verifiers env made concurrent model calls; the relax-agent bridge serves one at a time")
        self._reply = asyncio.get_running_loop().create_future()
        try:
            self._asks.put_nowait(Ask([message_to_wire(m) for m in request.messages], tools))
            return await self._reply
        finally:
            self._reply = None

    async def start(self, task: Any) -> Ask | Finished:
        """Begin an episode on ``task`` (dropping one still running) and play it to the first model call."""
        await self.cancel()
        self._asks, self._runs = asyncio.Queue(), []
        self._episode = asyncio.get_running_loop().create_task(self._play(task))
        return await self._next()

    async def advance(self, reply: dict[str, Any]) -> Ask | Finished:
        """Answer the pending model call with ``reply`` and play on to the next call or the episode's end.

        Raises:
            EnvError: no model call is pending (no episode, or it ended).
        """
        if self._reply is None or self._reply.done():
            raise EnvError("no verifiers model call is waiting for a reply: reset() first")
        self._reply.set_result(reply)
        return await self._next()

    async def _next(self) -> Ask | Finished:
        assert self._asks is not None and self._episode is not None
        getter = asyncio.ensure_future(self._asks.get())
        await asyncio.wait({getter, self._episode}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        return self._episode.result()

    async def _play(self, task: Any) -> Finished:
        """``Env.run_episode`` without the serving machinery: setup, run, finalize; failures are collected."""
        traces: list[Any] = []
        roles = {name: spec if self.max_turns is None else spec.model_copy(update={"max_turns": self.max_turns})
                 for name, spec in agent_config_fields(self.config).items()}
        agents = vf.Agents(self.config, lambda name, _: BridgeAgent(name, roles[name], self, traces))
        errors = []
        try:
            if self.env is None:
                await agents.agent.run(task)
            else:
                async with boundary(vf.EnvError, f"{type(self.env).__name__}.setup()"):
                    await self.env.setup(agents)
                async with boundary(vf.EnvError, f"{type(self.env).__name__}.run()"):
                    await self.env.run(task, agents)
                if not traces:
                    raise EnvError(f"{type(self.env).__name__}.run() ran no agent")
                episode = vf.Episode(env=vf.EnvInfo(id=self.config.env_id), task=traces[0].task, traces=traces)
                async with boundary(vf.EnvError, f"{type(self.env).__name__}.finalize()"):
                    await self.env.finalize(task, episode)
        except (ConfigError, EnvError):
            raise
        except Exception as exc:  # noqa: BLE001 - the episode failed: reported with its cause
            errors.append(f"{type(exc).__name__}: {exc}")
        errors += [f"{e.type}: {e.message}" for t in traces for e in t.errors]
        return Finished(traces, errors)

    async def cancel(self) -> None:
        """Drop the running episode, if any (its rollout is aborted, not scored)."""
        episode, self._episode = self._episode, None
        if episode is not None and not episode.done():
            episode.cancel()
            with contextlib.suppress(BaseException):
                await episode
        self._reply = None


__all__ = ["Ask", "BridgeAgent", "EpisodeDriver", "Finished"]
