"""The publisher-side facade: ``build_weight_sync(cfg, engines)`` and ``WeightSync.publish``.

Example::

    sync = build_weight_sync(WeightSyncConfig(transport="tcp"), [engine])
    stats = sync.publish(trainer.policy_state_dict(), version=step)   # every engine now on `step`
    sync.attach(new_engine)                                          # late join: pulls the latest first
    sync.close()

Rollout replicas in other processes subscribe through the coordinator's HTTP service
(``weights.service_port``) with :func:`relax_agent.weights.remote.connect_subscriber`, passing
``sync.service_url`` and the service's bearer token ``sync.service_token``.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from relax_agent.errors import WeightRefusedError, WeightSyncError
from relax_agent.weights.auth import new_secret
from relax_agent.weights.base import Receiver, Sender
from relax_agent.weights.config import WeightSyncConfig
from relax_agent.weights.coordinator import ApplyReport, Coordinator
from relax_agent.weights.digest import tensor_digest
from relax_agent.weights.subscriber import LAYOUT_REFUSAL, EngineSubscriber, NameMap

log = logging.getLogger("relax_agent.weights")

SYNC_S = "timing/weight_sync_s"
SYNC_GB_PER_S = "weights/gb_per_s"
PAUSE_S = "weights/engine_pause_s"
VERIFY_S = "weights/verify_s"
"""Seconds the slowest subscriber spent on the load's digest check (``weights.verify``)."""
DROPPED = "weights/subscribers_dropped"
"""Subscribers a publish unregistered for silence (``weights.subscriber_silence_s``)."""
RETRIES = "weights/publish_retries"
"""Times the version was published again after a refusal (``weights.publish_retries``)."""


@dataclass(frozen=True)
class SyncStats:
    """Timings of one publish.

    Attributes:
        version: the published policy version.
        bytes: bytes of the version's flat layout (what each subscriber receives or copies).
        seconds: wall time of ``publish``, from the call until every subscriber applied it.
        gb_per_s: ``bytes * subscribers / seconds / 1e9`` (delivered, end to end).
        pause_s: longest engine pause (time an engine could not decode while loading).
        stage_s: publisher time to snapshot and checksum the weights.
        transfer_s: longest subscriber receive time (bytes on the wire, checksums verified).
        subscribers: how many subscribers applied it.
        resumes: reconnections that resumed a transfer mid-way (tcp).
        lagging: subscribers that had not applied it when ``publish`` returned (did not report
            within ``weights.publish_timeout_s``, or still behind from an earlier publish); they
            keep following and catch up on their own.
        dropped: subscribers unregistered during this publish for silence
            (``weights.subscriber_silence_s``): not waited for.
        verify_s: time spent on digests (``weights.verify``): the publisher's digests of what it sent
            (tcp, nccl) plus the longest a subscriber spent on the received tensors' and the
            engine's digests.
        retries: times the version was published again after a subscriber refused it.
    """

    version: int
    bytes: int
    seconds: float
    gb_per_s: float
    pause_s: float
    stage_s: float
    transfer_s: float
    subscribers: int
    resumes: int = 0
    lagging: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    verify_s: float = 0.0
    retries: int = 0

    def as_metrics(self) -> dict[str, float]:
        """Namespaced metric keys for the metrics log."""
        return {SYNC_S: self.seconds, SYNC_GB_PER_S: self.gb_per_s, PAUSE_S: self.pause_s,
                VERIFY_S: self.verify_s, DROPPED: float(len(self.dropped)), RETRIES: float(self.retries)}


