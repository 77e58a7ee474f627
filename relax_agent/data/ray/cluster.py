"""Where the bus runs: a local Ray started (or a cluster joined) for it, and the metadata actor pinned
to the creating process's node."""

from __future__ import annotations

from typing import Any

import ray

from relax_agent.data.config import DataConfig
from relax_agent.errors import ConfigError

LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0}
"""Ray system config of a local Ray this project starts. Ray runs its worker processes at nice 15 by
default; every role of a run (trainer, rollout replicas, data bus, weight coordinator, heartbeats)
is a Ray worker, so at nice 15 any other busy process on the machine starves the run: a nice-0 busy
loop on each core leaves each worker about 3% of a core, heartbeats lag past
``runtime.heartbeat_timeout_s`` and healthy replicas are replaced as hung. At nice 0 they get a fair
share. (A cluster joined through ``data.ray_address`` keeps its own setting.)"""


def on_this_node() -> Any:
    """Put the metadata actor on the creating process's node (on a cluster of several hosts the bus
    stays with the driver, not on a worker host that may die)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def start_ray(cfg: DataConfig) -> bool:
    """Make sure Ray runs for the data bus: connect to ``cfg.ray_address`` when set, else start a
    local Ray with ``cfg.ray_num_cpus`` CPUs, no dashboard and :data:`LOCAL_RAY_SYSTEM_CONFIG`.
    Nothing happens when Ray is already initialised in this process.

    Returns:
        True when this call started (or connected) Ray: the caller shuts it down with ``ray.shutdown()``.

    Raises:
        ConfigError: Ray could not start or connect (names ``data.ray_address`` / ``data.ray_num_cpus``).
    """
    if ray.is_initialized():
        return False
    try:
        if cfg.ray_address is not None:
            ray.init(address=cfg.ray_address, include_dashboard=False)
        else:
            ray.init(num_cpus=cfg.ray_num_cpus, include_dashboard=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = (f"connect to data.ray_address={cfg.ray_address!r}" if cfg.ray_address is not None
                 else f"start a local Ray with data.ray_num_cpus={cfg.ray_num_cpus}")
        raise ConfigError(f"data.backend='ray': cannot {where}: {type(exc).__name__}: {exc}") from exc
    return True
