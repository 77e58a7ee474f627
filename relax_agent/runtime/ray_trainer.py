"""The trainer as a Ray actor, and the trainer service that restarts it from the last checkpoint.

:class:`TrainerActor` builds the trainer from the run's config (``trainer.backend``; the policy
from ``model.path`` or a checkpoint's ``model/``) and publishes through a
:class:`~relax_agent.weights.sync.WeightSync` whose coordinator is the run's named coordinator
actor (bytes over tcp, straight to the replicas). Inside it is the local
:class:`~relax_agent.runtime.local.LocalTrainerService`.

:class:`RayTrainerService` implements :class:`~relax_agent.runtime.base.TrainerService` for the
loop. It keeps a redo log: every operation that returned since the newest checkpoint (RL updates
with their rows and version, warm-up updates, the end of the warm-up). When a call finds the actor
dead, and the supervisor allows a restart (``runtime.max_trainer_restarts``), a new actor loads the
newest checkpoint (or the initial policy), replays the log in order without publishing, publishes
the result as the version the loop last saw, and the failed call runs again. The loop's step, policy version, data position and in-flight groups never went
back, so no step is trained twice and the run ends with the configured number of steps.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import ray

from relax_agent.errors import CheckpointError, RuntimeServiceError
from relax_agent.weights.auth import same_secret

log = logging.getLogger("relax_agent.runtime")
_DIED = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def _run_only(method: Callable[..., Any]) -> Callable[..., Any]:
    """Make a :class:`TrainerActor` method take a ``credential`` keyword and refuse (raise
    :class:`RuntimeServiceError`, logged) a caller whose credential lacks the run's publisher secret:
    the actor is named, so any process joined to the run's Ray could otherwise read the policy
    (``state_dict``), train it on its own rows or publish."""

    def guarded(self: "TrainerActor", *args: Any, credential: Any = None, **kwargs: Any) -> Any:
        if not same_secret(self.coordinator.credential.publisher, getattr(credential, "publisher", None)):
            log.warning("trainer actor: refused %s: the caller does not hold the run's publisher credential",
                        method.__name__)
            raise RuntimeServiceError(f"trainer actor: {method.__name__} refused: it needs the run's publisher "
                                      "credential, which this caller does not hold")
        return method(self, *args, **kwargs)

    guarded.__name__, guarded.__qualname__, guarded.__doc__ = method.__name__, method.__qualname__, method.__doc__
    return guarded  # no functools.wraps: Ray reads the signature, which must take ``credential``


class TrainerActor:
    """Ray actor (threaded): one trainer. :meth:`start` builds (or rebuilds) it.

    Args:
        cfg: the run config.
        name: heartbeat name.
        coordinator: an :class:`~relax_agent.runtime.ray_weights.ActorCoordinator`.
        health: the heartbeat actor.
        publish_host: address the weight server binds to and advertises (this node's).
    """

    def __init__(self, cfg: Any, name: str, coordinator: Any, health: Any, publish_host: str) -> None:
        self.cfg, self.name, self.coordinator, self.health = cfg, name, coordinator, health
        self.publish_host = publish_host
        self.service: Any = None
        self.version = 0
        self.busy = False

    @_run_only
    def start(self, model_path: str | None = None, trainer_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """Build the trainer from ``model_path`` (None: ``model.path``) and ``trainer_state``; register as
        the weight publisher (a new coordinator epoch when one registered before)."""
        from relax_agent.runtime.local import LocalTrainerService
        from relax_agent.weights.sync import WeightSync
        from relax_agent.weights.tcp import TcpReceiver, TcpSender

        if self.service is not None:
            self.service.close()
        if self.cfg.run.num_threads:
            import torch

            torch.set_num_threads(self.cfg.run.num_threads)
        trainer, tokenizer = _build_trainer(self.cfg, model_path)
        if trainer_state is not None:
            trainer.load_state_dict(trainer_state)
        w = self.cfg.weights.model_copy(update={"host": self.publish_host})
        secret = self.coordinator.credential.subscriber  # the tcp server challenges for the run's credential
        sync = WeightSync(w, self.coordinator, TcpSender(w, secret), lambda: TcpReceiver(w, secret=secret))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.service = LocalTrainerService(trainer, sync, int(pad), getattr(tokenizer, "save_pretrained", None))
        self._beat()
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def _beat(self) -> None:
        self.health.beat.remote(self.name, {"pid": os.getpid(), "policy_version": self.version, "busy": self.busy})

    def _work(self, fn: Callable[[], Any]) -> Any:
        """Run one call, beating before and after (the trainer's work loop is its calls)."""
        self.busy = True
        self._beat()
        try:
            return fn()
        finally:
            self.busy = False
            self._beat()

    @_run_only
    def train(self, fields: Mapping[str, Any], version: int) -> dict[str, float]:
        """One update on ``fields``, published as ``version``."""
        out = self._work(lambda: self.service.train(fields, version))
        self.version = version
        return out

    @_run_only
    def sft(self, fields: Mapping[str, Any], lr: float) -> dict[str, float]:
        """One supervised warm-up update (not published)."""
        return self._work(lambda: self.service.sft(fields, lr))

    @_run_only
    def end_sft(self, version: int) -> dict[str, float]:
        """End the warm-up; publish its weights as ``version``."""
        out = self._work(lambda: self.service.end_sft(version))
        self.version = version
        return out

    @_run_only
    def replay(self, ops: list[tuple[str, Any, Any]]) -> None:
        """Re-take logged operations after a restart, in order, without publishing:
        ``("train", fields, version)``, ``("sft", fields, lr)``, ``("end_sft", None, version)``."""
        from relax_agent.train.collate import collate_fields

        def run() -> None:
            for kind, fields, arg in ops:
                if kind == "train":
                    self.service.trainer.train_step(collate_fields(fields, self.service.pad_token_id))
                elif kind == "sft":
                    self.service.sft(fields, arg)
                else:
                    self.service.trainer.end_sft()

        self._work(run)

    @_run_only
    def publish(self, version: int) -> dict[str, float]:
        """Publish the current weights as ``version`` (after a start or a replay)."""
        out = self._work(lambda: self.service._publish(version))
        self.version = version
        return out

    @_run_only
    def state_dict(self) -> dict[str, Any]:
        return self._work(self.service.state_dict)

    @_run_only
    def save_model(self, path: str) -> None:
        self._work(lambda: self.service.save_model(path))

    def pid(self) -> int:
        return os.getpid()

    @_run_only
    def stop(self) -> None:
        if self.service is not None:
            self.service.close()
            self.service = None


def _build_trainer(cfg: Any, model_path: str | None) -> tuple[Any, Any]:
    """(trainer, tokenizer) as :func:`relax_agent.roles.build_roles` builds them for training."""
    from relax_agent.models import load_policy, load_tokenizer
    from relax_agent.preflight import resolve_device

    model_cfg = cfg.model if model_path is None else cfg.model.model_copy(update={"path": model_path, "gguf_file": None})
    if cfg.trainer.lora.enabled:
        model_cfg = cfg.model  # LoRA resumes its adapter (trainer state) over the original base
    if cfg.trainer.backend == "fake":
        return cfg.trainer.build(), load_tokenizer(cfg.model)
    device = resolve_device(cfg.run.device)
    model, tokenizer = load_policy(model_cfg, dtype="fp32", device=device)
    trainer = cfg.trainer.build(model=model, device=device, temperature=cfg.rollout.temperature,
                                routing_replay=cfg.moe.replay)
    return trainer, tokenizer


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
        publish_host: the weight server's address (the trainer's node).
    """

    def __init__(self, cfg: Any, coordinator: Any, health: Any, supervisor: Any, name: str, namespace: str,
                 publish_host: str) -> None:
        self.cfg, self.coordinator, self.health, self.supervisor = cfg, coordinator, health, supervisor
        self._credential = coordinator.credential
        """Every call to the actor carries it: the actor refuses callers without the publisher secret."""
        self.name, self.namespace, self.publish_host = name, namespace, publish_host
        self._cls = ray.remote(TrainerActor)
        self._base = _Base(None, 0)
        self._log: list[tuple[str, Any, Any]] = []
        """Operations that returned since ``_base``, in order: ``("train", fields, version)``,
        ``("sft", fields, lr)``, ``("end_sft", None, version)`` (the redo log)."""
        self._version = 0
        """The last version the loop saw published (what a restarted trainer publishes again)."""
        self._saved = False
        self.actor: Any = None
        self.pid: int | None = None
        self._launch(None, None)

    def _launch(self, model_path: str | None, trainer_state: dict[str, Any] | None) -> None:
        self.actor = self._cls.options(name=f"{self.name}.{time.monotonic_ns()}", namespace=self.namespace,
                                       num_cpus=self.cfg.runtime.trainer_num_cpus, max_restarts=0,
                                       max_concurrency=2).remote(self.cfg, self.name, self.coordinator,
                                                                 self.health, self.publish_host)
        info = ray.get(self.actor.start.remote(model_path, trainer_state, credential=self._credential),
                       timeout=self.cfg.runtime.replica_start_timeout_s)
        self.pid = info["pid"]

    # -- the protocol -----------------------------------------------------------------------------
    def train(self, fields: Mapping[str, Any], version: int) -> dict[str, float]:
        self._trim_to_checkpoint()
        out = self._call(lambda: self.actor.train.remote(fields, version, credential=self._credential))
        self._log.append(("train", fields, version))
        self._version = version
        return {**out, **self.supervisor.metrics()}

    def sft(self, fields: Mapping[str, Any], lr: float) -> dict[str, float]:
        out = self._call(lambda: self.actor.sft.remote(fields, lr, credential=self._credential))
        self._log.append(("sft", fields, lr))
        return out

    def end_sft(self, version: int) -> dict[str, float]:
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
        self._call(lambda: self.actor.start.remote(str(ckpt / "model"), trainer_state, credential=self._credential))
        self._call(lambda: self.actor.publish.remote(version, credential=self._credential))

    def state_dict(self) -> dict[str, Any]:
        return self._call(lambda: self.actor.state_dict.remote(credential=self._credential))

    def save_model(self, path: Any) -> None:
        self._call(lambda: self.actor.save_model.remote(str(path), credential=self._credential))
        self._saved = True

    def close(self) -> None:
        try:
            ray.get(self.actor.stop.remote(credential=self._credential), timeout=30.0)
        except Exception:  # dead already
            pass
        ray.kill(self.actor, no_restart=True)

    # -- restarts ---------------------------------------------------------------------------------
    def _call(self, make_ref: Callable[[], Any]) -> Any:
        """``ray.get(make_ref())``; when the actor died: restart it and call again."""
        while True:
            try:
                return ray.get(make_ref())
            except _DIED as exc:
                self._recover(exc)

    def _recover(self, exc: BaseException) -> None:
        """Restart the actor (again while restarts die), within the restart budget.

        Raises:
            RuntimeServiceError: ``runtime.max_trainer_restarts`` restarts are used up.
        """
        while True:
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if not self.supervisor.allow_trainer_restart(reason):
                raise RuntimeServiceError(f"the trainer actor died ({reason}) and runtime.max_trainer_restarts="
                                 f"{self.cfg.runtime.max_trainer_restarts} restarts are used up") from exc
            log.warning("runtime: the trainer actor died (%s); restarting it from %s and %d logged operations",
                        reason, self._base.checkpoint or "the initial policy", len(self._log))
            try:
                self._restart()
                return
            except (*_DIED, ray.exceptions.GetTimeoutError) as again:
                exc = again

    def _restart(self) -> None:
        """A new actor: the base checkpoint, the logged operations replayed, the loop's version published."""
        if self.actor is not None:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:  # gone already
                pass
        base = self._base
        versions = [arg for kind, _, arg in self._log if kind != "sft"]
        expected = list(range(base.version + 1, base.version + 1 + len(versions)))
        if versions != expected or (versions and versions[-1] != self._version):
            raise CheckpointError(f"runtime ray: cannot rebuild policy version {self._version} from "
                                  f"{base.checkpoint or 'the initial policy'} (version {base.version}): the redo "
                                  f"log holds versions {versions}, expected {expected}")
        trainer_state = None
        if base.checkpoint is not None:
            from relax_agent.checkpoint import load_state

            _, trainer_state = load_state(base.checkpoint)
        self._launch(None if base.checkpoint is None else str(base.checkpoint / "model"), trainer_state)
        if self._log:
            ray.get(self.actor.replay.remote(self._log, credential=self._credential))
        ray.get(self.actor.publish.remote(self._version, credential=self._credential))

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
