"""The trainer as a Ray actor.

:class:`TrainerActor` builds the trainer from the run's config (``trainer.backend``; the policy
from ``model.path`` or a checkpoint's ``model/``) and publishes through a
:class:`~relax_agent.weights.sync.WeightSync` whose coordinator is the run's named coordinator
actor (bytes over tcp, straight to the replicas). Inside it is the local
:class:`~relax_agent.runtime.local.LocalTrainerService`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray

from relax_agent.errors import RuntimeServiceError
from relax_agent.runtime.base import TrainRef
from relax_agent.runtime.ray import weight_server_host
from relax_agent.weights.auth import RunCredential, same_secret

log = logging.getLogger("relax_agent.runtime")


def _run_only(method: Callable[..., Any]) -> Callable[..., Any]:
    """Make a :class:`TrainerActor` method take a ``credential`` keyword and refuse (raise
    :class:`RuntimeServiceError`, logged) a caller whose credential lacks the run's publisher secret:
    the actor is named, so any process joined to the run's Ray could otherwise read the policy
    (``state_dict``), train it on its own rows or publish."""

    def guarded(self: TrainerActor, *args: Any, credential: Any = None, **kwargs: Any) -> Any:
        held = credential.publisher if isinstance(credential, RunCredential) else None
        if not same_secret(self.coordinator.credential.publisher, held):
            log.warning("trainer actor: refused %s: the caller does not hold the run's publisher credential",
                        method.__name__)
            raise RuntimeServiceError(f"trainer actor: {method.__name__} refused: it needs the run's publisher "
                                      "credential, which this caller does not hold")
        self.doing = method.__name__  # what its heartbeats say it is doing while the call runs
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
        publish_host: address the weight server binds to and advertises; None: from ``weights.host`` and
            this actor's node address (:func:`~relax_agent.runtime.ray.weight_server_host`).
        bus: the run's data bus (a :class:`~relax_agent.data.ray.RayTransferQueue`), read by reference.
    """

    def __init__(self, cfg: Any, name: str, coordinator: Any, health: Any, publish_host: str | None,
                 bus: Any) -> None:
        from relax_agent.runtime.ray_rollout import quiet_actor_logs

        quiet_actor_logs()
        self.cfg, self.name, self.coordinator, self.health = cfg, name, coordinator, health
        self.publish_host, self.bus = publish_host, bus
        self.weights_address: str | None = None
        """``host:port`` the weight server advertises (set by :meth:`start`)."""
        self.service: Any = None
        self.version = 0
        self.busy = False
        self.doing: str | None = None
        self._call_started = 0.0

    @_run_only
    def start(self, model_path: str | None = None, trainer_state: dict[str, Any] | None = None,
              keep_publisher: bool = False) -> dict[str, Any]:
        """Build the trainer from ``model_path`` (None: ``model.path``) and ``trainer_state``; register as
        the weight publisher (a new coordinator epoch when one registered before), or with
        ``keep_publisher`` keep this actor's registration (a resume: the replicas that already follow
        this publisher keep following it)."""
        from relax_agent.runtime.local import LocalTrainerService
        from relax_agent.weights.sync import WeightSync
        from relax_agent.weights.tcp import TcpReceiver, TcpSender

        kept = self.service.sync if keep_publisher and self.service is not None else None
        if self.service is not None and kept is None:
            self.service.close()
        elif self.service is not None:
            from relax_agent.train.backends.base import HoldsProcesses

            if isinstance(self.service.trainer, HoldsProcesses):
                self.service.trainer.close()
        if self.cfg.run.num_threads:
            import torch

            torch.set_num_threads(self.cfg.run.num_threads)
        trainer, tokenizer = _build_trainer(self.cfg, model_path)
        if trainer_state is not None:
            trainer.load_state_dict(trainer_state)
        bind, advertise = (self.publish_host, self.publish_host) if self.publish_host is not None else \
            weight_server_host(self.cfg, ray.util.get_node_ip_address())
        w = self.cfg.weights.model_copy(update={"host": bind})
        secret = self.coordinator.credential.subscriber  # the tcp server challenges for the run's credential
        if kept is None:
            sender = TcpSender(w, secret, advertise)
            self.weights_address = sender.address
            sync = WeightSync(w, self.coordinator, sender, lambda: TcpReceiver(w, secret=secret))
        else:
            sync = kept
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.service = LocalTrainerService(trainer, sync, int(pad), getattr(tokenizer, "save_pretrained", None),
                                           self.bus)
        self._beat()
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "weights_address": self.weights_address}

    def _beat(self) -> None:
        busy = self.busy
        self.health.beat.remote(self.name, {"pid": os.getpid(), "policy_version": self.version, "busy": busy,
                                            "doing": self.doing if busy else None,
                                            "call_s": time.monotonic() - self._call_started if busy else None})

    def _work(self, fn: Callable[[], Any]) -> Any:
        """Run one call, beating before and after (the trainer's work loop is its calls) and, from a
        helper thread, every ``runtime.heartbeat_interval_s`` during it with the call it is in and
        for how long (``doing``, ``call_s``): a hung call keeps beating, a stopped process does not."""
        self.busy, self._call_started = True, time.monotonic()
        self._beat()
        stop = threading.Event()
        beats = threading.Thread(target=self._beat_during_call, args=(stop,), name="trainer-beat", daemon=True)
        beats.start()
        try:
            return fn()
        finally:
            stop.set()
            beats.join()
            self.busy = False
            self._beat()

    def _beat_during_call(self, stop: threading.Event) -> None:
        while not stop.wait(self.cfg.runtime.heartbeat_interval_s):
            self._beat()

    @_run_only
    def train(self, ref: TrainRef) -> dict[str, float]:
        """One update on ``ref``'s rows (read from the bus here), published as ``ref.version``."""
        out = self._work(lambda: self.service.train(ref))
        self.version = ref.version
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
        ``("train", ref, version)`` (rows read from the bus again), ``("sft", fields, lr)``,
        ``("end_sft", None, version)``."""

        def run() -> None:
            for kind, fields, arg in ops:
                if kind == "train":
                    self.service.update(self.service.read(fields)[0], fields.side_branches)
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
        """The trainer state for a checkpoint (in the actor's work thread)."""
        return self._work(self.service.state_dict)

    @_run_only
    def save_model(self, path: str) -> None:
        """Write the policy (weights and tokenizer) to folder ``path`` on the actor's host."""
        self._work(lambda: self.service.save_model(path))

    def pid(self) -> int:
        """The actor's process id."""
        return os.getpid()

    @_run_only
    def stop(self) -> None:
        """Close the trainer service, if one is built (the actor itself stays)."""
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
