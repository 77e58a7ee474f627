"""TCP transport: bucketed streaming of raw tensor bytes, resumable, several subscribers at once.

Wire protocol (all integers big-endian int64), one version per connection:

    server -> subscriber   b"RLXN" nonce                        (32 random bytes, new per connection)
    subscriber -> server   b"RLXW" answer                       (HMAC-SHA256 of the run's subscriber
                                                                   secret over the nonce, 32 bytes,
                                                                   :mod:`relax_agent.weights.auth`; a
                                                                   wrong one closes the connection
                                                                   before any weight byte is sent)
    subscriber -> server   b"RLXW" version first_bucket
    server -> subscriber   b"RLXW" served_version num_buckets     (served_version != version: not
                                                                   served any more; connection closes)
    then per bucket b = first_bucket .. num_buckets-1:
                           b nbytes, followed by nbytes raw bytes of the flat layout

The server sends straight from tensor storage (memoryviews of the snapshot buffer, or of
the state dict's tensors with ``snapshot: false``): no pickling, no intermediate copy. The
receiver ``recv_into``\\ s a pre-allocated [total_bytes] uint8 tensor, verifies each bucket's
checksum against the coordinator's metadata (on a worker thread, while the next bucket arrives), and after a dropped connection reconnects and
resumes after the last complete bucket. Each connection gets its own server thread
(socket calls release the GIL), so several subscribers are served concurrently.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from relax_agent.errors import VersionGoneError, WeightSyncError
from relax_agent.weights import auth
from relax_agent.weights.config import WeightSyncConfig
from relax_agent.weights.meta import (
    FlatSource,
    VersionMeta,
    bucket_checksums,
    checksum_fn,
    flat_views,
    plan_layout,
    snapshot_with_checksums,
)

log = logging.getLogger("relax_agent.weights")

MAGIC = b"RLXW"
CHALLENGE_MAGIC = b"RLXN"
_CHALLENGE = struct.Struct(f"!4s{auth.NONCE_BYTES}s")
_HELLO = struct.Struct("!4sqq")
_BUCKET = struct.Struct("!qq")
_RECONNECT_PAUSE_S = 0.05


@dataclass
class _Offer:
    """One staged version: its metadata, its bytes, and how many connections read it."""

    meta: VersionMeta
    source: FlatSource
    buffer: torch.Tensor | None
    readers: int = 0


class TcpSender:
    """Serves the latest staged version to any number of :class:`TcpReceiver`\\ s.

    Args:
        cfg: ``host``/``port`` to bind (port 0: a free one), ``bucket_bytes``, ``checksum``,
            ``snapshot``, ``connect_timeout_s`` (idle limit of a socket write, and of the challenge).
        secret: the run's subscriber secret; a connection that does not answer the challenge with
            it gets no byte of a weight (None: a fresh random one, :attr:`secret`).
        advertise: the host put in each version's metadata, where subscribers connect (None:
            ``cfg.host``; the node's own address when ``cfg.host`` binds every interface, e.g.
            ``0.0.0.0``, and subscribers run on other hosts).

    Raises:
        WeightSyncError: the address cannot be bound.
    """

    def __init__(self, cfg: WeightSyncConfig, secret: str | None = None, advertise: str | None = None) -> None:
        self._cfg = cfg
        self.secret = secret or auth.new_secret()
        self.refused = 0
        """Connections closed for a missing or wrong answer to the challenge."""
        try:
            self._listener = socket.create_server((cfg.host, cfg.port), backlog=64)
        except OSError as exc:
            raise WeightSyncError(f"weight server cannot listen on {cfg.host}:{cfg.port} "
                                  f"(weights.host / weights.port): {exc}") from exc
        self._address = f"{advertise or cfg.host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._current: _Offer | None = None
        self._retired: _Offer | None = None
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="weights-tcp-accept", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        """``host:port`` the sender serves versions on."""
        return self._address

    def stage(self, state_dict: Mapping[str, torch.Tensor], version: int) -> VersionMeta:
        """Snapshot (if configured) and checksum ``state_dict``; serve it from now on. The version it
        replaces is still served (to a subscriber whose pull raced this publish) until the next stage."""
        tensors, total = plan_layout(state_dict)
        buffer = None
        if self._cfg.snapshot:
            buffer = self._free_buffer(total)
            checks = snapshot_with_checksums(buffer, state_dict, tensors, self._cfg.bucket_bytes, self._cfg.checksum)
            source = FlatSource(tensors, total, buffer=buffer)
        else:
            source = FlatSource(tensors, total, state_dict=state_dict)
            checks = bucket_checksums(source, self._cfg.bucket_bytes, self._cfg.checksum)
        meta = VersionMeta(version, tensors, total, self._cfg.bucket_bytes, self._cfg.checksum, checks, "tcp",
                           self._address)
        with self._lock:
            self._retired, self._current = self._current, _Offer(meta, source, buffer)
        return meta

    def _free_buffer(self, total: int) -> torch.Tensor:
        """A [total] uint8 buffer no connection reads: the retired version's when possible."""
        with self._lock:
            old = self._retired
            if old is not None and old.readers == 0 and old.buffer is not None and old.buffer.numel() == total:
                self._retired = None
                return old.buffer
        return torch.empty(total, dtype=torch.uint8)

    def send(self, meta: VersionMeta) -> None:
        """Nothing to push: subscribers pull."""

    def retract(self, version: int) -> None:
        """Serve the version staged before ``version`` again (``version`` was refused)."""
        with self._lock:
            if self._current is not None and self._current.meta.version == version:
                self._current, self._retired = self._retired, None

    def close(self) -> None:
        """Stop accepting and cut open connections. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        for conn in [self._listener, *conns]:
            _shutdown(conn)
        self._acceptor.join(5.0)

    def _accept(self) -> None:
        """Accept subscribers until :meth:`close`. A failed accept (out of file descriptors) or thread
        start (out of threads) drops that one connection, is logged, and the loop goes on after a short
        back-off: the server never stops accepting for good while the run lives."""
        backoff_s = 0.0
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                with self._lock:
                    if self._closed:
                        return
                backoff_s = min(max(2 * backoff_s, 0.05), 1.0)
                log.warning("weight server: accept failed (%s); accepting again in %.2f s", exc, backoff_s)
                time.sleep(backoff_s)
                continue
            with self._lock:
                if self._closed:
                    _shutdown(conn)
                    return
                self._conns.add(conn)
            try:
                threading.Thread(target=self._serve, args=(conn,), name="weights-tcp-conn", daemon=True).start()
            except RuntimeError as exc:  # can't start new thread: this subscriber retries its pull
                with self._lock:
                    self._conns.discard(conn)
                _shutdown(conn)
                backoff_s = min(max(2 * backoff_s, 0.05), 1.0)
                log.warning("weight server: no thread for a connection (%s); accepting again in %.2f s", exc, backoff_s)
                time.sleep(backoff_s)
                continue
            backoff_s = 0.0

    def _serve(self, conn: socket.socket) -> None:
        offer = None
        try:
            conn.settimeout(self._cfg.connect_timeout_s)
            if not self._authenticate(conn):
                return
            magic, version, first = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            if magic != MAGIC:
                return
            with self._lock:  # the current version, or the one it replaced (a pull that raced a publish)
                offer = next((o for o in (self._current, self._retired) if o is not None and o.meta.version == version
                              and (o is self._current or o.buffer is not None)), None)  # a snapshot stays valid
                if offer is not None:
                    offer.readers += 1
            if offer is None:
                latest = -1 if self._current is None else self._current.meta.version
                conn.sendall(_HELLO.pack(MAGIC, latest, 0))
                return
            self._stream(conn, offer, first)
        except (OSError, EOFError) as exc:  # the subscriber went away; it reconnects and resumes
            log.debug("weight server: connection ended: %s", exc)
        finally:
            with self._lock:
                if offer is not None:
                    offer.readers -= 1
                self._conns.discard(conn)
            _shutdown(conn)

    def _authenticate(self, conn: socket.socket) -> bool:
        """Challenge the subscriber; False (logged with the peer and why) when it does not hold the
        run's secret. Reads exactly the request's fixed-size prefix, so the hello that follows is intact."""
        nonce = secrets.token_bytes(auth.NONCE_BYTES)
        conn.sendall(_CHALLENGE.pack(CHALLENGE_MAGIC, nonce))
        reason = None
        try:
            head = _recv_exact(conn, 4 + auth.ANSWER_BYTES)
        except (OSError, EOFError) as exc:
            reason = f"no answer to the challenge ({exc})"
        else:
            if head[:4] != MAGIC:
                reason = "not a relax-agent weight subscriber (bad magic)"
            elif not auth.verify_answer(self.secret, nonce, head[4:]):
                reason = "wrong answer to the challenge (not the run's weight credential)"
        if reason is None:
            return True
        with self._lock:
            self.refused += 1
        log.warning("weight server %s: refused a connection from %s: %s", self._address, _peer(conn), reason)
        return False

    def _stream(self, conn: socket.socket, offer: _Offer, first: int) -> None:
        meta = offer.meta
        conn.sendall(_HELLO.pack(MAGIC, meta.version, meta.num_buckets))
        for b in range(max(first, 0), meta.num_buckets):
            start, end = meta.bucket(b)
            conn.sendall(_BUCKET.pack(b, end - start))
            for segment in offer.source.segments(start, end):
                conn.sendall(segment)


class TcpReceiver:
    """Fetches versions from a :class:`TcpSender` into one reused receive buffer.

    Args:
        cfg: ``connect_timeout_s`` (connect and idle read limit), ``max_reconnects``.
        address: "host:port" to fetch from instead of the address in the metadata (e.g.
            through a forwarder).
        secret: the run's subscriber secret (``TcpSender.secret`` / ``WeightSync.credential``),
            with which it answers the server's challenge.

    Raises:
        WeightSyncError: no ``secret``.
    """

    def __init__(self, cfg: WeightSyncConfig, address: str | None = None, *, secret: str | None = None) -> None:
        if not secret:
            raise WeightSyncError("a tcp weight subscriber needs the run's weight credential (secret=): the weight "
                                  "server sends no weights to a connection that cannot answer its challenge")
        self._cfg = cfg
        self._address = address
        self._secret = secret
        self._buffer: torch.Tensor | None = None

    def receive(self, meta: VersionMeta) -> tuple[Mapping[str, torch.Tensor], dict[str, float]]:
        """Fetch ``meta.version``: publisher name -> view of the receive buffer, and stats.

        Raises:
            WeightSyncError: a bucket's checksum differs (names the bucket and both values),
                the publisher no longer serves the version, or more than
                ``max_reconnects`` connections dropped.
        """
        start_s = time.perf_counter()
        if self._buffer is None or self._buffer.numel() != meta.total_bytes:
            self._buffer = torch.empty(meta.total_bytes, dtype=torch.uint8)
        view = self._buffer.numpy().data
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights-verify") as pool:
            resumes = self._fetch_all(meta, view, pool)
        stats = {"receive_s": time.perf_counter() - start_s, "bytes": float(meta.total_bytes),
                 "resumes": float(resumes)}
        return flat_views(self._buffer, meta.tensors), stats

    def _fetch_all(self, meta: VersionMeta, view: memoryview, pool: concurrent.futures.Executor) -> int:
        """Receive every bucket, reconnecting after drops; checksums run on ``pool`` while the next bucket
        arrives. Returns the number of reconnections."""
        verify = None if meta.checksum == "none" else checksum_fn(meta.checksum)
        checks: list[concurrent.futures.Future[None]] = []
        next_bucket, resumes = 0, 0
        while next_bucket < meta.num_buckets:
            try:
                for done in self._fetch(meta, view, next_bucket):
                    next_bucket = done + 1
                    if verify is not None:
                        start, end = meta.bucket(done)
                        checks.append(pool.submit(_verify_bucket, meta, done, verify, view[start:end]))
            except (OSError, EOFError) as exc:
                resumes += 1
                if resumes > self._cfg.max_reconnects:
                    raise WeightSyncError(f"version {meta.version}: connection to {self._target(meta)} dropped "
                                          f"{resumes} times (weights.max_reconnects={self._cfg.max_reconnects}); "
                                          f"last error: {exc}") from exc
                log.info("version %s: connection dropped at bucket %s (%s); resuming", meta.version, next_bucket, exc)
                time.sleep(_RECONNECT_PAUSE_S)
        for check in checks:
            check.result()
        return resumes

    def _target(self, meta: VersionMeta) -> str:
        address = self._address or meta.address
        if not address:
            raise WeightSyncError(f"version {meta.version} has no tcp address in its metadata")
        return address

    def _fetch(self, meta: VersionMeta, view: memoryview, first: int) -> Iterator[int]:
        """Receive buckets from ``first`` on one connection, yielding each bucket once it is complete."""
        host, _, port = self._target(meta).rpartition(":")
        with socket.create_connection((host, int(port)), timeout=self._cfg.connect_timeout_s) as conn:
            magic, nonce = _CHALLENGE.unpack(_recv_exact(conn, _CHALLENGE.size))
            if magic != CHALLENGE_MAGIC:
                raise WeightSyncError(f"version {meta.version}: {self._target(meta)} is not a relax-agent weight "
                                      "server (no challenge)")
            conn.sendall(MAGIC + auth.answer(self._secret, nonce) + _HELLO.pack(MAGIC, meta.version, first))
            try:
                magic, served, num_buckets = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            except EOFError as exc:  # retried like any drop; the message says what it most likely is
                raise EOFError(f"the weight server closed the connection after the challenge (a wrong weight "
                               f"credential, or the server is shutting down): {exc}") from exc
            if magic != MAGIC or served != meta.version:
                raise VersionGoneError(f"version {meta.version}: the publisher at {self._target(meta)} now serves "
                                       f"version {served}; this one is gone")
            assert num_buckets == meta.num_buckets, (num_buckets, meta.num_buckets)
            for b in range(first, num_buckets):
                index, nbytes = _BUCKET.unpack(_recv_exact(conn, _BUCKET.size))
                start, end = meta.bucket(b)
                assert (index, nbytes) == (b, end - start), ((index, nbytes), (b, end - start))
                _recv_into(conn, view[start:end])
                yield b

    def skip(self, meta: VersionMeta) -> None:
        """Nothing to do: a refused version is simply not fetched."""

    def close(self) -> None:
        """Drop the receive buffer."""
        self._buffer = None


def _verify_bucket(meta: VersionMeta, index: int, verify: Callable[[Iterator[memoryview]], int],
                   data: memoryview) -> None:
    got, want = verify(iter([data])), meta.bucket_checksums[index]
    if got != want:
        start, end = meta.bucket(index)
        raise WeightSyncError(
            f"version {meta.version}: bucket {index} (bytes {start}-{end}) has {meta.checksum} checksum "
            f"{got:#018x}, the publisher's is {want:#018x}; the version is refused and the engine keeps its "
            "previous weights (with weights.snapshot=false the trainer may have changed the tensors mid-send)")


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    pos, end = 0, len(view)
    while pos < end:
        n = conn.recv_into(view[pos:], end - pos)
        if n == 0:
            raise EOFError(f"connection closed after {pos} of {end} bytes of a bucket")
        pos += n


def _recv_exact(conn: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    _recv_into(conn, memoryview(buf))
    return bytes(buf)


def _peer(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "an unknown peer"


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
