"""Rollout replicas in other processes: subscribe an engine through the coordinator's HTTP service.

Example (in the rollout process)::

    # url and token: WeightSync.service_url / .service_token on the trainer side (or weights.service_token_env)
    sub = connect_subscriber("http://127.0.0.1:8600", engine, WeightSyncConfig(transport="tcp"), token=token)
    # the engine now holds the latest published version (if any) and follows new ones
    ...
    sub.close()
"""

from __future__ import annotations

from typing import Any

from relax_agent.errors import WeightSyncError
from relax_agent.weights.base import Receiver
from relax_agent.weights.config import WeightSyncConfig
from relax_agent.weights.service import HttpCoordinator
from relax_agent.weights.subscriber import EngineSubscriber, NameMap
from relax_agent.weights.sync import keepalive_s, verify_samples


def connect_subscriber(url: str, engine: Any, cfg: WeightSyncConfig, name: str = "replica",
                       name_map: NameMap | None = None, rank: int | None = None, address: str | None = None,
                       wait_first_s: float = 0.0, follow: bool = True, token: str | None = None) -> EngineSubscriber:
    """Register ``engine`` with the coordinator at ``url``, pull the latest version, then follow.

    Args:
        url: the coordinator service (``WeightSync.service_url`` on the trainer side).
        engine: the replica's inference engine.
        cfg: the run's ``weights`` section (transport, timeouts, name map).
        name: label in the coordinator.
        name_map: overrides ``cfg.name_map``.
        rank: nccl only: this process's rank in the weight-sync group (1 .. world_size-1).
        address: tcp only: fetch from this "host:port" instead of the advertised address.
        wait_first_s: wait this long for a first version to exist before returning.
        follow: keep applying new versions in a background thread.
        token: the run's weight credential: the service's bearer token (``WeightSync.service_token``
            on the trainer side), also the secret the tcp weight server challenges for;
            None reads it from ``cfg.service_token_env``.

    Raises:
        WeightSyncError: the coordinator cannot be reached or refuses the token (none given and
            no ``weights.service_token_env``), the transport is inproc, or the latest version
            does not fit the engine.
    """
    token = token if token is not None else cfg.read_service_token()
    if token is None:
        raise WeightSyncError(f"connect_subscriber({url!r}): the coordinator service needs its bearer token; pass "
                              "token=WeightSync.service_token or set weights.service_token_env")
    coordinator = HttpCoordinator(url, timeout_s=cfg.connect_timeout_s, token=token)
    sub = EngineSubscriber(engine, _receiver(cfg, rank, address, token), coordinator, name,
                           name_map if name_map is not None else (cfg.name_map or None), cfg.poll_timeout_s,
                           keepalive_s(cfg), verify_samples(cfg))
    report = sub.sync_latest(wait_first_s)
    if report is not None and report.error is not None:
        sub.close()
        raise WeightSyncError(report.error)
    return sub.start() if follow else sub


def _receiver(cfg: WeightSyncConfig, rank: int | None, address: str | None, secret: str) -> Receiver:
    if cfg.transport == "tcp":
        from relax_agent.weights.tcp import TcpReceiver

        return TcpReceiver(cfg, address, secret=secret)  # the service token is the run's weight credential
    if cfg.transport == "nccl":
        from relax_agent.weights.nccl import NcclReceiver

        if rank is None:
            raise WeightSyncError("weights.transport=nccl: connect_subscriber needs this process's rank")
        return NcclReceiver(cfg, rank)
    raise WeightSyncError("weights.transport=inproc has no remote subscribers; use tcp or nccl")
