"""The trainer service that drives the trainer actor and restarts it from the last checkpoint.

:class:`RayTrainerService` implements :class:`~relax_agent.runtime.base.TrainerService` for the
loop. The actor reads each update's rows from the data bus itself (a
:class:`~relax_agent.runtime.base.TrainRef` names them), so no token, media or routing array passes
through the driver. The service keeps a redo log: every operation that returned since the newest
checkpoint (RL updates by reference, warm-up updates with their rows, the end of the warm-up); the
loop keeps the rows of those updates on the bus until a checkpoint covers them
(:meth:`RayTrainerService.rows_needed_after`). When a call finds the actor
dead, and the supervisor allows a restart (``runtime.max_trainer_restarts``), a new actor loads the
newest checkpoint (or the initial policy), replays the log in order without publishing, publishes
the result as the version the loop last saw, and the failed call runs again. The loop's step, policy version, data position and in-flight groups never went
back, so no step is trained twice and the run ends with the configured number of steps.

A call still running after ``runtime.trainer_hang_timeout_s`` is a hung trainer: said on the
console and in ``/status`` (the actor beats from a helper thread during a call, with the call it
is in, so ``/status`` tells a running process from a stopped one), then the actor is killed and
restarted the same way. A call that failed because the weight coordinator, the data bus or the
heartbeat table died restarts nothing: the run ends with that role's
:class:`~relax_agent.errors.RoleDiedError`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import ray

from relax_agent.errors import CheckpointError, RuntimeServiceError
from relax_agent.runtime.base import TrainRef
from relax_agent.runtime.ray import placement, record_placement
from relax_agent.runtime.ray_roles import ACTOR_DIED, describe_failure, oom_hint
from relax_agent.runtime.ray_trainer.actor import TrainerActor

log = logging.getLogger("relax_agent.runtime")
_DIED = ACTOR_DIED


class TrainerSupervision(Protocol):
    """What :class:`RayTrainerService` asks of the run's supervisor
    (:class:`~relax_agent.runtime.ray_supervisor.Supervisor`)."""

    def allow_trainer_restart(self, reason: str) -> bool:
        """Count a trainer failure; True while restarts remain."""
        ...

    def dead_role(self) -> BaseException | None:
        """The error of a role the run cannot go on without that died (the bus, the coordinator), or None."""
        ...

    def trainer_beat(self) -> tuple[float, dict[str, Any]] | None:
        """The trainer's last heartbeat: (age s, payload), or None."""
        ...

    def note_trainer_call(self, call: str | None) -> None:
        """A call to the trainer starts (None: it returned)."""
        ...

    def note_trainer_hung(self, detail: str) -> None:
        """The call in flight is past ``runtime.trainer_hang_timeout_s``."""
        ...

    def metrics(self) -> dict[str, float]:
        """Per-role gauges for each step's metrics row."""
        ...


class _TrainerHung(RuntimeServiceError):
    """A trainer call ran past ``runtime.trainer_hang_timeout_s`` (the actor is killed already)."""


@dataclass
class _Base:
    """Where a restarted trainer starts: a checkpoint (None: the initial policy) at ``version``."""

    checkpoint: Path | None
    version: int


