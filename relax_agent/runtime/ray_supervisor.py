"""The one supervisor of a Ray run: starts, health-checks, replaces and scales rollout replicas, and
decides (and counts) trainer restarts. (Its HTTP control endpoint is :mod:`.ray_control`.)

Restart policy per role:

=================  ==========================================  ============================================
role               failure (how it is detected)                what happens
=================  ==========================================  ============================================
rollout replica    dies (a call raises ``RayActorError``);     killed, replaced in its slot (a new actor
                   hangs (no heartbeat for                     that loads the engine and pulls the latest
                   ``runtime.heartbeat_timeout_s``, or one     weights before it serves); its groups in
                   group past ``runtime.request_timeout_s``);  flight are played again on another replica
                   fails to start                              (same ids and seeds; the bus stores a group
                                                               once); with no replica ready, 3 failed
                                                               starts in a row or one that hangs end the
                                                               run; with replicas ready, 3 in a row scale
                                                               the target back to them
trainer            its actor dies (a call raises               restarted from the last checkpoint, the
                   ``RayActorError``); hangs (a call in        updates since replayed from the trainer
                   flight past                                 service's redo log, the weights published
                   ``runtime.trainer_hang_timeout_s``:         again, the failed call retried; at most
                   said on the console and in ``/status``,     ``runtime.max_trainer_restarts`` times
                   then killed)                                (deaths and hangs together)
reward replica     dies or hangs (Ray Serve's health check)    Serve replaces it; the reward client retries
                                                               the items (``RetryPolicy``), which stay
                                                               ``status: error`` (masked, never 0) only if
                                                               every retry fails
data bus, weight   their actor dies (pinged every tick, and    not restarted: the run fails with one
coordinator,       whenever another role fails in a way its    ``RoleDiedError`` naming the role and the
heartbeat table    death explains: :mod:`.ray_roles`)          cause (they hold the run's state; resume
                                                               from the checkpoint); a trainer or replica
                                                               that failed because of it is not restarted
=================  ==========================================  ============================================

The supervisor is a daemon thread of the driver. Ray itself restarts nothing (every actor has
``max_restarts=0``), so there is exactly one supervisor per role: this one for rollout and trainer,
Serve's for reward replicas.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import threading
import time
from typing import Any

import ray

from relax_agent.errors import ConfigError, EngineError, RuntimeServiceError
from relax_agent.runtime.base import PARTITION
from relax_agent.runtime.ray import placement, record_placement, replica_env_vars
from relax_agent.runtime.ray_roles import HEALTH, RoleWatch, describe_failure
from relax_agent.runtime.ray_rollout import (
    DRAINING,
    FAILED,
    READY,
    REMOVED,
    STARTING,
    Replica,
    ReplicaPool,
    RolloutReplica,
)

log = logging.getLogger("relax_agent.runtime")

REPLICAS = "runtime/rollout_replicas"
TARGET = "runtime/rollout_target"
ROLLOUT_RESTARTS = "runtime/rollout_restarts"
IN_FLIGHT = "runtime/rollout_in_flight"
ROLLOUT_HEARTBEAT_AGE = "runtime/rollout_heartbeat_age_s"
"""Oldest heartbeat among ready replicas, seconds."""
TRAINER_RESTARTS = "runtime/trainer_restarts"
TRAINER_HEARTBEAT_AGE = "runtime/trainer_heartbeat_age_s"
TRAINER_HANGS = "runtime/trainer_hangs"
"""Trainer calls found hung (past ``runtime.trainer_hang_timeout_s``) so far."""
QUEUE_ROWS = "runtime/queue_rows"
"""Rows on the data bus's rollout partition (queue depth)."""

_MAX_FAILED_STARTS = 3
_EXIT_GRACE_S = 5.0
"""Seconds a replica stopped gracefully has to exit after ``ray.kill`` before its process is SIGKILLed."""


