"""Engine side of weight sync: check a version's layout, receive it, apply it atomically.

An :class:`EngineSubscriber` binds one inference engine to a coordinator and a receiver.
For each new version it

1. maps publisher names to the engine's (``name_map``) and compares names, shapes and
   dtypes with the engine's ``weight_layout()``: any difference refuses the version with a
   :class:`WeightSyncError` listing them, before a byte is fetched or applied;
2. receives the bytes (the tcp receiver verifies each bucket's checksum);
3. calls ``engine.load_weights(tensors, version)``, which swaps them in between decode
   batches (casting fp32 master weights to the engine's bf16/fp16), so no generation mixes
   versions; the engine keeps serving its last complete version if anything fails;
4. with ``weights.verify`` (on by default) and an engine whose ``load_weights`` takes
   ``expected_digests``: passes the digests of the received tensors, cast to the engine's dtypes
   (:mod:`relax_agent.weights.digest`); the engine compares them with a digest of what it holds
   after the load, before it serves the version, and refuses the version naming the tensor on a
   mismatch (see the engine for what it then serves). Before that, over tcp and nccl, the received
   tensors are checked against the digests the publisher computed of what it sent (in the
   version's metadata); inproc subscribers receive the publisher's own tensors. So the check
   covers publisher -> transport -> engine;
5. reports the outcome and timings (``verify_s``: digest time, both sides) to the coordinator.

``sync_latest()`` is what a late-joining replica calls before it serves; ``start()`` follows
new versions in a background thread. Versions count within a publisher epoch (the
coordinator's run id): within one, the engine's version only moves forward (an older commit
that arrives late is not applied); a coordinator of another epoch (a restarted publisher) does
not know this subscriber, which then registers again and takes that run's latest version even
if its number is lower. A refused commit is remembered and never retried (it is
logged once); the subscriber waits for the publisher to withdraw it and publish a newer (or a
corrected) one while the engine keeps serving its last complete version.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from relax_agent.errors import VersionGoneError, WeightSyncError
from relax_agent.rollout.engines.base import DeclaresWeightLayout, TimesWeightLoads
from relax_agent.weights.base import Receiver
from relax_agent.weights.coordinator import ApplyReport, CoordinatorApi
from relax_agent.weights.digest import TensorDigest, expected_digests, tensor_digest
from relax_agent.weights.digest import compare as compare_digests
from relax_agent.weights.meta import VersionMeta, format_diff, layout_diff

log = logging.getLogger("relax_agent.weights")

LAYOUT_REFUSAL = "layout_refusal"
"""``ApplyReport.stats`` key set (1.0) on a refusal of weights that do not fit the engine's layout:
publishing the same weights again cannot change it (see ``weights.publish_retries``)."""
_REFUSED_PAUSE_S = 0.2
"""How often a follower looks again while the commit it refused is still the latest one."""

_MAX_SUPERSEDED = 16
"""Pulls in a row that :meth:`EngineSubscriber.sync_latest` starts again on the newest version when
the publisher replaced the one being pulled (a fast trainer publishing during every pull)."""

NameMap = Mapping[str, str] | Callable[[str], "str | None"]
"""Publisher name -> engine name; a callable may return None to skip a tensor."""


def _takes_digests(engine: Any) -> bool:
    """Whether ``engine.load_weights`` accepts ``expected_digests`` (it can verify a load)."""
    try:
        return "expected_digests" in inspect.signature(engine.load_weights).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def map_names(names: list[str], name_map: NameMap | None) -> dict[str, str]:
    """Publisher name -> engine name for every name the engine takes (dict: unlisted names unchanged)."""
    if name_map is None:
        return {n: n for n in names}
    if callable(name_map):
        mapped = {n: name_map(n) for n in names}
        return {n: m for n, m in mapped.items() if m is not None}
    return {n: name_map.get(n, n) for n in names}


class EngineSubscriber:
    """Keeps one engine on the latest published policy version.

    Args:
        engine: an ``InferenceEngine``; when it has ``weight_layout()`` (name -> (shape,
            dtype)) versions are checked against it before any byte moves.
        receiver: the transport's subscriber side.
        coordinator: in-process :class:`Coordinator` or ``HttpCoordinator``.
        name: label in the coordinator and in errors.
        name_map: publisher name -> engine name, when layouts name parameters differently.
        poll_timeout_s: long-poll length of the follow thread.
        keepalive_s: while a version is received and loaded, tell the coordinator every this many
            seconds that this subscriber is alive (so a long transfer is not taken for silence,
            ``weights.subscriber_silence_s``); None sends none.
        verify_samples: ``weights.verify``: elements per tensor the load's digest check samples
            (``weights.verify_samples``); None loads unverified.
    """

    def __init__(self, engine: Any, receiver: Receiver, coordinator: CoordinatorApi, name: str = "engine",
                 name_map: NameMap | None = None, poll_timeout_s: float = 30.0,
                 keepalive_s: float | None = None, verify_samples: int | None = None) -> None:
        self.engine = engine
        self._layout: dict[str, Any] | None = None
        self._digests: concurrent.futures.ThreadPoolExecutor | None = None
        self._verify_samples = verify_samples if verify_samples is not None and _takes_digests(engine) else None
        if verify_samples is not None and self._verify_samples is None:
            log.warning("%s: weights.verify is on but %s.load_weights takes no expected_digests; its weight loads "
                        "are not verified", name, type(engine).__name__)
        self._keepalive_s = keepalive_s
        self._receiver = receiver
        self._coordinator = coordinator
        self._name = name
        self._name_map = name_map
        self._poll_timeout_s = poll_timeout_s
        self.id = coordinator.register_subscriber(name)
        self.applied_version: int | None = None
        self.applied_epoch: str | None = None
        """Epoch (publisher run id) of :attr:`applied_version`."""
        self.refused_version: int | None = None
        """Newest version this subscriber refused or failed to apply (that commit is not retried)."""
        self._refused: VersionMeta | None = None
        self.last_report: ApplyReport | None = None
        self._apply_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self, meta: VersionMeta) -> dict[str, str]:
        """Publisher name -> engine name for ``meta``'s tensors.

        Raises:
            WeightSyncError: names, shapes or dtypes differ from the engine's layout; the
                message lists every difference.
        """
        names = map_names([t.name for t in meta.tensors], self._name_map)
        if not isinstance(self.engine, DeclaresWeightLayout):
            return names
        published = meta.layout()
        diff = layout_diff({names[n]: published[n] for n in names}, self.engine.weight_layout())
        if diff:
            raise WeightSyncError(f"{self.id} refuses version {meta.version}: the published weights do not fit "
                                  f"the engine's layout; {format_diff(diff)}")
        return names

    def apply(self, meta: VersionMeta) -> ApplyReport:
        """Check, receive and load ``meta.version``; report the outcome to the coordinator.

        Returns the report (``error`` set when refused: the engine keeps its old weights).
        """
        with self._apply_lock:
            if self._behind_applied(meta):
                log.info("%s: version %s arrived after version %s of the same run; not applied", self.id,
                         meta.version, self.applied_version)
                return ApplyReport(self.id, meta.version, f"{self.id}: version {meta.version} is not newer than the "
                                   f"applied version {self.applied_version}; not applied (versions never go back)")
            layout = False
            try:
                try:
                    names = self.check(meta)
                except WeightSyncError:
                    self._receiver.skip(meta)
                    layout = True
                    raise
                with self._keepalive():
                    tensors, stats = self._receiver.receive(meta)
                    received_s = self._check_received(tensors, meta)
                    stats["pause_s"], stats["verify_s"] = self._load(tensors, names, meta.version)
                    stats["verify_s"] += received_s
                report = ApplyReport(self.id, meta.version, None, stats)
                self.applied_version, self.applied_epoch = meta.version, meta.epoch
            except VersionGoneError as exc:  # superseded while pulling: not a refusal, nothing to report
                log.info("%s: %s; pulling the latest version instead", self.id, exc)
                return ApplyReport(self.id, meta.version, f"{self.id}: {exc}", {"superseded": 1.0})
            except WeightSyncError as exc:
                log.warning("%s", exc)
                report = ApplyReport(self.id, meta.version, str(exc), {LAYOUT_REFUSAL: 1.0} if layout else {})
            except Exception as exc:  # reported, so the publisher does not wait for a broken subscriber
                log.exception("%s: applying version %s failed", self.id, meta.version)
                report = ApplyReport(self.id, meta.version, f"{self.id}: {type(exc).__name__}: {exc}")
            if report.error is not None:
                self.refused_version, self._refused = meta.version, meta
            self.last_report = report
            self._coordinator.report(report)
            return report

    @contextlib.contextmanager
    def _keepalive(self) -> Iterator[None]:
        """Call ``is_registered`` every ``keepalive_s`` in a daemon thread while the body runs."""
        if self._keepalive_s is None:
            yield
            return
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self._keepalive_s):
                try:
                    self._coordinator.is_registered(self.id)
                except Exception as exc:  # the apply itself reports what matters
                    log.debug("%s: keep-alive failed: %s", self.id, exc)

        thread = threading.Thread(target=beat, name=f"weights-keepalive-{self.id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()

    def _behind_applied(self, meta: VersionMeta) -> bool:
        """``meta`` belongs to the run of the applied version and is not newer than it."""
        return (self.applied_version is not None and meta.epoch == self.applied_epoch
                and meta.version <= self.applied_version)

    def _check_received(self, tensors: Mapping[str, torch.Tensor], meta: VersionMeta) -> float:
        """Compare the received tensors with the publisher's digests in ``meta`` (tcp, nccl under
        ``weights.verify``), before the engine sees them; returns the seconds it took.

        Raises:
            WeightSyncError: a tensor differs or is missing (names the version and each tensor).
        """
        if self._verify_samples is None or not meta.digests:
            return 0.0
        start = time.perf_counter()
        sent = {name: TensorDigest.from_json(d) for name, d in meta.digests.items()}
        diff = compare_digests(sent, {n: tensor_digest(tensors[n], samples=d.samples) if n in tensors else None
                                      for n, d in sent.items()})
        if diff:
            raise WeightSyncError(f"{self.id} refuses version {meta.version}: what it received differs from what the "
                                  f"publisher sent in {len(diff)} tensor(s), not loaded (weights.verify):\n  "
                                  + "\n  ".join(diff[:20]))
        return time.perf_counter() - start

    def _load(self, tensors: Mapping[str, torch.Tensor], names: dict[str, str], version: int) -> tuple[float, float]:
        """engine.load_weights (verified with ``verify_samples``); returns the engine's pause in seconds
        (time it could not decode) and the wall seconds the verification added to it (the engine's
        ``stats.weight_verify_s``: its digests, and any wait for the expected ones)."""
        stats = self.engine.stats if isinstance(self.engine, TimesWeightLoads) else None
        before = None if stats is None else stats.weight_load_s
        verify_before = 0.0 if stats is None else stats.weight_verify_s
        mapped = {names[n]: t for n, t in tensors.items() if n in names}
        start = time.perf_counter()
        if self._verify_samples is None:
            self.engine.load_weights(mapped, version)
            verify_s = 0.0
        else:
            if self._layout is None:  # an engine's layout is fixed for its lifetime
                engine = self.engine
                self._layout = dict(engine.weight_layout()) if isinstance(engine, DeclaresWeightLayout) else {}
            if self._digests is None:
                self._digests = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"weights-digest-{self._name}")
            # the expected digests are computed while the engine copies (its copy releases the GIL); the
            # engine waits for them after its copy, inside its own verify time
            expected = self._digests.submit(expected_digests, mapped, self._layout, self._verify_samples)
            self.engine.load_weights(mapped, version, expected_digests=expected)
            verify_s = (0.0 if stats is None else stats.weight_verify_s) - verify_before
        if stats is None or before is None:
            return time.perf_counter() - start, verify_s
        return stats.weight_load_s - before, verify_s

    def sync_latest(self, timeout_s: float = 0.0) -> ApplyReport | None:
        """Apply the latest complete version if it is newer than the applied one (late join).

        The commit this subscriber refused is not tried again: while it is still the latest,
        this pauses (up to ``timeout_s``) and returns None; once the publisher withdraws it,
        the same version number published again (a new commit) is tried. Waits up to
        ``timeout_s`` for a newer version to exist; returns None if none came. A version the
        publisher replaced while it was being pulled is not a refusal: the pull starts again on the
        newest version (up to 16 times in a row; the last report says superseded).
        """
        for _ in range(_MAX_SUPERSEDED):
            meta = self._coordinator.wait_for_version(self.applied_version, timeout_s, self.id, self.applied_epoch)
            if meta is None:
                if not self._stop.is_set() and not self._coordinator.is_registered(self.id):
                    self._register_again()
                return None
            if meta == self._refused:
                self._stop.wait(min(timeout_s, _REFUSED_PAUSE_S))
                return None
            report = self.apply(meta)
            if not report.stats.get("superseded"):
                return report
        return report  # superseded every time: the follower keeps trying; a start reports the last error

    def _register_again(self) -> None:
        """The coordinator does not know this subscriber (the publisher restarted with a new
        coordinator): register with it; its latest version is then newer (another epoch)."""
        old = self.id
        self.id = self._coordinator.register_subscriber(self._name)
        log.warning("%s: the weight coordinator no longer knows this subscriber (publisher restarted?); "
                    "registered again as %s", old, self.id)

    def start(self) -> EngineSubscriber:
        """Follow new versions in a daemon thread until :meth:`close`."""
        self._thread = threading.Thread(target=self._follow, name=f"weights-{self.id}", daemon=True)
        self._thread.start()
        return self

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_latest(self._poll_timeout_s)
            except Exception:  # the coordinator went away or broke: retry after a pause
                log.exception("%s: waiting for a new version failed", self.id)
                self._stop.wait(1.0)

    def close(self, join_timeout_s: float = 5.0) -> None:
        """Stop following and unregister. The receiver is closed too.

        A version being applied is reported first (waiting up to ``join_timeout_s`` for it): the
        engine may already serve it, and a report that arrives after the unregistration is
        dropped, so the publisher would not count this subscriber for that version.
        """
        self._stop.set()
        applying_done = self._apply_lock.acquire(timeout=join_timeout_s)
        try:
            self._coordinator.unregister_subscriber(self.id)
        finally:
            if applying_done:
                self._apply_lock.release()
            self._receiver.close()
            if self._digests is not None:
                self._digests.shutdown(wait=False)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_timeout_s)
