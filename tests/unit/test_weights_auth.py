"""Weights no stranger can read, and subscribers that cannot stall a publish (issue 30, items 2 and 3).

The tcp weight server challenges every connection for the run's credential before it sends a
byte of a weight; a publish stops waiting for a subscriber that has gone silent.
"""

from __future__ import annotations

import logging
import socket
import struct
import time

import pytest
import torch

from relax_agent.errors import WeightSyncError
from relax_agent.weights import TensorEngine, WeightSyncConfig, build_weight_sync, connect_subscriber
from relax_agent.weights.auth import answer
from relax_agent.weights.tcp import TcpReceiver


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 64), value), "b": torch.full((64,), value)}


def read_all(conn: socket.socket, limit_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or ``limit_s`` passes)."""
    conn.settimeout(limit_s)
    data = bytearray()
    try:
        while chunk := conn.recv(1 << 16):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return bytes(data)


def test_a_stranger_on_the_weight_port_gets_no_weight_bytes_and_the_replica_still_syncs(caplog):
    sync = build_weight_sync(WeightSyncConfig(transport="tcp"), [])
    replica = TensorEngine(state(0.0))
    try:
        sub = sync.attach(replica, name="replica")
        stats = sync.publish(state(1234.5678), 1)
        assert stats.subscribers == 1 and replica.policy_version == 1
        host, _, port = sync._sender.address.rpartition(":")
        weight_bytes = state(1234.5678)["w"][0, :4].numpy().tobytes()
        caplog.set_level(logging.WARNING, logger="relax_agent.weights")

        # 1. a client of the protocol as it was: a hello for the published version
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(struct.pack("!4sqq", b"RLXW", 1, 0))
            conn.shutdown(socket.SHUT_WR)  # all it has to say (else the server waits connect_timeout_s)
            got = read_all(conn)
        assert len(got) == 36 and got[:4] == b"RLXN" and weight_bytes not in got  # the challenge, nothing more

        # 2. the protocol of today with a guessed secret
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            nonce = read_exactly(conn, 36)[4:]
            conn.sendall(b"RLXW" + answer("guessed", nonce) + struct.pack("!4sqq", b"RLXW", 1, 0))
            rest = read_all(conn)
        assert rest == b"" and weight_bytes not in rest

        # 3. a receiver holding the wrong secret: refused, names the likely cause
        with pytest.raises(WeightSyncError, match="wrong weight credential"):
            TcpReceiver(WeightSyncConfig(transport="tcp", max_reconnects=1), secret="wrong").receive(
                sync.coordinator.latest())
        # 4. none at all
        with pytest.raises(WeightSyncError, match="needs the run's weight credential"):
            TcpReceiver(WeightSyncConfig(transport="tcp"))

        assert sync._sender.refused == 4  # 1, 2 and the two connections of 3
        refusals = [r.getMessage() for r in caplog.records if "refused a connection from 127.0.0.1:" in r.getMessage()]
        assert len(refusals) == 4 and any("wrong answer to the challenge" in m for m in refusals)

        # the run's own replica still follows
        stats = sync.publish(state(2.0), 2)
        assert stats.subscribers == 1 and replica.policy_version == 2
        assert torch.equal(replica.tensors["w"], state(2.0)["w"])
        assert sub.last_report is not None and sub.last_report.error is None
    finally:
        sync.close()


def read_exactly(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        assert chunk, f"closed after {len(buf)} of {n} bytes"
        buf += chunk
    return buf


def test_a_remote_replica_proves_the_service_token_to_the_weight_server(monkeypatch):
    """A replica in another process holds one secret: the service token is also its tcp credential."""
    monkeypatch.setenv("RELAX_TEST_WEIGHT_SECRET", "s3cret-of-this-run")
    cfg = WeightSyncConfig(transport="tcp", service_port=0, service_token_env="RELAX_TEST_WEIGHT_SECRET")
    sync = build_weight_sync(cfg, [])
    try:
        assert sync.credential == sync.service_token == "s3cret-of-this-run"
        sync.publish(state(3.0), 1)
        engine = TensorEngine(state(0.0))
        sub = connect_subscriber(sync.service_url, engine, cfg, name="remote")
        try:
            assert engine.policy_version == 1 and torch.equal(engine.tensors["b"], state(3.0)["b"])
        finally:
            sub.close()
    finally:
        sync.close()


# -- item 3: silent subscribers ----------------------------------------------------------------

class SlowEngine(TensorEngine):
    """Takes ``delay_s`` to load a version (a large model)."""

    def __init__(self, *args, delay_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s

    def load_weights(self, state_dict, version) -> None:
        time.sleep(self.delay_s)
        super().load_weights(state_dict, version)


def test_a_registered_subscriber_that_never_reports_is_dropped_after_the_silence_bound():
    cfg = WeightSyncConfig(transport="tcp", subscriber_silence_s=0.5, publish_timeout_s=30.0)
    sync = build_weight_sync(cfg, [])
    live = TensorEngine(state(0.0))
    slow = SlowEngine(state(0.0), delay_s=1.5)  # alive, but longer than the bound to apply: keep-alives
    try:
        sync.attach(live, name="live")
        sync.attach(slow, name="slow")
        silent = sync.coordinator.register_subscriber("silent")  # registers, never polls or reports
        start = time.monotonic()
        stats = sync.publish(state(1.0), 1)
        took_s = time.monotonic() - start
        assert took_s < 10.0, f"publish waited {took_s:.1f} s for a silent subscriber"
        assert stats.dropped == (silent,) and stats.as_metrics()["weights/subscribers_dropped"] == 1.0
        assert stats.subscribers == 2 and stats.lagging == ()
        assert live.policy_version == 1 and slow.policy_version == 1
        assert silent not in sync.coordinator.subscribers() and len(sync.coordinator.subscribers()) == 2
        assert sync.coordinator.describe()["dropped_total"] == 1
        stats = sync.publish(state(2.0), 2)
        assert stats.dropped == () and stats.as_metrics()["weights/subscribers_dropped"] == 0.0
        assert stats.subscribers == 2 and slow.policy_version == 2
    finally:
        sync.close()


def test_subscriber_silence_must_be_positive():
    with pytest.raises(ValueError, match="subscriber_silence_s"):
        WeightSyncConfig(subscriber_silence_s=0)


# -- item 4: a pull that races a publish --------------------------------------------------------

class RacingReceiver:
    """Wraps a receiver: before each of the first ``races`` pulls, the trainer publishes ``per_pull``
    newer versions (the version being pulled is then replaced, or gone)."""

    def __init__(self, inner, publish_next, races: int, per_pull: int) -> None:
        self.inner, self.publish_next, self.races, self.per_pull = inner, publish_next, races, per_pull
        self.pulls = 0

    def receive(self, meta):
        self.pulls += 1
        if self.pulls <= self.races:
            for _ in range(self.per_pull):
                self.publish_next()
        return self.inner.receive(meta)

    def skip(self, meta):
        self.inner.skip(meta)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("per_pull", [1, 2], ids=["one-publish-per-pull", "two-publishes-per-pull"])
def test_a_replica_s_first_pull_completes_while_the_trainer_publishes_during_every_pull(per_pull):
    """A replacement replica pulling the latest version while the trainer publishes: one publish
    during the pull still serves the version being pulled; two make it gone, and the replica pulls
    the newest one instead of failing its start."""
    from relax_agent.weights import EngineSubscriber

    cfg = WeightSyncConfig(transport="tcp")
    sync = build_weight_sync(cfg, [])
    versions = iter(range(1, 100))
    published: list[int] = []

    def publish_next() -> None:  # what the trainer's publish does, without waiting for subscribers
        version = next(versions)
        meta = sync._sender.stage(state(float(version)), version)
        sync.coordinator.commit(meta, publisher=sync._publisher_token)
        published.append(version)

    try:
        publish_next()
        engine = TensorEngine(state(0.0))
        racing = RacingReceiver(TcpReceiver(cfg, secret=sync.credential), publish_next, races=5, per_pull=per_pull)
        sub = EngineSubscriber(engine, racing, sync.coordinator, "replacement")
        report = sub.sync_latest(0.0)  # what a starting replica does
        assert report is not None and report.error is None, report
        if per_pull == 1:  # the version it asked for is still served: done in one pull
            assert racing.pulls == 1 and engine.policy_version == 1
        else:  # gone every time for 5 pulls, then the 6th completes on the newest version
            assert racing.pulls == 6 and engine.policy_version == published[-1] == 11
        version = engine.policy_version
        assert torch.equal(engine.tensors["w"], state(float(version))["w"])
        assert sub.refused_version is None  # a superseded pull is not a refusal
        sub.close()
    finally:
        sync.close()