class Supervisor:
    """Keeps ``target`` rollout replicas ready (see the module docstring for the policy).

    Args:
        cfg: the run config (``runtime`` section).
        pool: the replicas, shared with the rollout service.
        bus, coordinator, health: handed to each replica (the coordinator is an
            :class:`~relax_agent.runtime.ray_weights.ActorCoordinator`).
        prefix: actor names start with it; namespace: the Ray namespace of every actor.
        roles: the :class:`~relax_agent.runtime.ray_roles.RoleWatch` of the actors the run cannot go
            on without (pinged every tick); None: not watched.
    """

    def __init__(self, cfg: Any, pool: ReplicaPool, bus: Any, coordinator: Any, health: Any, prefix: str,
                 namespace: str, roles: RoleWatch | None = None) -> None:
        self.cfg, self.pool, self.bus, self.coordinator, self.health = cfg, pool, bus, coordinator, health
        self.roles = roles
        self.trainer_call: dict[str, Any] | None = None
        """The trainer call in flight, as the trainer service reports it: ``call``, ``since`` (epoch s),
        and ``hung`` with its ``detail`` once it is past ``runtime.trainer_hang_timeout_s``."""
        self.trainer_hangs = 0
        self.last_trainer_hang: dict[str, Any] | None = None
        """``time`` (epoch s) and ``detail`` of the last hang."""
        self.prefix, self.namespace = prefix, namespace
        self.rt = cfg.runtime
        self.target = self.rt.rollout_replicas
        self.restarts = {"rollout": 0, "trainer": 0}
        self.trainer_name = f"{prefix}.trainer"
        self._generation = itertools.count()
        self._failed_starts = 0
        self._table: dict[str, tuple[float, dict[str, Any]]] = {}
        self._node_id: str | None = None
        """This (the driver's) node; replica processes on it that do not exit are SIGKILLed."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cls = ray.remote(RolloutReplica)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the initial replicas and the supervision thread."""
        for _ in range(self.target):
            self._start_replica()
        self._thread = threading.Thread(target=self._run, name="relax-supervisor", daemon=True)
        self._thread.start()

    def wait_ready(self, count: int, timeout_s: float) -> None:
        """Block until ``count`` replicas are ready.

        Raises:
            EngineError: not within ``timeout_s`` (or replicas cannot start); names the last failure.
        """
        deadline = time.monotonic() + timeout_s
        while len(self.pool.in_state(READY)) < count:
            if self.pool.fatal is not None:
                raise self.pool.fatal
            if time.monotonic() > deadline:
                raise EngineError(f"{len(self.pool.in_state(READY))} of {count} rollout replicas ready after "
                                  f"{timeout_s:g} s (runtime.replica_start_timeout_s); last failure: "
                                  f"{self._last_failure()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop supervising and remove every replica (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        for rep in self.pool.in_state(STARTING, READY, DRAINING, FAILED):
            self._kill(rep, graceful=rep.state in (READY, DRAINING))
            rep.state = REMOVED

    def scale(self, replicas: int) -> dict[str, Any]:
        """Set the number of rollout replicas; the supervisor starts or drains them. Returns :meth:`status`.

        Raises:
            ConfigError: ``replicas`` is not an int >= 1, or more than :meth:`max_replicas`.
        """
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"scale --rollout {replicas!r}: expected an integer >= 1 (rollout replicas)")
        bound, why = self.max_replicas()
        if replicas > bound:
            raise ConfigError(f"scale --rollout {replicas}: more than the {bound} rollout replicas this run may have "
                              f"({why})")
        with self.pool.lock:
            self.target = replicas
        log.info("runtime: rollout replicas -> %d", replicas)
        return self.status()

    def max_replicas(self) -> tuple[int, str]:
        """The most rollout replicas :meth:`scale` accepts, and what sets it: ``runtime.max_rollout_replicas``,
        or fewer when the Ray cluster's CPUs (less the trainer's) hold fewer at ``runtime.rollout_num_cpus``
        each, or its custom resources fewer at ``runtime.rollout_resources`` (replicas beyond them would
        wait for resources forever)."""
        bound, why = self.rt.max_rollout_replicas, f"runtime.max_rollout_replicas={self.rt.max_rollout_replicas}"
        if ray.is_initialized():
            try:
                total = ray.cluster_resources()
                cpus = float(total.get("CPU", 0.0))
            except Exception:  # no answer from the cluster: the configured bound alone
                return bound, why
            for key, need in sorted(self.rt.rollout_resources.items()):  # placement by node: the hosts' share
                held = float(total.get(key, 0.0))
                fit = max(1, math.floor(held / need + 1e-9))
                if fit < bound:
                    bound, why = fit, (f"the cluster's {held:g} {key!r} hold {fit} at runtime.rollout_resources"
                                       f"[{key!r}]={need:g}; runtime.max_rollout_replicas="
                                       f"{self.rt.max_rollout_replicas}")
            fit = max(1, math.floor((cpus - self.rt.trainer_num_cpus) / self.rt.rollout_num_cpus + 1e-9))
            if fit < bound:
                bound, why = fit, (f"the cluster's {cpus:g} CPUs hold {fit} at runtime.rollout_num_cpus="
                                   f"{self.rt.rollout_num_cpus:g} beside the trainer's runtime.trainer_num_cpus="
                                   f"{self.rt.trainer_num_cpus:g}; runtime.max_rollout_replicas="
                                   f"{self.rt.max_rollout_replicas}")
        return bound, why

    # -- trainer ----------------------------------------------------------------------------------
    def allow_trainer_restart(self, reason: str) -> bool:
        """Count a trainer failure; True while restarts stay within ``runtime.max_trainer_restarts``."""
        with self.pool.lock:
            self.restarts["trainer"] += 1
            self.pool.events.append((time.time(), "trainer_failed", self.trainer_name, reason))
            return self.restarts["trainer"] <= self.rt.max_trainer_restarts

    def dead_role(self) -> BaseException | None:
        """The :class:`~relax_agent.errors.RoleDiedError` of a role the run cannot go on without that
        died (pinged now), or None."""
        if self.roles is None:
            return None
        found = self.roles.check()
        if found is not None:
            self._fatal(found)
        return found

    def trainer_beat(self) -> tuple[float, dict[str, Any]] | None:
        """The trainer's last heartbeat as of the last tick: (age s, payload), or None."""
        return self._table.get(self.trainer_name)

    def note_trainer_call(self, call: str | None) -> None:
        """The trainer service starts ``call`` (None: its call returned)."""
        with self.pool.lock:
            self.trainer_call = None if call is None else {"call": call, "since": time.time(), "hung": False,
                                                            "detail": None}

    def note_trainer_hung(self, detail: str) -> None:
        """The trainer's call in flight is past ``runtime.trainer_hang_timeout_s`` (``/status``, events)."""
        with self.pool.lock:
            self.trainer_hangs += 1
            self.last_trainer_hang = {"time": time.time(), "detail": detail}
            if self.trainer_call is not None:
                self.trainer_call.update(hung=True, detail=detail)
            self.pool.events.append((time.time(), "trainer_hung", self.trainer_name, detail))

    def _fatal(self, exc: BaseException) -> None:
        with self.pool.lock:
            if self.pool.fatal is None:
                self.pool.fatal = exc
                self.pool.events.append((time.time(), "role_died", self.prefix, str(exc)))
                log.warning("runtime: %s; ending the run", exc)

    # -- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        interval = min(1.0, self.rt.heartbeat_interval_s)
        while not self._stop.wait(interval):
            try:
                self.tick()
            except Exception:  # one bad tick (e.g. a slow health actor) must not end supervision
                log.exception("runtime supervisor: tick failed")

    def tick(self) -> None:
        """One round: readiness, heartbeats, drains, replacements, the replica target."""
        if self.pool.fatal is not None or self.dead_role() is not None:
            return  # the run is ending: start and replace nothing more
        try:
            self._table = ray.get(self.health.table.remote(), timeout=10.0)
        except ray.exceptions.GetTimeoutError:
            pass  # keep the last table: ages then only grow
        except ray.exceptions.RayActorError as exc:  # not restarted (see the table): the run cannot go on
            found = self.roles.mark_dead(HEALTH, exc) if self.roles is not None else None
            self._fatal(found or RuntimeServiceError(
                f"the {HEALTH} (Ray actor {self.prefix}.health) died ({describe_failure(exc)}); replicas cannot "
                "be supervised, so the run cannot go on"))
            return
        now = time.monotonic()
        for rep in self.pool.in_state(STARTING):
            self._check_start(rep, now)
        for rep in self.pool.in_state(READY, DRAINING):
            age = self.heartbeat_age(rep, now)
            if age > self.rt.heartbeat_timeout_s:
                self.pool.fail(rep, f"no heartbeat for {age:.1f} s (runtime.heartbeat_timeout_s="
                                    f"{self.rt.heartbeat_timeout_s:g})")
        for rep in self.pool.in_state(DRAINING):
            if rep.in_flight == 0 or now - (rep.drain_since or now) > self.rt.drain_timeout_s:
                self._kill(rep, graceful=rep.in_flight == 0)
                rep.state = REMOVED
                self.pool.log("removed", rep, "drained" if rep.in_flight == 0 else "drain timeout: groups handed back")
        for rep in self.pool.in_state(FAILED):
            self._kill(rep, graceful=False)
            rep.state = REMOVED
            with self.pool.lock:
                self.restarts["rollout"] += 1
            log.warning("runtime: replica %s failed (%s); replacing it", rep.name, rep.reason)
        if self.pool.fatal is not None:
            return
        self._reconcile(now)

    def _check_start(self, rep: Replica, now: float) -> None:
        done, _ = ray.wait([rep.ready_ref], timeout=0)
        if not done:
            if now - rep.started_at > self.rt.replica_start_timeout_s:
                self._failed_start(rep, f"not ready within runtime.replica_start_timeout_s="
                                        f"{self.rt.replica_start_timeout_s:g}", stuck=True)
            return
        try:
            info = ray.get(rep.ready_ref)
        except Exception as exc:  # the replica's start raised (bad model path, weights that do not fit...)
            self._failed_start(rep, f"start failed: {describe_failure(exc)}", stuck=False)
            return
        with self.pool.lock:
            rep.pid, rep.node_id, rep.subscriber = info["pid"], info["node_id"], info["subscriber"]
            rep.node_ip = info.get("node_ip")
            rep.ready_at = now
            if self.pool.routes is None and info.get("routes") is not None:
                self.pool.routes = tuple(info["routes"])  # type: ignore[assignment]
            if rep.state == STARTING:
                rep.state = READY
        self._failed_starts = 0
        self.pool.log("ready", rep, f"pid {rep.pid} on node {rep.node_ip}, policy version {info['policy_version']}")
        record_placement(self.cfg, "rollout", rep.name, info)

    def _failed_start(self, rep: Replica, reason: str, stuck: bool) -> None:
        """``rep`` did not start (``stuck``: not ready within ``runtime.replica_start_timeout_s``). With no
        replica serving, a stuck start, or :data:`_MAX_FAILED_STARTS` failed starts in a row, end the
        run (a stuck start is not tried again: with the defaults that alone took 30 minutes). With
        replicas serving, :data:`_MAX_FAILED_STARTS` failures in a row scale the target back to the
        replicas that are up (logged, ``scaled_back`` event; ``relax-agent scale`` tries again),
        instead of retrying the slot forever."""
        self._failed_starts += 1
        self.pool.fail(rep, reason)
        serving = self.pool.in_state(READY)
        if not serving and (stuck or self._failed_starts >= _MAX_FAILED_STARTS):
            what = "a replica start that hung" if stuck else f"{self._failed_starts} rollout replicas in a row that failed to start"
            self.pool.fatal = EngineError(f"no rollout replica is serving after {what}: {reason}")
        elif serving and self._failed_starts >= _MAX_FAILED_STARTS:
            with self.pool.lock:
                before, self.target = self.target, len(self.pool.live())
            detail = (f"{self._failed_starts} starts in a row failed (last: {reason}); replica target {before} -> "
                      f"{self.target} (relax-agent scale tries again)")
            log.warning("runtime: rollout replicas: %s", detail)
            self.pool.log("scaled_back", rep, detail)
            self._failed_starts = 0

    def _reconcile(self, now: float) -> None:
        with self.pool.lock:
            live = self.pool.live()
            missing = self.target - len(live)
            if missing > 0:
                for _ in range(missing):
                    self._start_replica()
                return
            # too many: stop those not serving yet first, then drain the ready ones in the highest slots
            for rep in sorted(live, key=lambda r: (r.state == READY, -r.slot))[:-missing]:
                if rep.state == STARTING:
                    rep.state = FAILED  # not serving yet: stop it at once (not a restart)
                    rep.reason = "scaled in before it was ready"
                    self._kill(rep, graceful=False)
                    rep.state = REMOVED
                    self.pool.log("removed", rep, rep.reason)
                else:
                    rep.state, rep.drain_since = DRAINING, now
                    self.pool.log("draining", rep, f"{rep.in_flight} groups in flight")

    def _start_replica(self) -> Replica:
        with self.pool.lock:
            used = {r.slot for r in self.pool.in_state(STARTING, READY, DRAINING)}
            slot = next(i for i in itertools.count() if i not in used)
            name = f"{self.prefix}.rollout-{slot}.{next(self._generation)}"
            env = replica_env_vars(self.cfg)
            handle = self._cls.options(name=name, namespace=self.namespace, num_cpus=self.rt.rollout_num_cpus,
                                       max_restarts=0, max_concurrency=1000,
                                       **({"runtime_env": {"env_vars": env}} if env else {}),
                                       **placement(self.rt.rollout_resources, self.rt.rollout_spread)).remote(
                self.cfg, name, self.bus, self.coordinator, self.health)
            rep = Replica(slot, name, handle, time.monotonic(), handle.start.remote())
            self.pool.replicas.append(rep)
        self.pool.log("started", rep)
        return rep

    def _kill(self, rep: Replica, graceful: bool) -> None:
        """Stop ``rep``: ``stop()`` first when graceful, then ``ray.kill``; a process on this node that
        does not exit (stopped, hung) is SIGKILLed; its weight subscription and heartbeats are dropped
        (not when a role died: the run is ending, and a dead coordinator or heartbeat table cannot answer)."""
        role_died = self.roles is not None and self.roles.fatal is not None
        if graceful:
            try:
                ray.get(rep.handle.stop.remote(), timeout=10.0)
            except Exception:  # dead or hung: ray.kill below
                pass
        try:
            ray.kill(rep.handle, no_restart=True)
        except Exception:
            pass
        if self._node_id is None:
            self._node_id = ray.get_runtime_context().get_node_id()
        if rep.pid is not None and rep.node_id == self._node_id:
            kill_ray_worker(rep.pid, grace_s=_EXIT_GRACE_S if graceful else 0.0)
        if role_died:
            return
        if rep.subscriber is not None:
            try:
                self.coordinator.unregister_subscriber(rep.subscriber)
            except Exception:
                log.warning("runtime: could not unregister the weight subscriber of %s", rep.name)
        self.health.forget.remote(rep.name)

    # -- reading ----------------------------------------------------------------------------------
    def heartbeat_age(self, rep: Replica, now: float | None = None) -> float:
        """Seconds since ``rep`` last beat (since it became ready if it never did)."""
        now = time.monotonic() if now is None else now
        beat = self._table.get(rep.name)
        if beat is not None:
            return beat[0]
        return now - (rep.ready_at or rep.started_at)

    def _last_failure(self) -> str:
        failed = [e for e in self.pool.events if e[1] == "failed"]
        return failed[-1][3] if failed else "none"

    def metrics(self) -> dict[str, float]:
        """Per-role gauges for the step's metrics row (console, JSONL, TensorBoard)."""
        ready = self.pool.in_state(READY)
        out = {REPLICAS: float(len(ready)), TARGET: float(self.target),
               ROLLOUT_RESTARTS: float(self.restarts["rollout"]), TRAINER_RESTARTS: float(self.restarts["trainer"]),
               TRAINER_HANGS: float(self.trainer_hangs),
               IN_FLIGHT: float(sum(r.in_flight for r in self.pool.in_state(READY, DRAINING))),
               ROLLOUT_HEARTBEAT_AGE: max((self.heartbeat_age(r) for r in ready), default=0.0)}
        trainer = self._table.get(self.trainer_name)
        if trainer is not None:
            out[TRAINER_HEARTBEAT_AGE] = trainer[0]
        try:
            out[QUEUE_ROWS] = float(self.bus.stats(PARTITION)["rows"])
        except Exception:  # the partition does not exist yet, or the bus died (said by the role watch)
            pass
        return out

    def status(self) -> dict[str, Any]:
        """The control endpoint's view: target, replicas, restarts, recent events."""
        with self.pool.lock:
            reps = [{"name": r.name, "slot": r.slot, "state": r.state, "in_flight": r.in_flight,
                     "groups_done": r.groups_done, "pid": r.pid, "node_ip": r.node_ip,
                     "heartbeat_age_s": round(self.heartbeat_age(r), 3) if r.state in (READY, DRAINING) else None,
                     "policy_version": self._table.get(r.name, (0, {}))[1].get("policy_version")}
                    for r in self.pool.replicas if r.state != REMOVED]
            events = [{"time": t, "event": e, "replica": n, "detail": d} for t, e, n, d in self.pool.events[-20:]]
            return {"target": self.target, "replicas": reps, "restarts": dict(self.restarts), "events": events,
                    "trainer": self._trainer_status(), "fatal": None if self.pool.fatal is None else str(self.pool.fatal)}

    def _trainer_status(self) -> dict[str, Any]:
        """``/status``'s trainer: its heartbeat (age, pid, policy version, the call it is in and for how
        long, as it reports it), the call the driver has in flight and whether that one is hung, the
        hangs so far and the last one's detail."""
        beat = self._table.get(self.trainer_name)
        age, info = beat if beat is not None else (None, {})
        call = dict(self.trainer_call) if self.trainer_call is not None else None
        if call is not None:
            call["running_s"] = round(time.time() - call["since"], 3)
        return {"name": self.trainer_name, "heartbeat_age_s": None if age is None else round(age, 3),
                "pid": info.get("pid"), "policy_version": info.get("policy_version"), "busy": info.get("busy"),
                "doing": info.get("doing"), "call": call, "hung": bool(call and call["hung"]),
                "hangs": self.trainer_hangs, "last_hang": self.last_trainer_hang, "restarts": self.restarts["trainer"]}


def kill_ray_worker(pid: int, grace_s: float = 0.0) -> None:
    """SIGKILL ``pid`` if it still is a Ray worker process (never another process that reused the pid)
    ``grace_s`` seconds from now: a worker that ``ray.kill`` is ending exits by itself within them, and
    a worker SIGKILLed before Ray ends it makes the raylet print that a worker "died or was killed ...
    (the OOM killer, ...)", at every normal end of a run."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::"):
                    return  # gone (a zombie's cmdline is empty) or the pid is another process's now
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                return
        except (OSError, ProcessLookupError):
            return
        time.sleep(0.05)