class RayTrainerService:
    """Implements :class:`~relax_agent.runtime.base.TrainerService` over a :class:`TrainerActor`.

    Args:
        cfg: the run config.
        coordinator: the weight coordinator (an ``ActorCoordinator``).
        health: the heartbeat actor.
        supervisor: decides and counts restarts (:meth:`Supervisor.allow_trainer_restart`) and gives
            the per-role metrics added to each update's metrics.
        name, namespace: the actor's name and Ray namespace.
        publish_host: the weight server's address; None: resolved on the trainer's node.
        bus: the run's data bus; the actor reads each update's rows from it.
    """

    def __init__(self, cfg: Any, coordinator: Any, health: Any, supervisor: TrainerSupervision, name: str,
                 namespace: str,
                 publish_host: str | None, bus: Any) -> None:
        self.cfg, self.coordinator, self.health, self.supervisor = cfg, coordinator, health, supervisor
        self._credential = coordinator.credential
        """Every call to the actor carries it: the actor refuses callers without the publisher secret."""
        self.name, self.namespace, self.publish_host, self.bus = name, namespace, publish_host, bus
        self._cls = ray.remote(TrainerActor)
        self._base = _Base(None, 0)
        self._log: list[tuple[str, Any, Any]] = []
        """Operations that returned since ``_base``, in order: ``("train", ref, version)``,
        ``("sft", fields, lr)``, ``("end_sft", None, version)`` (the redo log)."""
        self._version = 0
        """The last version the loop saw published (what a restarted trainer publishes again)."""
        self._saved = False
        self.actor: Any = None
        self.pid: int | None = None
        self.node_id: str | None = None
        self.node_ip: str | None = None
        self._launch(None, None)

    def _launch(self, model_path: str | None, trainer_state: dict[str, Any] | None) -> None:
        self.actor = self._cls.options(name=f"{self.name}.{time.monotonic_ns()}", namespace=self.namespace,
                                       num_cpus=self.cfg.runtime.trainer_num_cpus, max_restarts=0,
                                       max_concurrency=2, **placement(self.cfg.runtime.trainer_resources)).remote(
            self.cfg, self.name, self.coordinator, self.health, self.publish_host, self.bus)
        info = ray.get(self.actor.start.remote(model_path, trainer_state, credential=self._credential),
                       timeout=self.cfg.runtime.replica_start_timeout_s)
        self.pid, self.node_id, self.node_ip = info["pid"], info["node_id"], info["node_ip"]
        log.info("runtime: trainer on node %s (pid %s), weights served at %s", info["node_ip"], info["pid"],
                 info["weights_address"])
        record_placement(self.cfg, "trainer", self.name, info)

    # -- the protocol -----------------------------------------------------------------------------
    def train(self, ref: TrainRef) -> dict[str, float]:
        """One update on the actor (see :meth:`TrainerService.train`), logged so that a rebuilt trainer
        can replay it (the supervisor's gauges come with every step's row from the rollout service)."""
        self._trim_to_checkpoint()
        out = self._call(lambda: self.actor.train.remote(ref, credential=self._credential))
        self._log.append(("train", ref, ref.version))
        self._version = ref.version
        return out

    def rows_needed_after(self) -> int | None:
        """The newest checkpoint's policy version (the redo log is trimmed to it first), or None when
        a restart never replays: ``runtime.max_trainer_restarts`` is 0, or ``checkpoint.every_steps``
        is 0 (the loop cannot keep every row of the run; a trainer that dies after its first update
        then ends the run, see :meth:`_restart`)."""
        if not self.keeps_rows:
            return None
        self._trim_to_checkpoint()
        return self._base.version

    @property
    def keeps_rows(self) -> bool:
        """A restart replays updates from rows the loop keeps on the bus."""
        return self.cfg.runtime.max_trainer_restarts > 0 and self.cfg.checkpoint.every_steps > 0

    def sft(self, fields: Mapping[str, Any], lr: float) -> dict[str, float]:
        """One supervised update on the actor, logged for a rebuilt trainer to replay."""
        out = self._call(lambda: self.actor.sft.remote(fields, lr, credential=self._credential))
        self._log.append(("sft", fields, lr))
        return out

    def end_sft(self, version: int) -> dict[str, float]:
        """End the warm-up on the actor and publish its weights as ``version`` (logged for a rebuild)."""
        out = self._call(lambda: self.actor.end_sft.remote(version, credential=self._credential))
        self._log.append(("end_sft", None, version))
        self._version = version
        return out

    def restore(self, trainer_state: dict[str, Any], version: int) -> None:
        """Rebuild the trainer from the newest checkpoint (the one the controller resumes) and publish it.

        Raises:
            CheckpointError: the newest checkpoint's policy version is not ``version``.
        """
        ckpt, ckpt_version = self._newest_checkpoint()
        if ckpt is None or ckpt_version != version:
            raise CheckpointError(f"runtime ray: resuming policy version {version}, but the newest checkpoint under "
                                  f"{self.cfg.run.output_dir}/checkpoints is {ckpt} (version {ckpt_version})")
        self._base, self._log, self._version = _Base(ckpt, version), [], version
        self._call(lambda: self.actor.start.remote(str(ckpt / "model"), trainer_state, keep_publisher=True,
                                                   credential=self._credential))
        self._call(lambda: self.actor.publish.remote(version, credential=self._credential))

    def state_dict(self) -> dict[str, Any]:
        """The actor's trainer state for a checkpoint."""
        return self._call(lambda: self.actor.state_dict.remote(credential=self._credential))

    def save_model(self, path: Any) -> None:
        """Write the policy (weights and tokenizer) to folder ``path`` from the actor."""
        self._call(lambda: self.actor.save_model.remote(str(path), credential=self._credential))
        self._saved = True

    def close(self) -> None:
        """Stop the actor's trainer (within 30 s; a dead actor is skipped) and kill the actor."""
        try:
            ray.get(self.actor.stop.remote(credential=self._credential), timeout=30.0)
        except Exception:  # dead already
            pass
        ray.kill(self.actor, no_restart=True)

    # -- restarts ---------------------------------------------------------------------------------
    def _call(self, make_ref: Callable[[], Any]) -> Any:
        """``ray.get(make_ref())``; when the actor died or hung: restart it and call again.

        Raises:
            RoleDiedError: the call failed because the coordinator, the bus or the heartbeat table died.
            RuntimeServiceError: ``runtime.max_trainer_restarts`` restarts are used up.
            Exception: what the actor's call raised (Ray's ``RayTaskError`` around it, an instance of
                its class too), when no role died.
        """
        while True:
            try:
                return self._get(make_ref())
            except (*_DIED, _TrainerHung) as exc:
                self._recover(exc)
            except ray.exceptions.RayTaskError as exc:  # raised inside the actor (e.g. reading its rows)
                dead = self.supervisor.dead_role()
                if dead is not None:  # the bus or the coordinator it used died: that is the cause
                    raise dead from exc
                raise

    def _get(self, ref: Any, per_op: int = 1) -> Any:
        """``ray.get(ref)``, watched for a hang: past ``runtime.trainer_hang_timeout_s`` (times
        ``per_op``, the updates a replay re-takes) the hang is reported (console, ``/status``) and the
        actor killed; raises :class:`_TrainerHung`."""
        bound = self.cfg.runtime.trainer_hang_timeout_s
        silent_limit = 2 * self.cfg.runtime.heartbeat_timeout_s
        self.supervisor.note_trainer_call("call")
        try:
            if bound is None:
                return ray.get(ref)
            limit, started, warned = bound * max(per_op, 1), time.monotonic(), False
            poll = min(1.0, self.cfg.runtime.heartbeat_interval_s)
            while True:
                done, _ = ray.wait([ref], timeout=poll)
                if done:
                    return ray.get(ref)
                running_s = time.monotonic() - started
                if running_s > limit:
                    raise self._hung(running_s, limit)
                silent_s = self._silent_s(running_s)
                if silent_s > silent_limit:  # the process does not run: stopped, or wedged holding the GIL
                    raise self._hung(running_s, silent_limit, bound_key="2 x runtime.heartbeat_timeout_s")
                if not warned and silent_s > silent_limit / 2:
                    warned = True
                    log.warning("runtime: the trainer actor (pid %s) has sent no heartbeat for %.1f s during a call "
                                "(it is judged hung at %g s: 2 x runtime.heartbeat_timeout_s)", self.pid, silent_s,
                                silent_limit)
        finally:
            self.supervisor.note_trainer_call(None)

    def _silent_s(self, running_s: float) -> float:
        """Seconds of the call in flight (``running_s`` long) without a beat of this trainer process: since
        its last beat or the call's start, whichever came later (the trainer beats only around calls)."""
        beat = self.supervisor.trainer_beat()
        if beat is None or beat[1].get("pid") != self.pid:
            return running_s
        return min(beat[0], running_s)

    def _hung(self, running_s: float, limit: float, bound_key: str = "runtime.trainer_hang_timeout_s") -> _TrainerHung:
        """Say that the call in flight hangs (console, ``/status``), kill the actor; the error to recover from.
        ``limit`` is the bound it passed, ``bound_key`` the config that sets it."""
        beat = self.supervisor.trainer_beat()
        age, info = beat if beat is not None and beat[1].get("pid") == self.pid else (None, {})
        doing = f"`{info['doing']}`" if info.get("doing") else "a call"
        beating = (bound_key.startswith("runtime.trainer") and age is not None and info.get("busy")
                   and age <= max(3 * self.cfg.runtime.heartbeat_interval_s, 5.0))
        if not beating:  # no beat during this call: the process does not run (stopped, or wedged holding the GIL)
            how = "no heartbeat " + ("at all" if age is None else f"for {age:.1f} s") + " (stopped or wedged)"
        else:
            how = f"its last heartbeat {age:.1f} s ago (the process runs, the call does not return)"
        over = (f"more than {bound_key}={limit:g}" if bound_key.startswith("runtime.trainer")
                else f"and sent no heartbeat for more than {bound_key} = {limit:g} s")
        detail = f"the trainer actor (pid {self.pid}) has been in {doing} for {running_s:.0f} s, {over}; {how}"
        log.warning("runtime: %s: killing it", detail)
        self.supervisor.note_trainer_hung(detail)
        self._kill_actor(sigkill=True)
        return _TrainerHung(detail)

    def _kill_actor(self, sigkill: bool = False) -> None:
        """``ray.kill`` the actor; with ``sigkill`` (a hung actor, so its process is still there) its
        process is SIGKILLed too when on this node (a stopped process may not answer Ray)."""
        from relax_agent.runtime.ray_supervisor import kill_ray_worker

        if self.actor is not None:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:  # gone already
                pass
        if sigkill and self.pid is not None and self.node_id == ray.get_runtime_context().get_node_id():
            kill_ray_worker(self.pid)

    def _recover(self, exc: BaseException) -> None:
        """Restart the actor (again while restarts die or hang), within the restart budget, unless
        a role it depends on died.

        Raises:
            RoleDiedError: the coordinator, the bus or the heartbeat table died (a restart cannot help).
            RuntimeServiceError: ``runtime.max_trainer_restarts`` restarts are used up.
        """
        while True:
            dead = self.supervisor.dead_role()
            if dead is not None:
                raise dead from exc
            hung = isinstance(exc, _TrainerHung)
            reason = str(exc) if hung else describe_failure(exc) + oom_hint(exc)
            if not self.supervisor.allow_trainer_restart(reason):
                raise RuntimeServiceError(f"the trainer actor {'hung' if hung else 'died'} ({reason}) and "
                                          f"runtime.max_trainer_restarts={self.cfg.runtime.max_trainer_restarts} "
                                          "restarts are used up") from exc
            log.warning("runtime: the trainer actor %s (%s); restarting it from %s and %d logged operations",
                        "hung" if hung else "died", reason, self._base.checkpoint or "the initial policy",
                        len(self._log))
            try:
                self._restart()
                return
            except (*_DIED, ray.exceptions.GetTimeoutError, _TrainerHung) as again:
                exc = again

    def _restart(self) -> None:
        """A new actor: the base checkpoint, the logged operations replayed, the loop's version published."""
        self._kill_actor()
        base = self._base
        versions = [arg for kind, _, arg in self._log if kind != "sft"]
        expected = list(range(base.version + 1, base.version + 1 + len(versions)))
        if versions != expected or (versions and versions[-1] != self._version):
            raise CheckpointError(f"runtime ray: cannot rebuild policy version {self._version} from "
                                  f"{base.checkpoint or 'the initial policy'} (version {base.version}): the redo "
                                  f"log holds versions {versions}, expected {expected}")
        if not self.keeps_rows and any(kind == "train" for kind, _, _ in self._log):
            raise RuntimeServiceError(
                f"the trainer actor died after {sum(kind == 'train' for kind, _, _ in self._log)} updates since "
                f"{base.checkpoint or 'the initial policy'}, and with checkpoint.every_steps=0 their rows are no "
                "longer on the bus to replay: resume from the newest checkpoint, and set checkpoint.every_steps "
                "so that a restart can replay the updates since it")
        trainer_state = None
        if base.checkpoint is not None:
            from relax_agent.checkpoint import load_state

            _, trainer_state = load_state(base.checkpoint)
        self._launch(None if base.checkpoint is None else str(base.checkpoint / "model"), trainer_state)
        if self._log:
            self._get(self.actor.replay.remote(self._log, credential=self._credential), per_op=len(self._log))
        self._get(self.actor.publish.remote(self._version, credential=self._credential))

    def _trim_to_checkpoint(self) -> None:
        """After a save: the newest checkpoint becomes the base; the log keeps what came after it."""
        if not self._saved:
            return
        self._saved = False
        ckpt, version = self._newest_checkpoint()
        if ckpt is None or version is None or version < self._base.version:
            return
        cut = 0
        for i, (kind, _, arg) in enumerate(self._log):
            if kind != "sft" and arg <= version:
                cut = i + 1
        self._base, self._log = _Base(ckpt, version), self._log[cut:]

    def _newest_checkpoint(self) -> tuple[Path | None, int | None]:
        from relax_agent.checkpoint import CheckpointManager

        ckpt = CheckpointManager(self.cfg.run.output_dir).latest()
        if ckpt is None:
            return None, None
        return ckpt, int(json.loads((ckpt / "state.json").read_text())["policy_version"])
