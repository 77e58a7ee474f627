"""``runtime: ray``: rollout replicas and the trainer as Ray actors, supervised, restartable, elastic.

What runs where (all actors in ``data.ray_namespace``, named after ``data.ray_actor_name``)::

    driver (relax-agent train)   control loop (the same code as local), supervisor thread, control
                                 endpoint (HTTP, run.output_dir/runtime.json), checkpoints, metrics
    <bus>                        the TransferQueue metadata actor (relax_agent.data.ray)
    <bus>.weights                the weight coordinator (versions, subscribers, epochs); every call
                                 carries the run's credential (relax_agent.weights.auth), made here:
                                 the trainer gets the publisher secret, replicas the subscriber one
    <bus>.health                 the heartbeat table
    <bus>.trainer.*              the trainer (runtime.trainer_num_cpus); serves weights over tcp
    <bus>.rollout-<slot>.<gen>   runtime.rollout_replicas replicas (runtime.rollout_num_cpus each):
                                 engine + envs + sandboxes + reward client; put groups into the bus
    reward services              Ray Serve deployments (relax-agent serve-reward --runtime ray)

Ray is started with ``data.ray_num_cpus`` CPUs, or joined at ``data.ray_address`` (a cluster's head:
``ray start --head`` there, ``data.ray_address=HEAD:6379`` here); Ray places the actors. The bus
adopts the values put into it (``data.ray_adopt_values``), so a replica's rows outlive the replica.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import ray

from relax_agent.runtime.base import Runtime

log = logging.getLogger("relax_agent.runtime")


def check_ray_runtime(cfg: Any) -> None:
    """Refuse config combinations ``runtime: ray`` cannot run (also checked in preflight, before any
    model loads: :func:`relax_agent.preflight.check_ray_combination`).

    Raises:
        ConfigError: ``mode`` is not async (colocate shares one process), or ``weights.transport`` is
            not tcp (replicas are other processes, maybe other hosts).
    """
    from relax_agent.preflight import check_ray_combination

    check_ray_combination(cfg)


def watchdog_s(cfg: Any) -> float:
    """Longest wait for one group on one replica: ``runtime.request_timeout_s``, by default
    ``rollout.episode_timeout_s + 60`` (a group's episodes run concurrently)."""
    rt = cfg.runtime.request_timeout_s
    return rt if rt is not None else cfg.rollout.episode_timeout_s + 60.0


def bus_config(cfg: Any) -> Any:
    """``cfg.data`` for the Ray runtime: the Ray backend, values adopted by the bus (a warning names a
    key set otherwise, which is then ignored)."""
    data = cfg.data
    for key, want in (("backend", "ray"), ("ray_adopt_values", True)):
        if key in data.model_fields_set and getattr(data, key) != want:
            warnings.warn(f"runtime.kind='ray' ignores data.{key}={getattr(data, key)!r}: replicas put rows from "
                          f"their own processes, which the run must outlive (uses data.{key}={want!r})", stacklevel=3)
    return data.model_copy(update={"backend": "ray", "ray_adopt_values": True})


def _publish_host(cfg: Any) -> str:
    """The weight server's address: ``weights.host``, or this node's IP when joining a cluster and
    ``weights.host`` is loopback (replicas on other nodes must reach it)."""
    host = cfg.weights.host
    if cfg.data.ray_address is not None and host in ("127.0.0.1", "localhost"):
        return ray.util.get_node_ip_address()
    return host


def build_ray_runtime(cfg: Any, roles: Any) -> tuple[Runtime, Any]:
    """Start (or join) Ray and the run's actors; returns ``(runtime, bus)``.

    Blocks until ``runtime.rollout_replicas`` replicas and the trainer are ready. ``roles`` (the
    driver's, from :func:`relax_agent.roles.build_roles`) give the task splits, the tokenizer and
    episode specs; their engine and trainer are not used (each actor builds its own).

    Raises:
        ConfigError: see :func:`check_ray_runtime`; Ray could not start or connect.
        EngineError: replicas did not become ready (names the last failure).
    """
    from relax_agent.data.ray import RayTransferQueue, start_ray
    from relax_agent.runtime.ray_control import ControlServer
    from relax_agent.runtime.ray_health import start_health
    from relax_agent.runtime.ray_rollout import RayRolloutService, ReplicaPool
    from relax_agent.runtime.ray_supervisor import Supervisor
    from relax_agent.runtime.ray_trainer import RayTrainerService
    from relax_agent.runtime.ray_weights import ActorCoordinator, start_coordinator
    from relax_agent.weights.auth import RunCredential

    check_ray_runtime(cfg)
    data = bus_config(cfg)
    owns_ray = start_ray(data)
    closers: list[Any] = []
    try:
        bus = RayTransferQueue(data)
        closers.append(bus.close)
        prefix, ns = data.ray_actor_name, data.ray_namespace
        credential = RunCredential.generate(cfg.weights.read_service_token())
        publisher = ActorCoordinator(start_coordinator(f"{prefix}.weights", ns, credential), credential)
        coordinator = publisher.for_subscribers()  # replicas and the driver: no publisher secret
        health = start_health(f"{prefix}.health", ns)
        closers += [lambda: ray.kill(coordinator.handle), lambda: ray.kill(health)]
        pool = ReplicaPool()
        supervisor = Supervisor(cfg, pool, bus, coordinator, health, prefix, ns)
        supervisor.start()
        closers.insert(0, supervisor.stop)
        trainer = None
        if roles.trainer is not None:
            trainer = RayTrainerService(cfg, publisher, health, supervisor, supervisor.trainer_name, ns,
                                        _publish_host(cfg))
            closers.insert(1, trainer.close)
            roles.trainer = None  # the actor trains; the driver's copy is not needed
        supervisor.wait_ready(cfg.runtime.rollout_replicas, cfg.runtime.replica_start_timeout_s)
        if cfg.runtime.control_port is not None:
            control = ControlServer(supervisor, cfg.run.output_dir, port=cfg.runtime.control_port)
            closers.insert(0, control.close)
        rollout = RayRolloutService(pool, roles.runner, coordinator, watchdog_s(cfg),
                                    getattr(roles.engine, "route_layout", None), supervisor,
                                    cfg.runtime.max_groups_per_replica)
    except BaseException:
        _close_all(closers)
        if owns_ray:
            ray.shutdown()
        raise
    closers.append(roles.close)
    if owns_ray:
        closers.append(ray.shutdown)
    runtime = Runtime(rollout, trainer, roles.train_tasks, roles.heldout_tasks, roles.tokenizer.decode, closers)
    return runtime, bus


def _close_all(closers: list[Any]) -> None:
    for close in closers:
        try:
            close()
        except Exception:
            log.exception("runtime: closing after a failed start")
