"""Wires a run: the data bus, the runtime's services over the built roles, the controller."""

from __future__ import annotations

from typing import Any

from relax_agent.config import RelaxConfig
from relax_agent.control.loop import Controller


def build_controller(cfg: RelaxConfig, roles: Any, reporter: Any = None) -> Controller:
    """A :class:`Controller` for ``roles`` (:func:`relax_agent.roles.build_run_roles`) with the services of
    ``runtime.kind``: local (in this process, on the bus of ``cfg.data``) or ray (Ray actors, see
    :func:`relax_agent.runtime.ray.build_ray_runtime`); ``controller.close()`` closes them all.

    Raises:
        ConfigError: the runtime cannot run this config, or Ray could not start; ``runtime: ray`` with
            roles that are not the driver's (see :func:`relax_agent.runtime.ray.build_ray_runtime`).
        DataError: the bus could not start (``data.backend``).
        WeightSyncError: the weight sync could not start (``weights.transport``).
        EngineError: ``runtime: ray``: rollout replicas did not become ready.
    """
    from relax_agent.data import build_transfer_queue
    from relax_agent.runtime.local import build_local_runtime

    if cfg.runtime.kind == "ray":
        from relax_agent.runtime.ray import build_ray_runtime

        ray_runtime, ray_bus = build_ray_runtime(cfg, roles)
        return Controller(cfg, ray_runtime, ray_bus, reporter)
    bus = build_transfer_queue(cfg.data)
    try:
        runtime = build_local_runtime(cfg, roles, bus)
    except BaseException:
        bus.close()
        raise
    runtime.closers.insert(0, bus.close)  # before the roles close: they shut down a Ray this run started
    return Controller(cfg, runtime, bus, reporter)
