"""Rollout replicas as Ray actors, and the rollout service that spreads groups over them.

A :class:`RolloutReplica` is one Ray actor process holding an engine, its envs and a
:class:`~relax_agent.rollout.runner.RolloutRunner` (built where it runs by
:func:`relax_agent.roles.build_roles` from the run's config, so it is exactly the local rollout;
the driver loads no model), a weight subscriber that pulls the
latest version before the replica serves and then follows new ones, and the data bus, into which
it puts each group it plays. It beats from an asyncio task on the event loop that runs its
episodes (:mod:`.ray_health`).

:class:`RayRolloutService` implements :class:`~relax_agent.runtime.base.RolloutService` for the
loop: ``play_group`` sends the group to the ready replica with the fewest groups in flight and
awaits it under a watchdog (``runtime.request_timeout_s``). When the replica dies, hangs past the
watchdog or is removed, the group is played again on another replica under the same ids and seeds;
the bus refuses a second put of one sample id, so a group whose first attempt already reached the
bus is never stored twice. Replicas are started, health-checked and replaced by the one
:class:`~relax_agent.runtime.ray_supervisor.Supervisor` through the :class:`ReplicaPool`.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from relax_agent.errors import DataError
from relax_agent.records import Trajectory
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.runtime.base import PARTITION, GroupDone, GroupJob, Task
from relax_agent.runtime.ray_roles import ACTOR_DIED, describe_failure, oom_hint

STARTING, READY, DRAINING, FAILED, REMOVED = "starting", "ready", "draining", "failed", "removed"

_DUPLICATE = "duplicate sample id"
"""The bus's message for a put of an existing (or retired) sample id (:mod:`relax_agent.data.store`)."""


