"""WeightSync over inproc and tcp with TensorEngine fakes: exactness, refusals, casts, late joins, faults."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

from relax_agent.errors import VersionGoneError, WeightSyncError
from relax_agent.weights import SyncStats, TensorEngine, WeightSyncConfig, build_weight_sync
from relax_agent.weights.meta import plan_layout
from relax_agent.weights.subscriber import EngineSubscriber
from relax_agent.weights.tcp import TcpReceiver, TcpSender

SMALL_BUCKETS_MB = 1024 / 2**20  # 1 KiB buckets: many buckets per version


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(40, 16, generator=g)
    return {"embed.weight": emb, "layer.weight": torch.randn(16, 16, generator=g), "layer.bias": torch.randn(16, generator=g),
            "big.weight": torch.randn(64, 64, generator=g), "head.weight": emb, "step": torch.tensor(seed, dtype=torch.int64)}


def assert_holds(engine: TensorEngine, state: dict[str, torch.Tensor], version: int) -> None:
    got_version, tensors = engine.snapshot()
    assert got_version == version
    assert tensors.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(tensors[name], value.to(tensors[name].dtype)), name


@pytest.fixture(params=["inproc", "tcp"])
def transport(request) -> str:
    return request.param


def test_publish_applies_exactly_and_reports_stats(transport):
    engine = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport=transport, bucket_mb=SMALL_BUCKETS_MB), [engine])
    try:
        assert sync.latest_version == -1
        for version in (1, 2):
            stats = sync.publish(make_state(version), version)
            assert_holds(engine, make_state(version), version)
        assert isinstance(stats, SyncStats) and stats.version == 2 and sync.latest_version == 2
        assert stats.bytes == plan_layout(make_state(2))[1] and stats.subscribers == 1 and stats.resumes == 0
        assert stats.pause_s <= stats.seconds and engine.stats.weight_loads == 2
        with pytest.raises(WeightSyncError, match="not newer"):
            sync.publish(make_state(3), 2)
    finally:
        sync.close()


def test_mismatched_layout_is_refused_listing_differences_and_engine_keeps_serving(transport):
    good = make_state(0)
    bad = dict(make_state(1))
    bad["layer.weight"] = torch.zeros(16, 17)
    bad["extra.weight"] = torch.zeros(2)
    del bad["layer.bias"]
    engine = TensorEngine(good)
    sync = build_weight_sync(WeightSyncConfig(transport=transport), [engine])
    try:
        sync.publish(make_state(1), 1)
        with pytest.raises(WeightSyncError) as err:
            sync.publish(bad, 2)
        message = str(err.value)
        assert "3 differences" in message
        assert "missing in the engine: extra.weight" in message and "not published: layer.bias" in message
        assert "shape of layer.weight: published (16, 17), engine (16, 16)" in message
        assert_holds(engine, make_state(1), 1)
        sync.publish(make_state(3), 3)  # the next good version still goes through
        assert_holds(engine, make_state(3), 3)
    finally:
        sync.close()


def test_fp32_master_weights_are_cast_to_the_engines_dtype(transport):
    bf16, fp16 = TensorEngine(make_state(0), torch.bfloat16), TensorEngine(make_state(0), torch.float16)
    sync = build_weight_sync(WeightSyncConfig(transport=transport), [bf16, fp16])
    try:
        sync.publish(make_state(5), 5)
        assert bf16.tensors["layer.weight"].dtype == torch.bfloat16 and fp16.tensors["layer.bias"].dtype == torch.float16
        assert_holds(bf16, make_state(5), 5)
        assert_holds(fp16, make_state(5), 5)
        assert bf16.tensors["step"].dtype == torch.int64
    finally:
        sync.close()


def test_names_are_mapped_when_the_engine_layout_differs(transport):
    published = make_state(1)
    engine = TensorEngine({f"model.{k}": v for k, v in make_state(0).items() if k != "step"})
    cfg = WeightSyncConfig(transport=transport)
    sync = build_weight_sync(cfg, [])
    try:
        sync.attach(engine, name_map=lambda n: None if n == "step" else f"model.{n}")
        sync.publish(published, 1)
        assert_holds(engine, {f"model.{k}": v for k, v in published.items() if k != "step"}, 1)
    finally:
        sync.close()
    renamed = TensorEngine({("lm_head.weight" if k == "head.weight" else k): v for k, v in make_state(0).items()})
    sync = build_weight_sync(WeightSyncConfig(transport=transport, name_map={"head.weight": "lm_head.weight"}), [renamed])
    try:
        sync.publish(published, 1)
        assert torch.equal(renamed.tensors["lm_head.weight"], published["head.weight"])
    finally:
        sync.close()


@pytest.mark.parametrize("snapshot", [True, False])
def test_tcp_serves_two_subscribers_at_once(snapshot):
    engines = [TensorEngine(make_state(0)), TensorEngine(make_state(0), torch.bfloat16)]
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", bucket_mb=SMALL_BUCKETS_MB, snapshot=snapshot), engines)
    try:
        for version in (1, 2, 3):
            stats = sync.publish(make_state(version), version)
            for engine in engines:
                assert_holds(engine, make_state(version), version)
        assert stats.subscribers == 2 and stats.bytes == plan_layout(make_state(3))[1]
    finally:
        sync.close()


def test_late_joiner_pulls_the_latest_version_before_serving(transport):
    first = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport=transport), [first])
    try:
        sync.publish(make_state(7), 7)
        late = TensorEngine(make_state(0))
        sync.attach(late, name="late")
        assert_holds(late, make_state(7), 7)  # before attach returned
        sync.publish(make_state(8), 8)
        assert_holds(late, make_state(8), 8)
        assert_holds(first, make_state(8), 8)
    finally:
        sync.close()


def test_late_joiner_with_a_mismatched_layout_is_refused():
    sync = build_weight_sync(WeightSyncConfig(transport="tcp"), [])
    try:
        sync.publish(make_state(1), 1)
        odd = TensorEngine({"other.weight": torch.zeros(2)})
        with pytest.raises(WeightSyncError, match="not published: other.weight"):
            sync.attach(odd)
        assert odd.policy_version == 0 and sync.coordinator.subscribers() == []
    finally:
        sync.close()


class Forwarder:
    """A real 127.0.0.1 TCP forwarder to the weight server that can cut or corrupt the server's stream.

    ``plan(i)`` gives connection ``i`` its fault: ``("drop", n)`` closes both sockets after
    forwarding ``n`` bytes, ``("flip", n)`` flips the bits of byte ``n``, None forwards as is.
    ``first_buckets`` records the bucket each connection asked to start from.
    """

    def __init__(self, upstream: str, plan) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._plan = plan
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.first_buckets: list[int] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            index = len(self.first_buckets)
            self.first_buckets.append(-1)
            threading.Thread(target=self._handle, args=(client, index), daemon=True).start()

    def _handle(self, client: socket.socket, index: int) -> None:
        up = socket.create_connection(self._upstream)
        client.sendall(_recv_exact(up, CHALLENGE_BYTES))  # the server's challenge, passed through as is
        answer_and_hello = _recv_exact(client, ANSWER_BYTES + 20)
        self.first_buckets[index] = struct.unpack("!4sqq", answer_and_hello[-20:])[2]
        up.sendall(answer_and_hello)
        fault = self._plan(index)
        sent = 0
        try:
            while True:
                data = bytearray(up.recv(1 << 16))
                if not data:
                    break
                if fault and fault[0] == "flip" and sent <= fault[1] < sent + len(data):
                    data[fault[1] - sent] ^= 0xFF
                if fault and fault[0] == "drop" and sent + len(data) > fault[1]:
                    client.sendall(data[:fault[1] - sent])
                    break
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (client, up):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._sock.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def flaky_subscriber(sync, engine, plan, **cfg_overrides):
    cfg = WeightSyncConfig(transport="tcp", bucket_mb=SMALL_BUCKETS_MB, **cfg_overrides)
    forwarder = Forwarder(sync._sender.address, plan)
    sub = EngineSubscriber(engine, TcpReceiver(cfg, address=forwarder.address, secret=sync.credential),
                           sync.coordinator, "flaky").start()
    return sub, forwarder


HEADER_BYTES, BUCKET_HEADER_BYTES = 20, 16
"""Bytes of the server's reply hello and of a bucket header, counted after the 36-byte challenge."""
CHALLENGE_BYTES, ANSWER_BYTES = 4 + 32, 4 + 32