class WeightSync:
    """Publishes versions through one transport to every registered subscriber.

    Built by :func:`build_weight_sync`; ``coordinator``, ``sender`` and ``make_receiver``
    are the transport's parts. One thread publishes (``publish`` calls must not overlap).
    """

    def __init__(self, cfg: WeightSyncConfig, coordinator: Coordinator, sender: Sender,
                 make_receiver: Callable[[], Receiver] | None, service: Any = None) -> None:
        self.cfg = cfg
        self.coordinator = coordinator
        self._sender = sender
        self._make_receiver = make_receiver
        self._service = service
        self._local: list[EngineSubscriber] = []
        self._closed = False
        self._applied_floor = -1
        self._lagging: dict[str, int] = {}
        """subscriber id -> the version it had not applied when a publish gave up waiting for it."""
        self._publisher_token = coordinator.register_publisher(sender.address)

    @property
    def latest_version(self) -> int:
        """Latest complete version (-1 before the first publish)."""
        latest = self.coordinator.latest_version
        return -1 if latest is None else latest

    @property
    def service_url(self) -> str | None:
        """Base URL of the coordinator's HTTP service, when ``weights.service_port`` is set."""
        return None if self._service is None else self._service.url

    @property
    def service_token(self) -> str | None:
        """Bearer token of the coordinator's HTTP service (hand it to the replicas' ``connect_subscriber``);
        the same secret as :attr:`credential`."""
        return None if self._service is None else self._service.token

    @property
    def credential(self) -> str | None:
        """The run's subscriber secret (tcp: what a receiver answers the weight server's challenge
        with); None for transports that serve no bytes."""
        return self._sender.secret

    @property
    def subscribers(self) -> list[EngineSubscriber]:
        """Engines attached in this process."""
        return list(self._local)

    def attach(self, engine: Any, name: str = "engine", name_map: NameMap | None = None) -> EngineSubscriber:
        """Subscribe an engine of this process; it applies the latest version (if any) before returning.

        Raises:
            WeightSyncError: no in-process receiver for this transport (nccl), or the
                latest version does not fit the engine (the subscriber is removed again).
        """
        if self._make_receiver is None:
            raise WeightSyncError(f"weights.transport={self.cfg.transport!r} has no in-process subscribers; "
                                  "start one per rollout process with relax_agent.weights.remote.connect_subscriber")
        sub = EngineSubscriber(engine, self._make_receiver(), self.coordinator, name,
                               name_map if name_map is not None else (self.cfg.name_map or None),
                               self.cfg.poll_timeout_s, keepalive_s(self.cfg), verify_samples(self.cfg))
        report = sub.sync_latest(0.0)  # the latest version, if any (again on a newer one if a publish races it)
        if report is not None and report.error is not None:
            sub.close()
            raise WeightSyncError(report.error)
        if self.cfg.transport != "inproc":
            sub.start()
        self._local.append(sub)
        return sub

    def detach(self, sub: EngineSubscriber) -> None:
        """Stop syncing an attached engine."""
        self._local.remove(sub)
        sub.close()

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        """Publish ``state_dict`` as ``version`` and wait until every subscriber applied it.

        Args:
            state_dict: name -> tensor (the trainer's fp32 weights; any device).
            version: policy version, greater than :attr:`latest_version`.

        A subscriber that does not report within ``weights.publish_timeout_s`` does not fail the
        publish: it is listed in ``SyncStats.lagging`` (the version stays published and it catches
        up on its own), and later publishes do not wait for it until it has caught up.

        A version some subscriber refused is published again (the same weights, a new commit), up to
        ``weights.publish_retries`` times, while no engine applied it and unless every refusal is
        one of layout (weights that do not fit the engine).

        Raises:
            WeightRefusedError: a subscriber refused it on the last attempt (message lists each
                refusal and what the refusing engines serve).
            WeightSyncError: ``version`` is not newer; ``version``
                is not a non-negative int; this sync is closed; ``weights.check_finite`` is on and
                a floating-point tensor holds NaN or inf (nothing is sent). A refused version never becomes
                the latest complete version, and a corrected state dict may be published under the
                same number (unless some engine applied it: then a newer number is needed).
        """
        version = self._check_version(version)
        for attempt in range(self.cfg.publish_retries + 1):
            try:
                stats = self._publish_once(state_dict, version)
            except WeightRefusedError as exc:
                if attempt == self.cfg.publish_retries or not exc.retryable or version <= self._applied_floor:
                    raise
                log.warning("weights: version %d was refused (attempt %d of %d); publishing it again: %s", version,
                            attempt + 1, self.cfg.publish_retries + 1, exc)
                continue
            return replace(stats, retries=attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _publish_once(self, state_dict: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        """One attempt of :meth:`publish` (``version`` already checked)."""
        start = time.perf_counter()
        if self.cfg.check_finite:
            _check_finite(state_dict, version)
        meta = self._sender.stage(state_dict, version)
        stage_s = time.perf_counter() - start
        sent_digest_s = 0.0
        if self.cfg.verify and self.cfg.transport != "inproc":  # inproc subscribers read these very tensors
            digest_start = time.perf_counter()
            meta = replace(meta, digests={t.name: tensor_digest(state_dict[t.name], samples=self.cfg.verify_samples)
                                          .to_json() for t in meta.tensors if t.alias_of is None})
            sent_digest_s = time.perf_counter() - digest_start
        try:
            if self.cfg.transport == "inproc":
                for sub in self._local:  # refuse before any engine changes
                    sub.check(meta)
            waiting, behind = self._still_lagging(self.coordinator.subscribers())
            meta = self.coordinator.commit(meta, publisher=self._publisher_token)
        except WeightSyncError:
            self._sender.retract(version)
            raise
        self._sender.send(meta)
        if self.cfg.transport == "inproc":
            for sub in self._local:
                sub.apply(meta)
        reports, missing, dropped = self.coordinator.wait_reports_dropping(
            version, waiting, self.cfg.publish_timeout_s, self.cfg.subscriber_silence_s)
        seconds = time.perf_counter() - start
        if any(r.error is not None and r.version == version for r in reports.values()):
            self._withdraw(version, reports)
        self._lagging.update({s: version for s in missing})
        if missing:
            log.warning("weights: version %d: subscribers %s did not apply it within weights.publish_timeout_s="
                        "%s s; reported as lagging (they catch up on their own)", version, missing,
                        self.cfg.publish_timeout_s)
        stats = _stats(meta.version, meta.total_bytes, seconds, stage_s, reports, tuple(behind + missing))
        return replace(stats, dropped=tuple(dropped), verify_s=stats.verify_s + sent_digest_s)

    def _still_lagging(self, subscribers: list[str]) -> tuple[list[str], list[str]]:
        """Split ``subscribers`` into those to wait for and those still behind a version an earlier
        publish gave up on (waited for again once they reported it)."""
        waiting, behind = [], []
        for sub in subscribers:
            lagged_at = self._lagging.get(sub)
            reported = self.coordinator.reported_version(sub)
            if lagged_at is not None and (reported is None or reported < lagged_at):
                behind.append(sub)
            else:
                self._lagging.pop(sub, None)
                waiting.append(sub)
        return waiting, behind

    def _check_version(self, version: Any) -> int:
        """``version`` as an int. Raises WeightSyncError (naming the value) when it cannot be published:
        this sync is closed, it is not a non-negative integer (numpy integers count; bool does not),
        or it is not newer than the latest complete version (or a version some engine applied)."""
        if self._closed:
            raise WeightSyncError(f"publish(version={version!r}): this weight sync is closed")
        if isinstance(version, (bool, np.bool_)) or not isinstance(version, numbers.Integral) or version < 0:
            raise WeightSyncError(f"publish(version={version!r}): a policy version is a non-negative int, "
                                  f"not {type(version).__name__}")
        version = int(version)
        floor = max(self.latest_version, self._applied_floor)
        if version <= floor:
            raise WeightSyncError(f"publish(version={version}): not newer than the latest version {floor}")
        return version

    def _withdraw(self, version: int, reports: dict[str, ApplyReport]) -> None:
        """Some subscriber refused ``version``: it stops being the latest complete version (late
        joiners get the previous one) and may be published again, unless an engine applied it."""
        self.coordinator.retract(version)
        self._sender.retract(version)
        if any(r.error is None and r.version == version for r in reports.values()):
            self._applied_floor = version  # engines hold it: the next publish must be newer
        _raise_refusals(version, reports)

    def close(self) -> None:
        """Detach every local engine, stop serving. Idempotent."""
        self._closed = True
        for sub in self._local:
            sub.close()
        self._local.clear()
        self._sender.close()
        self.coordinator.close()  # long polls of remote replicas return now, not after poll_timeout_s
        if self._service is not None:
            self._service.close()
            self._service = None


def _raise_refusals(version: int, reports: dict[str, ApplyReport]) -> None:
    refused = [r for r in reports.values() if r.error is not None and r.version == version]
    if refused:
        lines = "\n".join(r.error or "" for r in refused)
        raise WeightRefusedError(f"version {version} was refused by {len(refused)} of {len(reports)} subscribers "
                                 "(they keep their previous version, except an HF engine whose copy failed "
                                 f"verification: it serves nothing until a later version verifies):\n{lines}",
                                 retryable=not all(r.stats.get(LAYOUT_REFUSAL) for r in refused))


def _stats(version: int, nbytes: int, seconds: float, stage_s: float, reports: dict[str, ApplyReport],
           lagging: tuple[str, ...] = ()) -> SyncStats:
    done = [r.stats for r in reports.values() if r.version == version]
    n = len(done)
    return SyncStats(version=version, bytes=nbytes, seconds=seconds,
                     gb_per_s=nbytes * n / seconds / 1e9 if seconds > 0 else 0.0,
                     pause_s=max((s.get("pause_s", 0.0) for s in done), default=0.0), stage_s=stage_s,
                     transfer_s=max((s.get("receive_s", 0.0) for s in done), default=0.0), subscribers=n,
                     resumes=int(sum(s.get("resumes", 0.0) for s in done)), lagging=lagging,
                     verify_s=max((s.get("verify_s", 0.0) for s in done), default=0.0))


def build_weight_sync(cfg: WeightSyncConfig, engines: Sequence[Any] = ()) -> WeightSync:
    """A :class:`WeightSync` for ``cfg.transport`` with ``engines`` of this process attached.

    Raises:
        WeightSyncError: nccl with in-process engines, or the transport could not start.
    """
    coordinator = Coordinator()
    secret = cfg.read_service_token() or new_secret()  # the run's credential (weights.auth)
    sender, make_receiver = _transport(cfg, secret)  # first: a busy weights.port must not leave a service running
    sync = WeightSync(cfg, coordinator, sender, make_receiver)
    try:
        if cfg.service_port is not None:
            from relax_agent.weights.service import serve_coordinator

            sync._service = serve_coordinator(coordinator, cfg.host, cfg.service_port, token=secret)
        for i, engine in enumerate(engines):
            sync.attach(engine, name=f"engine{i}")
    except BaseException:
        sync.close()
        raise
    return sync


def verify_samples(cfg: WeightSyncConfig) -> int | None:
    """What an :class:`EngineSubscriber` gets as ``verify_samples``: None with ``weights.verify`` off."""
    return cfg.verify_samples if cfg.verify else None


def keepalive_s(cfg: WeightSyncConfig) -> float:
    """How often a subscriber tells the coordinator it is alive while it applies a version."""
    return cfg.subscriber_silence_s / 4


def _transport(cfg: WeightSyncConfig, secret: str) -> tuple[Sender, Callable[[], Receiver] | None]:
    if cfg.transport == "inproc":
        from relax_agent.weights.inproc import InprocReceiver, InprocSender

        inproc = InprocSender(cfg.bucket_bytes)
        return inproc, lambda: InprocReceiver(inproc)
    if cfg.transport == "tcp":
        from relax_agent.weights.tcp import TcpReceiver, TcpSender

        tcp = TcpSender(cfg, secret)
        return tcp, lambda: TcpReceiver(cfg, secret=secret)
    from relax_agent.weights.nccl import NcclSender

    return NcclSender(cfg), None


def _check_finite(state_dict: Mapping[str, torch.Tensor], version: int) -> None:
    """Raise WeightSyncError naming the floating-point tensors of ``state_dict`` that hold NaN or inf.

    One fp32 reduction per tensor: NaN and inf propagate into the sum (inf - inf is NaN). A sum
    that is not finite is confirmed element-wise, since finite weights can still overflow an
    fp32 sum (two of 3e38); that costs a second pass only for such tensors."""
    bad = [name for name, t in state_dict.items()
           if torch.is_floating_point(t) and not bool(torch.isfinite(t.sum(dtype=torch.float32)))
           and not bool(torch.isfinite(t).all())]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise WeightSyncError(f"publish(version={version}): {len(bad)} tensor(s) hold NaN or inf ({shown}); "
                              "nothing was sent and the engines keep their last version "
                              "(weights.check_finite: false publishes them anyway)")