def quiet_actor_logs() -> None:
    """Silence what every actor of a run would otherwise print to the driver's console on each start:
    transformers' progress bars (loading, saving), and Ray's warning on any blocking ``ray.get`` in an
    asyncio actor, which it gives whatever the calling thread: a replica calls Ray only from worker
    threads (the bus through ``asyncio.to_thread``, the weight follower's thread), never on its event
    loop, so the warning is noise on every replica start (a loop that did block would stop the
    replica's heartbeats, which the supervisor acts on)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"


class RolloutReplica:
    """Ray actor (asyncio): one rollout replica. Built with :meth:`start`, then serves ``play_group``.

    Args:
        cfg: the run config (the replica builds its engine, envs and reward client from it).
        name: the replica's name (heartbeats, weight subscriber, metrics).
        bus: the run's :class:`~relax_agent.data.ray.RayTransferQueue`.
        coordinator: an :class:`~relax_agent.runtime.ray_weights.ActorCoordinator`.
        health: the :class:`~relax_agent.runtime.ray_health.HealthActor` handle.
    """

    def __init__(self, cfg: Any, name: str, bus: Any, coordinator: Any, health: Any) -> None:
        self.cfg, self.name, self.bus, self.coordinator, self.health = cfg, name, bus, coordinator, health
        quiet_actor_logs()
        self.in_flight = 0
        self.groups_done = 0
        self.episodes_done = 0
        self._roles: Any = None
        self._service: Any = None
        self._sub: Any = None
        self._beats: asyncio.Task | None = None

    async def start(self) -> dict[str, Any]:
        """Load the engine and envs here (the driver ran the checks and loads no model), pull the
        latest weights, start beating; returns ``pid``, ``node_id``, ``node_ip`` (the node's
        address), ``subscriber``, ``policy_version`` and ``routes`` (the engine's route layout for
        routing replay, or None).

        Raises:
            WeightSyncError: the latest version does not fit the engine.
        """
        from relax_agent.roles import build_roles
        from relax_agent.rollout.engines.base import route_layout_of
        from relax_agent.runtime.local import LocalRolloutService

        self._roles = await asyncio.to_thread(lambda: build_roles(self.cfg, None, False, quiet=True, checked=True))
        engine = self._roles.engine
        self._service = LocalRolloutService(self._roles.runner, self.bus, PARTITION, route_layout_of(engine))
        self._sub = await asyncio.to_thread(self._subscribe, engine)
        self._beats = asyncio.get_running_loop().create_task(self._beat_forever())
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "subscriber": self._sub.id,
                "policy_version": engine.policy_version, "routes": self._service.routes}

    async def demonstrations(self, tasks: Sequence[Task], seed: int) -> dict[str, list[Any]]:
        """The supervised warm-up's fields, rendered here with this replica's envs, renderer and
        parser (see :meth:`LocalRolloutService.demonstrations`).

        Raises:
            ConfigError: the env offers no demonstrations.
        """
        return await asyncio.to_thread(self._service.demonstrations, tasks, seed)

    def _subscribe(self, engine: Any) -> Any:
        from relax_agent.errors import WeightSyncError
        from relax_agent.weights.subscriber import EngineSubscriber
        from relax_agent.weights.sync import keepalive_s, verify_samples
        from relax_agent.weights.tcp import TcpReceiver

        w = self.cfg.weights
        sub = EngineSubscriber(engine, TcpReceiver(w, secret=self.coordinator.credential.subscriber),
                               self.coordinator, self.name, w.name_map or None, w.poll_timeout_s, keepalive_s(w),
                               verify_samples(w))
        report = sub.sync_latest(0.0)
        if report is not None and report.error is not None:
            sub.close()
            raise WeightSyncError(report.error)
        return sub.start()

    def _status(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "in_flight": self.in_flight, "groups_done": self.groups_done,
                "episodes_done": self.episodes_done, "policy_version": self._roles.engine.policy_version}

    async def _beat_forever(self) -> None:
        """Beat from this event loop (the one that runs the episodes): a blocked loop stops beating."""
        interval = self.cfg.runtime.heartbeat_interval_s
        while True:
            self.health.beat.remote(self.name, self._status())
            await asyncio.sleep(interval)

    async def play_group(self, job: GroupJob, params: SamplingParams, attempt: int = 0) -> GroupDone:
        """Play ``job`` and put its rows into the bus (see :meth:`LocalRolloutService.play_group`).

        ``attempt > 0``: an earlier attempt ran on a replica that failed; if that one's put already
        stored the group, the bus refuses this put as a duplicate and the group counts as done.
        """
        self.in_flight += 1
        try:
            try:
                done = await self._service.play_group(job, params)
            except DataError as exc:
                if attempt == 0 or _DUPLICATE not in str(exc):
                    raise
                done = GroupDone(job, [f"{job.group_id}/{i}" for i in range(job.group_size)], -1, 0.0)
            self.groups_done += 1
            self.episodes_done += job.group_size
            return done
        finally:
            self.in_flight -= 1

    async def run(self, specs: Sequence[Any], params: SamplingParams) -> list[Trajectory]:
        """Play ``specs`` without the bus (evaluation)."""
        self.in_flight += 1
        try:
            trajs = await self._service.run(specs, params)
            self.episodes_done += len(trajs)
            return trajs
        finally:
            self.in_flight -= 1

    async def stop(self) -> None:
        """Stop following weights and beating, close the engine and the reward client."""
        if self._beats is not None:
            self._beats.cancel()
        try:
            if self._sub is not None:
                await asyncio.to_thread(self._sub.close)
        finally:  # the engine, envs and sandboxes close even when the coordinator is gone
            if self._roles is not None:
                await asyncio.to_thread(self._roles.close)


@dataclass
class Replica:
    """The supervisor's record of one replica actor.

    Attributes:
        slot: replica index (a replacement takes the slot of the replica it replaces).
        name: actor name, ``<prefix>.rollout-<slot>.<generation>``.
        state: starting, ready, draining, failed or removed.
        in_flight: groups (or evaluation chunks) sent to it and not yet returned.
        first_group: ``(sample version of its first group, latest published version when that
            group was sent)``: a replica that pulled the latest weights before serving has them equal.
    """

    slot: int
    name: str
    handle: Any
    started_at: float
    ready_ref: Any
    state: str = STARTING
    pid: int | None = None
    node_id: str | None = None
    node_ip: str | None = None
    subscriber: str | None = None
    ready_at: float | None = None
    in_flight: int = 0
    groups_done: int = 0
    first_group: tuple[int, int | None] | None = None
    drain_since: float | None = None
    reason: str | None = None


class ReplicaPool:
    """The replicas of a run, shared by the supervisor thread and the loop's event loop (one lock).

    ``pick``/``release`` are the service's; adding replicas and moving them between states are the
    supervisor's; ``fail`` is called by either (a call that failed, a heartbeat that stopped).
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.replicas: list[Replica] = []
        self.fatal: BaseException | None = None
        """Set by the supervisor when replicas cannot be started at all; the service raises it."""
        self.routes: tuple[tuple[int, ...], str] | None = None
        """The route layout the replicas' engines record (from the first ready replica), or None."""
        self.events: list[tuple[float, str, str, str]] = []
        """(time, event, replica name, detail): started, ready, failed, removed."""

    def log(self, event: str, rep: Replica, detail: str = "") -> None:
        """Record ``event`` (``detail``: free text) about replica ``rep`` with the wall-clock time."""
        with self.lock:
            self.events.append((time.time(), event, rep.name, detail))

    def live(self) -> list[Replica]:
        """Replicas starting or ready (those that count towards the target)."""
        with self.lock:
            return [r for r in self.replicas if r.state in (STARTING, READY)]

    def in_state(self, *states: str) -> list[Replica]:
        """The replicas now in one of ``states``."""
        with self.lock:
            return [r for r in self.replicas if r.state in states]

    def pick(self, max_in_flight: int | None = None) -> Replica | None:
        """The ready replica with the fewest calls in flight (counted as one more), or None when
        none is ready with fewer than ``max_in_flight``."""
        with self.lock:
            ready = [r for r in self.replicas if r.state == READY
                     and (max_in_flight is None or r.in_flight < max_in_flight)]
            if not ready:
                return None
            rep = min(ready, key=lambda r: (r.in_flight, r.slot))
            rep.in_flight += 1
            return rep

    def release(self, rep: Replica, done: bool) -> None:
        """End one call on ``rep``: one fewer in flight, one more group done when ``done``."""
        with self.lock:
            rep.in_flight -= 1
            rep.groups_done += int(done)

    def fail(self, rep: Replica, reason: str) -> None:
        """Mark ``rep`` failed (once); the supervisor replaces it."""
        with self.lock:
            if rep.state in (STARTING, READY, DRAINING):
                rep.state, rep.reason = FAILED, reason
                self.events.append((time.time(), "failed", rep.name, reason))