def test_dropped_connection_resumes_after_the_last_complete_bucket():
    engine = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", bucket_mb=SMALL_BUCKETS_MB), [])
    cut = HEADER_BYTES + 2 * (BUCKET_HEADER_BYTES + 1024) + 500  # mid-way through bucket 2
    sub, forwarder = flaky_subscriber(sync, engine, lambda i: ("drop", cut) if i < 2 else None)
    try:
        stats = sync.publish(make_state(1), 1)
        assert_holds(engine, make_state(1), 1)
        assert stats.resumes == 2 and sub.last_report.stats["resumes"] == 2
        assert forwarder.first_buckets == [0, 2, 4]  # each reconnect resumed after the last complete bucket
    finally:
        sub.close()
        forwarder.close()
        sync.close()


def test_too_many_drops_refuse_the_version_without_touching_the_engine():
    engine = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", bucket_mb=SMALL_BUCKETS_MB), [])
    sub, forwarder = flaky_subscriber(sync, engine, lambda i: ("drop", 3000), max_reconnects=2)
    try:
        with pytest.raises(WeightSyncError, match=r"dropped 3 times \(weights.max_reconnects=2\)"):
            sync.publish(make_state(1), 1)
        assert_holds(engine, make_state(0), 0)
    finally:
        sub.close()
        forwarder.close()
        sync.close()


