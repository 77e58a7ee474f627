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
``ray start --head`` there, ``data.ray_address=HEAD:6379`` here). Ray places the actors; on a
cluster of several hosts ``runtime.rollout_resources`` / ``runtime.trainer_resources`` (Ray custom
resources the hosts were started with) say which hosts take replicas and the trainer, and the
bus, the coordinator and the heartbeat table stay on the driver's node. Listeners other hosts reach
bind ``weights.host`` (the trainer's weight server) and ``runtime.control_host`` (the controller
endpoint), advertise the node's own address for a wildcard bind, and authenticate every caller. The bus
adopts the values put into it (``data.ray_adopt_values``), so a replica's rows outlive the replica.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import ray

from relax_agent.errors import ConfigError
from relax_agent.netaddr import advertised, is_loopback, is_wildcard
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


def weight_server_host(cfg: Any, node_ip: str) -> tuple[str, str]:
    """``(bind, advertise)`` of the trainer's weight server on the node whose address is ``node_ip``
    (called inside the trainer actor, so the node is the trainer's, wherever Ray placed it).

    ``weights.host`` binds; when joining a cluster (``data.ray_address``) a loopback one is replaced by
    ``node_ip`` (replicas on other nodes must reach it); a wildcard one (``0.0.0.0``) listens
    everywhere and advertises ``node_ip``.
    """
    host = cfg.weights.host
    if cfg.data.ray_address is not None and is_loopback(host):
        host = node_ip
    return host, advertised(host, node_ip)


def control_address(cfg: Any) -> tuple[str, str | None]:
    """``(bind, advertise)`` of the controller endpoint: ``runtime.control_host``, advertised as the
    driver's node address when it is a wildcard (None: the bound address)."""
    host = cfg.runtime.control_host
    return host, (ray.util.get_node_ip_address() if is_wildcard(host) else None)


def placement(resources: dict[str, float], spread: bool = False) -> dict[str, Any]:
    """``.options(...)`` keywords that put an actor on a node offering ``resources`` (Ray custom
    resources, e.g. ``{"rollout_host": 0.01}``; empty: anywhere), spread over such nodes when ``spread``."""
    out: dict[str, Any] = {"resources": dict(resources)} if resources else {}
    if spread:
        out["scheduling_strategy"] = "SPREAD"
    return out


def replica_env_vars(cfg: Any) -> dict[str, str]:
    """Environment variables a rollout replica needs from the driver's environment: the bearer token of
    each remote reward service (``reward.token_env``), which a replica on another host would not have.
    Names whose variable is unset here are left out (the driver's preflight has already refused them)."""
    import os

    names = {c.token_env for c in cfg.reward.components if c.source == "remote" and c.token_env}
    return {name: os.environ[name] for name in sorted(names) if os.environ.get(name)}


PLACEMENT_FILE = "placement.jsonl"
"""In ``run.output_dir``: one JSON line per actor start (trainer or rollout replica): where it runs."""


def record_placement(cfg: Any, role: str, name: str, info: dict[str, Any]) -> None:
    """Append ``{"time", "role", "name", "pid", "node_id", "node_ip"}`` (and the trainer's
    ``weights_address``, a replica's ``policy_version`` once ready) to ``run.output_dir/placement.jsonl``:
    which host each replica and the trainer ran on. A failure to write is logged, never raised."""
    import json
    import time
    from pathlib import Path

    row: dict[str, Any] = {"time": time.time(), "role": role, "name": name,
                           **{k: info.get(k) for k in ("pid", "node_id", "node_ip", "weights_address",
                                                       "policy_version") if k in info}}
    try:
        path = Path(cfg.run.output_dir) / PLACEMENT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as exc:
        log.warning("runtime: could not record where %s runs: %s", name, exc)