class RayRolloutService:
    """Implements :class:`~relax_agent.runtime.base.RolloutService` over a :class:`ReplicaPool`.

    Args:
        pool: the replicas (kept by the supervisor).
        specs: makes episode specs (pure: ids, seeds, limits; the driver's
            :meth:`~relax_agent.roles.DriverRoles.specs`).
        coordinator: the weight coordinator (the latest version, recorded for a replica's first group).
        watchdog_s: longest wait for one group on one replica before the replica is replaced.
        supervisor: the run's :class:`~relax_agent.runtime.ray_supervisor.Supervisor` (scaling,
            per-role metrics), or None.
        max_groups_per_replica: groups one replica plays at once (``runtime.max_groups_per_replica``).
    """

    def __init__(self, pool: ReplicaPool, specs: Callable[..., list[Any]], coordinator: Any, watchdog_s: float,
                 supervisor: Any = None, max_groups_per_replica: int | None = None) -> None:
        self.max_groups_per_replica = max_groups_per_replica
        self.pool = pool
        self._specs = specs
        self.coordinator = coordinator
        self.watchdog_s = watchdog_s
        self.supervisor = supervisor
        self.retried_groups = 0
        """Groups (or evaluation chunks) played again after their replica failed."""

    @property
    def routes(self) -> tuple[tuple[int, ...], str] | None:
        """The route layout the replicas' engines record (reported by the first replica that started), or None."""
        return self.pool.routes

    @property
    def policy_version(self) -> int:
        """The latest version published to the replicas (0 before the first)."""
        latest = self.coordinator.latest_version
        return 0 if latest is None else latest

    async def _acquire(self) -> Replica:
        while True:
            if self.pool.fatal is not None:
                raise self.pool.fatal
            rep = self.pool.pick(self.max_groups_per_replica)
            if rep is not None:
                return rep
            await asyncio.sleep(0.05)

    async def _on_replica(self, call: Callable[[Replica, int], Any], what: str,
                          on_result: Callable[[Replica, Any], None] | None = None) -> Any:
        """Run ``call(replica, attempt)`` on a ready replica, again on another one while replicas fail;
        ``on_result(replica, result)`` runs before the call is counted done on the replica, so a reader
        that sees ``groups_done`` grow also sees what ``on_result`` recorded."""
        attempt = 0
        while True:
            rep = await self._acquire()
            ok, ref = False, None
            try:
                ref = call(rep, attempt)
                result = await asyncio.wait_for(_as_future(ref), self.watchdog_s)
                if on_result is not None:
                    on_result(rep, result)
                ok = True
                return result
            except asyncio.TimeoutError:
                _cancel(ref)
                self.pool.fail(rep, f"{what} took more than runtime.request_timeout_s={self.watchdog_s:g} s")
            except ACTOR_DIED as exc:
                found = await self._dead_role()
                if found is not None:  # the replica failed because the bus or the coordinator died
                    raise found from exc
                self.pool.fail(rep, f"died during {what}: {describe_failure(exc)}{oom_hint(exc)}")
            except asyncio.CancelledError:
                if ref is not None:
                    _cancel(ref)
                raise
            except Exception as exc:
                found = await self._dead_role()
                if found is not None:
                    raise found from exc
                raise
            finally:
                self.pool.release(rep, ok)
            attempt += 1
            self.retried_groups += 1

    async def _dead_role(self) -> BaseException | None:
        """The :class:`~relax_agent.errors.RoleDiedError` of a dead bus, coordinator or heartbeat
        table (the supervisor pings them off this event loop), or None."""
        if self.supervisor is None:
            return None
        return await asyncio.to_thread(self.supervisor.dead_role)

    async def play_group(self, job: GroupJob, params: SamplingParams) -> GroupDone:
        """Play ``job`` on a replica (another one if the replica dies; see :meth:`_on_replica`) and
        record each replica's first group (the version it played and the latest one then)."""
        first: dict[str, Any] = {}

        def call(rep: Replica, attempt: int) -> Any:
            first.clear()  # only the attempt that returns counts
            if rep.first_group is None and rep.groups_done == 0:
                first.update(rep=rep, latest=self.coordinator.latest_version)
            return rep.handle.play_group.remote(job, params, attempt)

        def record_first(rep: Replica, done: GroupDone) -> None:
            if first.get("rep") is rep and rep.first_group is None and done.version >= 0:
                rep.first_group = (done.version, first["latest"])

        return await self._on_replica(call, f"group {job.group_id}", on_result=record_first)

    def specs(self, tasks: Sequence[Task], group_size: int, prefix: str, seed: int) -> list[Any]:
        """Episode specs of ``tasks`` as the replicas' runners make them (evaluation plays these)."""
        return self._specs(tasks, group_size, prefix=prefix, seed=seed)

    def demonstrations(self, tasks: Sequence[Task], seed: int) -> dict[str, list[Any]]:
        """Rendered on a ready replica (its envs, renderer and parser; played again on another one
        if it fails). Called by the loop's thread, outside the event loop.

        Raises:
            ConfigError: the env offers no demonstrations (raised by the replica).
        """
        async def on_a_replica() -> dict[str, list[Any]]:
            return await self._on_replica(lambda rep, _: rep.handle.demonstrations.remote(list(tasks), seed),
                                          "demonstrations")

        try:
            return asyncio.run(on_a_replica())
        except ray.exceptions.RayTaskError as exc:  # the replica's own error (no demonstrations), without Ray's header
            cause = exc.cause
            if isinstance(cause, Exception):
                raise cause from None
            raise

    async def run(self, specs: Sequence[Any], params: SamplingParams,
                  on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Play ``specs`` spread over the replicas, one group per call; results in spec order."""
        groups: dict[str, list[int]] = {}
        for i, spec in enumerate(specs):
            groups.setdefault(spec.group_id, []).append(i)
        out: list[Trajectory | None] = [None] * len(specs)

        async def one(indices: list[int]) -> None:
            chunk = [specs[i] for i in indices]
            trajs = await self._on_replica(lambda rep, _: rep.handle.run.remote(chunk, params), "evaluation")
            for i, traj in zip(indices, trajs, strict=True):
                out[i] = traj
                if on_done is not None:
                    on_done(traj)

        await asyncio.gather(*(one(idx) for idx in groups.values()))
        return [t for t in out if t is not None]

    def metrics(self) -> dict[str, float]:
        """The supervisor's gauges (replicas, restarts, in flight, heartbeat ages, queue depth), so every
        step's row has them, a step that trained nothing too; the replicas' engine counters (prefix-cache hit rate) stay in the
        replicas' processes. ``{}`` without a supervisor."""
        return {} if self.supervisor is None else self.supervisor.metrics()

    def close(self) -> None:
        """Nothing here: the supervisor stops the replicas (a closer of the runtime)."""


def _cancel(ref: Any) -> None:
    """Ask Ray to cancel the call behind ``ref`` (its episodes are cancelled, their envs closed);
    a replica that is dead or hung cannot answer, which is fine: it is being replaced."""
    if not isinstance(ref, ray.ObjectRef):
        return
    try:
        ray.cancel(ref)
    except Exception:  # the replica is gone
        pass


def _as_future(ref: Any) -> asyncio.Future:
    """An asyncio future of an ObjectRef, on the running loop."""
    return asyncio.wrap_future(ref.future())
