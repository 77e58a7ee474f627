"""The agent-driven rollout driver (``rollout.driver: agent``): your agent program plays the episode.

For each episode :class:`AgentDriver` builds the env and resets it to the task (its opening
messages and tool schemas), then starts ``rollout.agent.command`` as its own process group
with, in its environment:

- ``OPENAI_BASE_URL``: the rollout's OpenAI-compatible endpoint on 127.0.0.1
  (:mod:`relax_agent.rollout.proxy.server`), ``OPENAI_API_KEY``: a key valid for this episode only;
  ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY``: the same endpoint and key as the ``anthropic``
  SDK reads them (its ``/v1/messages``);
- ``RELAX_TASK_FILE``: a JSON file ``{"id", "sample_id", "messages", "tools", "metadata"}``
  (``metadata``: the task dict's ``rollout.agent.task_keys``, none by default: the ground truth
  stays with the env);
- ``RELAX_OUTPUT_FILE``: where the agent may write JSON ``{"reward": float, "answer": str,
  "metrics": {name: number}}`` (all optional, unless ``rollout.agent.reward: agent`` needs ``reward``);
- ``TMPDIR``: the episode's private directory (mode 0700, removed after the episode; owned by
  the agent's own uid in a jail, see :mod:`relax_agent.rollout.agent_jail`);

and of relax-agent's own environment only ``rollout.agent.inherit_env`` (plus ``rollout.agent.env``).

Every request of the agent is answered by the policy and recorded token-in/token-out by the
episode's :class:`~relax_agent.rollout.proxy.session.AgentSession`. When the agent exits, the
episode's trajectory is the *trained chain*: the replies the agent kept (sent back in a later
request, verbatim or re-templated), ending at the last reply it was delivered, its final answer
(see the session's module doc). The chain's context holding that answer is the trajectory; the
earlier contexts it went through (before a request that re-templated its history or changed
``tools``) are its ``context_segments``, each trained once with the episode's advantage. Replies
off the chain (abandoned requests, unchosen ``n > 1`` siblings, side calls after the answer,
histories rewritten past recognition) are counted in the ``agent/*`` metrics (``agent/dropped_replies``), returned
after it by :meth:`AgentDriver.play_segments` (and as the trajectory's ``side_segments`` by
:meth:`AgentDriver.play`), written to the rollout dump after the episode, never trained or scored.

Reward (``rollout.agent.reward``): "env" steps the env once with the agent's final answer (the
last reply of the trained chain, or ``answer`` from the output file when given, which also ends
the chain at the reply with that content);
"agent" takes the output file's ``reward``. A configured reward service re-scores afterwards, as
for env-driven runs (the runner does that).

Faults are records, never exceptions: a non-zero exit (cause names the code and the end of the
agent's stderr), no request at all, a missing or bad output file, an env failure. Past
``rollout.agent.timeout_s`` (or the episode's ``episode_timeout_s``) the process group gets
SIGTERM, then SIGKILL after ``kill_grace_s``, and every generation still running for the session
is aborted in the engine before :meth:`AgentDriver.play` returns (a timeout record). When the
agent is gone, its process group is killed, and so is every process still carrying the episode's
key in its environment (:func:`kill_marked`: children that left the group with ``setsid``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import os
import secrets
import shutil
import signal
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_agent.envs.tool_env import call_in_thread
from relax_agent.errors import EnvError, SandboxError
from relax_agent.records import StopReason, Trajectory
from relax_agent.rollout.agent_cgroups import AgentCgroups, build_agent_cgroups
from relax_agent.rollout.agent_jail import (
    UidPool,
    episode_base,
    exposed_paths,
    jail_argv,
    resolve_isolation,
    unreachable_reason,
)
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import Deadline, EpisodeSpec, EpisodeTimeout
from relax_agent.rollout.engines.base import InferenceEngine, SamplingParams
from relax_agent.rollout.env_calls import EnvCalls, check_reset, check_step, close_env, numeric_info, step_timeout_cause
from relax_agent.rollout.parsers import ToolCallParser
from relax_agent.rollout.proxy.server import EndpointServer
from relax_agent.rollout.proxy.session import AgentSession
from relax_agent.rollout.recorder import TrajectoryRecorder, failed_episode

logger = logging.getLogger("relax_agent.rollout")

_STDERR_TAIL = 1500
"""Characters of the agent's stderr kept in a failed record's cause."""
_GROUPS_KEPT = 4096
"""Groups whose trained chains :meth:`AgentDriver._group_duplicate` remembers."""


class AgentDriver:
    """Plays each episode by running the user's agent against the policy's endpoint (a :class:`RolloutDriver`).

    Args:
        make_env: builds a fresh env per episode (for the task's opening messages and tools, and
            for scoring with ``reward="env"``).
        engine / renderer / parser: the policy, its chat template, its tool-call parser.
        cfg: the ``rollout.agent`` section (:class:`~relax_agent.config.AgentConfig`).

    The endpoint starts on the first episode and stops at :meth:`close`.
    """

    def __init__(self, make_env: Callable[[], Any], engine: InferenceEngine, renderer: ChatRenderer,
                 parser: ToolCallParser, cfg: Any) -> None:
        self.make_env = make_env
        self.engine = engine
        self.renderer = renderer
        self.parser = parser
        self.cfg = cfg
        self._group_chains: dict[str, set[str]] = {}
        self.isolation = resolve_isolation(cfg.isolation)
        """"namespace" or "none" (see :mod:`relax_agent.rollout.agent_jail`)."""
        self._base = episode_base(self.isolation)
        self._socket = self._base / "endpoint.sock" if self.isolation == "namespace" else None
        self._uids = UidPool()
        self._cgroups = self._limits() if self.isolation == "namespace" else None
        self.server = EndpointServer(cfg.port, cfg.model_name, cfg.max_request_bytes, cfg.large_request_bytes,
                                     large_request_bytes_per_s=cfg.large_request_bytes_per_s, hangup_grace_s=cfg.hangup_grace_s,
                                     unix_path=None if self._socket is None else str(self._socket))
        weakref.finalize(self, self.server.close)  # the runner has no close: stop the endpoint with the driver
        weakref.finalize(self, shutil.rmtree, self._base, True)
        if self._cgroups is not None:
            weakref.finalize(self, self._cgroups.close)

    def _limits(self) -> AgentCgroups | None:
        """Episode cgroups with ``memory_limit_mb`` and ``max_processes`` (None, with a warning, where
        this host has none to give)."""
        try:
            return build_agent_cgroups(self.cfg.memory_limit_mb, self.cfg.max_processes)
        except SandboxError as exc:
            logger.warning("jailed agents run without rollout.agent.memory_limit_mb and max_processes: %s", exc)
            return None

    def close(self) -> None:
        """Stop the endpoint (aborting what still runs) and remove the episode cgroups' parent. Idempotent."""
        self.server.close()
        if self._cgroups is not None:
            self._cgroups.close()

    async def play(self, spec: EpisodeSpec, params: SamplingParams) -> Trajectory:
        """Play ``spec`` with the agent; its trained chain's trajectory (its earlier contexts as
        ``context_segments``), carrying the episode's other segments as ``side_segments`` (see the
        module doc)."""
        primary, *side = await self.play_segments(spec, params)
        return dataclasses.replace(primary, side_segments=tuple(side)) if side else primary

    async def play_segments(self, spec: EpisodeSpec, params: SamplingParams) -> list[Trajectory]:
        """Play ``spec`` with the agent; the trained chain's trajectory first (its earlier contexts as
        ``context_segments``), then every other segment of the episode (side branches, same reward; a
        failed episode: one failed record)."""
        deadline = Deadline(min(spec.episode_timeout_s, self.cfg.timeout_s))
        try:
            env = await deadline.call(call_in_thread(self.make_env), "make_env", spec.step_timeout_s, step_timeout_cause(spec))
        except Exception as exc:  # a broken env constructor is a failed episode, not a crashed run
            return [failed_episode(spec, exc, during="make_env")]
        try:
            return await self._play_in(env, spec, params, deadline)
        finally:
            await close_env(env, spec.step_timeout_s)

    async def _play_in(self, env: Any, spec: EpisodeSpec, params: SamplingParams, deadline: Deadline) -> list[Trajectory]:
        calls = EnvCalls(env, spec, deadline)
        try:
            obs, info = check_reset(await calls.reset(seed=spec.seed, options={"task": spec.task}))
        except Exception as exc:
            return [TrajectoryRecorder(spec).fail_with(exc)]
        session = AgentSession(spec, f"relax-{secrets.token_urlsafe(24)}", self.engine, self.renderer, self.parser,
                               params, self.cfg.honor_request_sampling, self.cfg.model_name, task_messages=obs,
                               max_tokens_over_budget=self.cfg.max_tokens_over_budget,
                               max_sampled_tokens=self.cfg.max_episode_sampled_tokens)
        self.server.start()
        self.server.open(session)
        try:
            with tempfile.TemporaryDirectory(prefix="ep-", dir=self._base) as tmp:
                output = await self.run_agent(Path(tmp), spec, obs, info.get("tools", []), session, deadline)
        except Exception as exc:  # a crashed, failed or timed-out agent is a failed record
            await self.server.end(session)
            rec = session.trained() or TrajectoryRecorder(spec)
            return [rec.fail_with(exc)]
        except BaseException:
            await self.server.end(session)
            raise
        await self.server.end(session)
        return await self._finish(session, calls, spec, output)

    async def run_agent(self, tmp: Path, spec: EpisodeSpec, messages: list[dict[str, Any]], tools: list[Any],
                        session: AgentSession, deadline: Deadline) -> dict[str, Any]:
        """Run the agent with ``tmp`` as its ``TMPDIR`` (task and output files there) to its exit; its
        output file's JSON ({} when it wrote none). Under ``namespace`` isolation it runs as a uid of
        its own that owns ``tmp``, in the episode's cgroups when there are any.

        Raises:
            EpisodeTimeout: past the deadline (everything it started killed first).
            EnvError: as :meth:`_run_agent`; naming ``rollout.agent.memory_limit_mb`` when the kernel
                killed a process of the jail for it.
        """
        if self.isolation != "namespace":
            return await self._run_agent(tmp, spec, messages, tools, session, deadline, None)
        uid, cgroups = self._uids.acquire(), self._cgroups
        try:
            os.chown(tmp, uid, uid)
            procs = cgroups.create(tmp.name) if cgroups is not None else ()
            try:
                return await self._run_agent(tmp, spec, messages, tools, session, deadline, uid, procs)
            except EnvError as exc:
                raise self._memory_cause(tmp.name, exc) from exc
            finally:
                if cgroups is not None:
                    await asyncio.to_thread(cgroups.remove, tmp.name)
        finally:
            self._uids.release(uid)

    def _memory_cause(self, name: str, exc: EnvError) -> EnvError:
        """``exc`` naming ``rollout.agent.memory_limit_mb`` when the kernel killed a process of
        episode ``name`` for it."""
        kills = self._cgroups.oom_kills(name) if self._cgroups is not None else 0
        if not kills:
            return exc
        return EnvError(f"agent exceeded rollout.agent.memory_limit_mb={self.cfg.memory_limit_mb}: the kernel "
                        f"killed {kills} of its processes ({exc})")

    async def _run_agent(self, tmp: Path, spec: EpisodeSpec, messages: list[dict[str, Any]], tools: list[Any],
                         session: AgentSession, deadline: Deadline, uid: int | None,
                         cgroup_procs: tuple[str, ...] = ()) -> dict[str, Any]:
        """Run the agent (jailed as ``uid`` in the cgroups of ``cgroup_procs`` unless None) to its exit; its output file's JSON ({} when it
        wrote none).

        Raises:
            EpisodeTimeout: past the deadline (its process group killed first).
            EnvError: the agent exited non-zero, or wrote an output file that is not a JSON object.
        """
        task_file, out_file, log = tmp / "task.json", tmp / "output.json", tmp / "stderr.log"
        metadata = {k: spec.task[k] for k in self.cfg.task_keys if k in spec.task}
        task_file.write_text(json.dumps({"id": spec.task_id, "sample_id": spec.sample_id, "messages": messages,
                                         "tools": tools, "metadata": metadata}, default=str))
        env = {**agent_environment(os.environ, self.cfg.inherit_env), **self.cfg.env,
               "OPENAI_BASE_URL": self.server.base_url, "OPENAI_API_KEY": session.key, "TMPDIR": str(tmp),
               "ANTHROPIC_BASE_URL": self.server.root_url, "ANTHROPIC_API_KEY": session.key,
               "RELAX_TASK_FILE": str(task_file), "RELAX_OUTPUT_FILE": str(out_file)}
        argv = self._argv()
        if uid is not None:
            argv = jail_argv(uid, self._socket, self.server.port, argv, cgroup_procs,
                             exposed_paths(tmp, argv, self.cfg.cwd))
        with log.open("wb") as err:
            try:
                proc = await asyncio.create_subprocess_exec(*argv, cwd=self.cfg.cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                            stdout=asyncio.subprocess.DEVNULL, stderr=err,
                                                            start_new_session=True)
            except OSError as exc:
                raise EnvError(f"rollout.agent.command {self.cfg.command!r} could not start: {exc}") from exc
            try:
                code = await asyncio.wait_for(proc.wait(), max(deadline.remaining_s, 0.0))
            except asyncio.TimeoutError:
                await self._stop(proc)
                limit = ("rollout.agent.timeout_s" if self.cfg.timeout_s <= spec.episode_timeout_s
                         else "rollout.episode_timeout_s")
                raise EpisodeTimeout(f"agent exceeded {limit}={deadline.timeout_s}; its process group was killed and "
                                     "its running generations aborted") from None
            finally:
                if proc.returncode is None:  # cancelled: never leave the agent running
                    await self._stop(proc)
                _kill_group(proc.pid, signal.SIGKILL)  # processes the agent left behind
                await asyncio.to_thread(kill_marked, f"OPENAI_API_KEY={session.key}")  # and those that left its group
        if code != 0:
            tail = log.read_text(errors="replace")[-_STDERR_TAIL:].strip()
            raise EnvError(f"agent exited with code {code}" + (f"; its stderr ends: {tail}" if tail else ""))
        if not out_file.exists():
            return {}
        try:
            output = json.loads(out_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EnvError(f"the agent's RELAX_OUTPUT_FILE is not valid JSON: {exc}") from exc
        if not isinstance(output, dict):
            raise EnvError(f"the agent's RELAX_OUTPUT_FILE must hold a JSON object, got {type(output).__name__}")
        return output

    def _argv(self) -> list[str]:
        """``rollout.agent.command`` with ``{python}`` filled in.

        Raises:
            EnvError: its program is not an executable file or a command on PATH, or (jailed) a file it
                names is out of a jailed agent's reach (a jail would only say "exit 2" or "exit 127").
        """
        argv = [part.replace("{python}", sys.executable) for part in self.cfg.command]
        program = argv[0] if os.sep in argv[0] or self.cfg.cwd is None else os.path.join(self.cfg.cwd, argv[0])
        if shutil.which(program) is None and shutil.which(argv[0]) is None:
            raise EnvError(f"rollout.agent.command {self.cfg.command!r} could not start: {argv[0]!r} is not an "
                           "executable file or a command on PATH")
        if self.isolation != "namespace":
            return argv
        for part in argv:
            path = os.path.join(self.cfg.cwd or "", part)
            reason = unreachable_reason(path) if os.path.isfile(path) else None
            if reason is not None:
                raise EnvError(f"rollout.agent.command {self.cfg.command!r}: a jailed agent cannot read {path}: "
                               f"{reason}; or set rollout.agent.isolation=none")
        return argv

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM the agent's process group, SIGKILL it after ``kill_grace_s``, reap the agent."""
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.cfg.kill_grace_s)
        except asyncio.TimeoutError:
            pass
        _kill_group(proc.pid, signal.SIGKILL)
        await proc.wait()

    async def _finish(self, session: AgentSession, calls: EnvCalls, spec: EpisodeSpec,
                      output: dict[str, Any]) -> list[Trajectory]:
        answer = output.get("answer") if isinstance(output.get("answer"), str) else None
        recs = session.recorders(answer)
        if not recs:
            return [TrajectoryRecorder(spec).fail_with(EnvError("the agent made no chat completion requests"))]
        primary, contexts = recs[0], session.contexts(answer)
        try:
            metrics = {**session.metrics(answer), **_output_metrics(output),
                       "agent/group_duplicates": self._group_duplicate(spec, [*contexts, primary])}
            reward, env_metrics = await self._reward(calls, primary, output)
        except Exception as exc:
            return [primary.fail_with(exc)]
        metrics.update(env_metrics)
        out = []
        for rec in recs:
            last = rec.turns[-1]
            stop = StopReason.LENGTH if last.finish_reason == "length" else StopReason.TERMINATED
            out.append(rec.finish(reward, dict(metrics), stop))
        earlier = tuple(rec.finish(reward, dict(metrics), StopReason.CONTEXT) for rec in contexts)
        out[0] = dataclasses.replace(out[0], context_segments=earlier)
        return out

    def _group_duplicate(self, spec: EpisodeSpec, recs: list[TrajectoryRecorder]) -> float:
        """1.0 when an earlier episode of ``spec``'s group trained exactly the sampled tokens of ``recs``
        (its trained records: the group's samples collapsed, e.g. on a seed the agent fixed), else 0.0.
        Remembers the last :data:`_GROUPS_KEPT` groups."""
        key = hashlib.sha256(json.dumps([list(t.token_ids) for rec in recs for t in rec.turns]).encode()).hexdigest()
        seen = self._group_chains.pop(spec.group_id, set())
        self._group_chains[spec.group_id] = seen  # most recent last
        while len(self._group_chains) > _GROUPS_KEPT:
            self._group_chains.pop(next(iter(self._group_chains)))
        duplicate = key in seen
        seen.add(key)
        return float(duplicate)

    async def _reward(self, calls: EnvCalls, primary: TrajectoryRecorder,
                      output: dict[str, Any]) -> tuple[float, dict[str, float]]:
        if self.cfg.reward == "agent":
            reward = output.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise EnvError(f"rollout.agent.reward=agent needs a finite number 'reward' in the agent's "
                               f"RELAX_OUTPUT_FILE, got {reward!r}")
            return float(reward), {}
        answer = output.get("answer")
        if answer is not None:
            if not isinstance(answer, str):
                raise EnvError(f"'answer' in the agent's RELAX_OUTPUT_FILE must be a string, got {type(answer).__name__}")
            action = {"role": "assistant", "content": answer, "tool_calls": []}
        else:
            action = next(m for m in reversed(primary.messages) if m.get("role") == "assistant")
            action = {k: v for k, v in action.items() if k != "parse_errors"}
        _, reward, _, _, info = check_step(await calls.step(action))
        return reward, numeric_info(info)