def on_this_node() -> Any:
    """A scheduling strategy that puts an actor on the calling process's node (the run's shared actors:
    the weight coordinator and the heartbeat table stay with the driver, not on a worker host that may
    die; a soft affinity was not enough: Ray placed a 0-CPU actor on a worker host)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def warn_open_cluster(cfg: Any) -> bool:
    """Warn (and return True) when the run joins a Ray cluster (``data.ray_address``) whose token
    authentication is off in this process (``RAY_AUTH_MODE`` is not ``token``): every process that
    reaches the head's port can join Ray and reach the data bus, which has no credential of its own
    (the trainer, the weight coordinator, the weight server and the control endpoint check theirs)."""
    import os

    if cfg.data.ray_address is None or os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return False
    log.warning("runtime: joined the Ray cluster at data.ray_address=%s without Ray token authentication "
                "(RAY_AUTH_MODE=token, RAY_AUTH_TOKEN on every node and here): whoever reaches its port can join "
                "and read the run's rows from the data bus", cfg.data.ray_address)
    return True


def build_ray_runtime(cfg: Any, roles: Any) -> tuple[Runtime, Any]:
    """Start (or join) Ray and the run's actors; returns ``(runtime, bus)``.

    Blocks until ``runtime.rollout_replicas`` replicas and the trainer are ready. ``roles`` (the
    driver's :class:`~relax_agent.roles.DriverRoles`, from :func:`relax_agent.roles.build_driver_roles`)
    give the task splits, the tokenizer and episode specs; each actor builds its own engine or trainer.

    Raises:
        ConfigError: see :func:`check_ray_runtime`; Ray could not start or connect; ``roles`` are not a
            :class:`~relax_agent.roles.DriverRoles`.
        EngineError: replicas did not become ready (names the last failure).
    """
    from relax_agent.data.ray import RayTransferQueue, start_ray
    from relax_agent.roles import DriverRoles
    from relax_agent.runtime.ray_control import ControlServer
    from relax_agent.runtime.ray_health import start_health
    from relax_agent.runtime.ray_roles import COORDINATOR, DATA_BUS, HEALTH, GuardedBus, RoleWatch
    from relax_agent.runtime.ray_rollout import RayRolloutService, ReplicaPool
    from relax_agent.runtime.ray_supervisor import Supervisor
    from relax_agent.runtime.ray_trainer import RayTrainerService
    from relax_agent.runtime.ray_weights import ActorCoordinator, start_coordinator
    from relax_agent.weights.auth import RunCredential

    if not isinstance(roles, DriverRoles):
        raise ConfigError(f"runtime.kind='ray' was handed {type(roles).__name__}: the driver's roles are built by "
                          "relax_agent.roles.build_run_roles (the actors load the policy, the driver does not)")
    check_ray_runtime(cfg)
    data = bus_config(cfg)
    owns_ray = start_ray(data)
    warn_open_cluster(cfg)
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
        watch = RoleWatch({DATA_BUS: (prefix, bus._actor), COORDINATOR: (f"{prefix}.weights", coordinator.handle),
                           HEALTH: (f"{prefix}.health", health)}, ns)
        pool = ReplicaPool()
        supervisor = Supervisor(cfg, pool, bus, coordinator, health, prefix, ns, watch)
        supervisor.start()
        closers.insert(0, supervisor.stop)
        trainer = RayTrainerService(cfg, publisher, health, supervisor, supervisor.trainer_name, ns, None, bus)
        closers.insert(1, trainer.close)
        supervisor.wait_ready(cfg.runtime.rollout_replicas, cfg.runtime.replica_start_timeout_s)
        if cfg.runtime.control_port is not None:
            bind, advertise = control_address(cfg)
            control = ControlServer(supervisor, cfg.run.output_dir, host=bind, port=cfg.runtime.control_port,
                                    advertise=advertise)
            closers.insert(0, control.close)
        rollout = RayRolloutService(pool, roles.specs, coordinator, watchdog_s(cfg), supervisor,
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
    if cfg.runtime.autoscale.enabled:
        from relax_agent.runtime.autoscale import Autoscaler

        runtime.step_hooks.append(Autoscaler(cfg.runtime.autoscale, supervisor, cfg.runtime.max_rollout_replicas).observe)
    return runtime, GuardedBus(bus, watch)


def _close_all(closers: list[Any]) -> None:
    for close in closers:
        try:
            close()
        except Exception:
            log.exception("runtime: closing after a failed start")