def test_checksum_mismatch_is_refused_with_a_clear_error():
    engine = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", bucket_mb=SMALL_BUCKETS_MB), [])
    corrupt = HEADER_BYTES + (BUCKET_HEADER_BYTES + 1024) + BUCKET_HEADER_BYTES + 10  # byte 10 of bucket 1
    sub, forwarder = flaky_subscriber(sync, engine, lambda i: ("flip", corrupt))
    try:
        with pytest.raises(WeightSyncError, match=r"bucket 1 \(bytes 1024-2048\) has xxh3 checksum 0x[0-9a-f]+, "
                                                  r"the publisher's is 0x[0-9a-f]+; the version is refused"):
            sync.publish(make_state(1), 1)
        assert_holds(engine, make_state(0), 0)
        assert sub.applied_version is None
    finally:
        sub.close()
        forwarder.close()
        sync.close()


def test_a_version_replaced_mid_transfer_is_refused_by_name():
    cfg = WeightSyncConfig(transport="tcp", bucket_mb=SMALL_BUCKETS_MB)
    sender = TcpSender(cfg)
    try:
        old = sender.stage(make_state(1), 1)
        sender.stage(make_state(2), 2)  # the version it replaced is still served (a pull racing a publish)
        tensors, _ = TcpReceiver(cfg, secret=sender.secret).receive(old)
        assert all(torch.equal(tensors[k], v) for k, v in make_state(1).items())
        sender.stage(make_state(3), 3)  # two publishes later it is gone
        with pytest.raises(VersionGoneError, match="now serves version 3; this one is gone"):
            TcpReceiver(cfg, secret=sender.secret).receive(old)
    finally:
        sender.close()


def test_snapshot_buffers_are_reused_once_no_connection_reads_them():
    sender = TcpSender(WeightSyncConfig(transport="tcp"))
    try:
        ptrs = []
        for version in (1, 2, 3, 4):
            sender.stage(make_state(version), version)
            ptrs.append(sender._current.buffer.data_ptr())
        assert ptrs[0] != ptrs[1] and ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1]
    finally:
        sender.close()


class SlowReportingCoordinator:
    """Wraps a coordinator so that reports reach it only after ``release`` is set."""

    def __init__(self, inner) -> None:
        self.inner, self.release = inner, threading.Event()

    def report(self, report) -> None:
        self.release.wait(10)
        self.inner.report(report)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_close_while_a_version_is_applied_reports_it_before_unregistering():
    """A replica that closes as soon as its engine serves a version (it reached its target) must not
    unregister before that version's report arrives: the publisher would count no subscriber."""
    sync = build_weight_sync(WeightSyncConfig(transport="tcp"), [])
    engine = TensorEngine(make_state(0))
    coordinator = SlowReportingCoordinator(sync.coordinator)
    sub = EngineSubscriber(engine, TcpReceiver(WeightSyncConfig(transport="tcp"), secret=sync.credential),
                           coordinator, "leaver").start()
    try:
        box: list[SyncStats] = []
        publishing = threading.Thread(target=lambda: box.append(sync.publish(make_state(1), 1)))
        publishing.start()
        while engine.policy_version != 1:  # the engine serves version 1; its report is still on the way
            threading.Event().wait(0.005)
        closing = threading.Thread(target=sub.close)
        closing.start()
        threading.Event().wait(0.1)
        assert sync.coordinator.subscribers() == [sub.id]  # close waits for the report
        coordinator.release.set()
        closing.join(10)
        publishing.join(10)
        assert box and box[0].subscribers == 1 and sync.coordinator.subscribers() == []
    finally:
        coordinator.release.set()
        sub.close()
        sync.close()


def test_the_weight_server_keeps_accepting_after_fd_and_thread_exhaustion(monkeypatch):
    """One failed accept (EMFILE) or thread start ended the acceptor for good: every later pull was refused."""
    import errno

    from relax_agent.weights import tcp

    real_create_server, real_thread = tcp.socket.create_server, tcp.threading.Thread
    failures = {"accept": 2, "thread": 1}

    class FlakyListener:
        def __init__(self, sock):
            self.sock = sock

        def accept(self):
            if failures["accept"]:
                failures["accept"] -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return self.sock.accept()

        def __getattr__(self, name):
            return getattr(self.sock, name)

    class FlakyThread(real_thread):
        def start(self):
            if self.name == "weights-tcp-conn" and failures["thread"]:
                failures["thread"] -= 1
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(tcp.socket, "create_server", lambda *a, **k: FlakyListener(real_create_server(*a, **k)))
    monkeypatch.setattr(tcp.threading, "Thread", FlakyThread)
    engine = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", bucket_mb=SMALL_BUCKETS_MB), [engine])
    try:
        for version in (1, 2):
            sync.publish(make_state(version), version)
            assert_holds(engine, make_state(version), version)
        assert failures == {"accept": 0, "thread": 0}  # both faults happened, and the server went on
    finally:
        sync.close()