def _output_metrics(output: dict[str, Any]) -> dict[str, float]:
    metrics = output.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise EnvError(f"'metrics' in the agent's RELAX_OUTPUT_FILE must be an object, got {type(metrics).__name__}")
    return {f"agent/{k}": float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def agent_environment(parent: Any, inherit: list[str]) -> dict[str, str]:
    """The variables of ``parent`` named by ``inherit`` (a trailing ``*`` matches a prefix; ``"*"`` all),
    without any ``OPENAI_*`` or ``ANTHROPIC_*`` (the agent gets the episode's own)."""
    def wanted(name: str) -> bool:
        return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in inherit)

    return {k: v for k, v in parent.items() if wanted(k) and not k.startswith(("OPENAI_", "ANTHROPIC_"))}


def kill_marked(marker: str, proc_dir: str = "/proc") -> list[int]:
    """SIGKILL every process (but this one) whose environment holds the variable ``marker``
    (``NAME=value``): the processes an agent started, wherever they went (a new session or
    process group, a double fork) — each inherited the episode's key. Linux ``/proc`` only; a
    process that scrubbed its environment or runs as another user is not found.

    Returns:
        the pids signalled.
    """
    needle = marker.encode() + b"\0"
    killed: list[int] = []
    try:
        pids = [int(name) for name in os.listdir(proc_dir) if name.isdigit()]
    except OSError:
        return killed
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            with open(f"{proc_dir}/{pid}/environ", "rb") as f:
                environ = f.read() + b"\0"
        except OSError:  # gone, or not ours
            continue
        if environ.startswith(needle) or b"\0" + needle in environ:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    return killed


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
