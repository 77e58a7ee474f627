"""Weight sync, faults and bad input that used to hang, crash or corrupt (issue 17): publisher
restarts, stalled replicas, versions going back, the coordinator's HTTP API (auth, fencing,
malformed requests, NaN timeouts), a busy port, finite weights that overflow an fp32 sum."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping

import httpx
import pytest
import torch

from relax_agent.errors import WeightSyncError
from relax_agent.weights import (
    Coordinator,
    EngineSubscriber,
    TensorEngine,
    WeightSyncConfig,
    build_weight_sync,
    connect_subscriber,
)
from relax_agent.weights.meta import VersionMeta, plan_layout
from relax_agent.weights.service import serve_coordinator
from tests.fixtures import free_port


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), value), "b": torch.full((4,), value)}


def wait_until(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- finite weights ----------------------------------------------------------------------------

def test_finite_weights_whose_fp32_sum_overflows_are_published():
    engine = TensorEngine({"w": torch.zeros(4)})
    sync = build_weight_sync(WeightSyncConfig(), [engine])
    try:
        big = {"w": torch.tensor([3e38, 3e38, 3e38, -1.0])}  # sum overflows fp32; every weight is finite
        assert sync.publish(big, 1).subscribers == 1
        assert engine.policy_version == 1 and torch.equal(engine.tensors["w"], big["w"])
        with pytest.raises(WeightSyncError, match=r"1 tensor\(s\) hold NaN or inf \(w\)"):
            sync.publish({"w": torch.tensor([3e38, float("nan"), 0.0, 0.0])}, 2)
    finally:
        sync.close()


# -- long poll timeouts ------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), -1.0, "5"])
def test_a_nan_or_negative_poll_timeout_is_refused_at_once(bad):
    coord = Coordinator()
    outcome: list = []

    def poll() -> None:
        try:
            outcome.append(coord.wait_for_version(None, bad))
        except WeightSyncError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"wait_for_version(timeout_s={bad!r}) never returned"
    assert isinstance(outcome[0], WeightSyncError) and "expected a number of seconds >= 0" in str(outcome[0])


# -- the coordinator's HTTP API ----------------------------------------------------------------

@pytest.fixture
def served():
    coord = Coordinator()
    publisher = coord.register_publisher(None)
    service = serve_coordinator(coord, "127.0.0.1", 0, token="t0ken", publisher_token=publisher)
    client = httpx.Client(base_url=service.url, timeout=10.0, headers={"Authorization": "Bearer t0ken"})
    yield coord, service, client, publisher
    client.close()
    service.close()


def meta_json(version: int) -> dict:
    tensors, total = plan_layout({"w": torch.zeros(4)})
    return VersionMeta(version, tensors, total, 64, "none").to_json()


ROUTES = [("POST", "/subscribers", {"name": "x"}), ("GET", "/subscribers/x.0", None), ("DELETE", "/subscribers/x", None),
          ("POST", "/versions", meta_json(1)), ("GET", "/versions/latest", None),
          ("GET", "/versions/wait?timeout_s=0", None), ("POST", "/reports", {"subscriber": "x", "version": 1}),
          ("GET", "/status", None)]


@pytest.mark.parametrize("method,path,body", ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", "t0ken"])
def test_every_endpoint_refuses_a_missing_or_wrong_token(served, method, path, body, auth):
    coord, service, _, _ = served
    headers = {} if auth is None else {"Authorization": auth}
    resp = httpx.request(method, service.url + path, json=body, headers=headers, timeout=10.0)
    assert resp.status_code == 401, resp.text
    assert coord.latest() is None and coord.subscribers() == []


def test_only_the_registered_publisher_commits_and_a_second_one_fences_the_first(served):
    coord, service, client, publisher = served
    huge = meta_json(10**15)
    assert client.post("/versions", json=huge).status_code == 403  # a token-holding replica cannot commit
    assert client.post("/versions", json=huge, headers={"X-Relax-Publisher": "guess"}).status_code == 403
    assert coord.latest() is None
    assert client.post("/versions", json=meta_json(1), headers={"X-Relax-Publisher": publisher}).status_code == 200
    coord.register_publisher(None)  # a newer publisher: the first one is fenced out
    with pytest.raises(WeightSyncError, match="fenced out"):
        coord.commit(VersionMeta.from_json(meta_json(2)), publisher=publisher)
    assert coord.latest_version == 1


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/versions", {}),
    ("POST", "/versions", {**meta_json(1), "version": "one"}),
    ("POST", "/versions", {**meta_json(1), "version": -3}),
    ("POST", "/versions", {**meta_json(1), "tensors": [{"name": "w"}]}),
    ("POST", "/versions", {**meta_json(1), "tensors": "w"}),
    ("POST", "/versions", {**meta_json(1), "bucket_bytes": 0}),
    ("POST", "/versions", {**meta_json(1), "surprise": 1}),
    ("POST", "/versions", [1, 2]),
    ("POST", "/versions", "not json"),
    ("POST", "/subscribers", {}),
    ("POST", "/reports", {"subscriber": "x"}),
    ("POST", "/reports", {"subscriber": "x", "version": 1, "stats": {"a": "b"}}),
    ("GET", "/versions/wait?timeout_s=nan", None),
    ("GET", "/versions/wait?timeout_s=-1", None),
    ("GET", "/versions/wait?after=abc", None),
])
def test_malformed_requests_get_4xx_naming_the_problem(served, method, path, body):
    coord, service, client, publisher = served
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    resp = client.request(method, path, headers={"X-Relax-Publisher": publisher}, **kwargs)
    assert resp.status_code == 422, (resp.status_code, resp.text)
    assert "malformed" in resp.text or "expected" in resp.text
    assert coord.latest() is None
    assert client.get("/status").status_code == 200  # the service is still up


def test_a_replica_without_the_token_cannot_connect():
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", service_port=0), [])
    try:
        engine = TensorEngine(state(0.0))
        with pytest.raises(WeightSyncError, match="bearer token"):
            connect_subscriber(sync.service_url, engine, WeightSyncConfig(transport="tcp"))
        with pytest.raises(WeightSyncError, match="401"):
            connect_subscriber(sync.service_url, engine, WeightSyncConfig(transport="tcp"), token="wrong")
        assert sync.coordinator.subscribers() == []
    finally:
        sync.close()


# -- a busy port -------------------------------------------------------------------------------

def test_a_busy_weight_port_leaves_no_coordinator_service_running():
    busy = socket.create_server(("127.0.0.1", 0))
    service_port = free_port()
    try:
        cfg = WeightSyncConfig(transport="tcp", port=busy.getsockname()[1], service_port=service_port)
        with pytest.raises(WeightSyncError, match="cannot listen"):
            build_weight_sync(cfg)
        socket.create_server(("127.0.0.1", service_port)).close()  # free again: nothing serves there
    finally:
        busy.close()


# -- a stalled replica -------------------------------------------------------------------------

class StalledEngine(TensorEngine):
    """Blocks in ``load_weights`` until ``release`` is set (a replica stuck in a long decode)."""

    def __init__(self, state_dict) -> None:
        super().__init__(state_dict)
        self.release = threading.Event()

    def load_weights(self, state_dict, version: int) -> None:
        self.release.wait(120)
        super().load_weights(state_dict, version)


def test_a_stalled_replica_is_reported_as_lagging_not_as_a_failed_publish():
    healthy, stalled = TensorEngine(state(0.0)), StalledEngine(state(0.0))
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", publish_timeout_s=1.0, poll_timeout_s=5.0),
                             [healthy])
    try:
        slow = sync.attach(stalled, name="stalled")
        stats = sync.publish(state(1.0), 1)  # used to raise after publish_timeout_s, though healthy applied it
        assert stats.subscribers == 1 and stats.lagging == (slow.id,)
        assert healthy.policy_version == 1 and sync.latest_version == 1
        sync.cfg = sync.cfg.model_copy(update={"publish_timeout_s": 120.0})
        stats = sync.publish(state(2.0), 2)  # not waited for again while it is still behind
        assert stats.lagging == (slow.id,) and stats.seconds < 60.0 and healthy.policy_version == 2
        stalled.release.set()
        wait_until(lambda: stalled.policy_version == 2, "the stalled replica to catch up")
        stats = sync.publish(state(3.0), 3)  # caught up: waited for again
        assert stats.subscribers == 2 and stats.lagging == ()
        assert torch.equal(stalled.tensors["w"], state(3.0)["w"])
    finally:
        stalled.release.set()
        sync.close()


# -- versions never go back within a run -------------------------------------------------------

class CachingReceiver:
    """A receiver that can deliver any version it was given (as a transport with a version cache could)."""

    def __init__(self, versions: Mapping[int, dict[str, torch.Tensor]]) -> None:
        self.versions = versions

    def receive(self, meta: VersionMeta):
        return self.versions[meta.version], {"receive_s": 0.0, "bytes": 0.0, "resumes": 0.0}

    def skip(self, meta: VersionMeta) -> None:
        pass

    def close(self) -> None:
        pass


def test_an_older_version_arriving_late_does_not_move_the_engine_back():
    coord = Coordinator()
    engine = TensorEngine(state(0.0))
    sub = EngineSubscriber(engine, CachingReceiver({1: state(1.0), 2: state(2.0)}), coord)
    tensors, total = plan_layout(state(0.0))
    v1 = coord.commit(VersionMeta(1, tensors, total, 64, "none"))
    v2 = coord.commit(VersionMeta(2, tensors, total, 64, "none"))
    assert sub.apply(v2).error is None and engine.policy_version == 2
    late = sub.apply(v1)  # e.g. a second sync_latest caller that fetched v1 before v2 came
    assert late.error is not None and "not newer than the applied version 2" in late.error
    assert engine.policy_version == 2 and torch.equal(engine.tensors["w"], state(2.0)["w"])
    assert coord.wait_applied(2, [sub.id], 1.0)[sub.id].version == 2  # its v2 report was not overwritten
    other_run = Coordinator()  # a restarted publisher: its version 1 is another run's, applied
    sub2 = EngineSubscriber(engine, CachingReceiver({1: state(5.0)}), other_run)
    sub2.applied_version, sub2.applied_epoch = sub.applied_version, sub.applied_epoch
    assert sub2.apply(other_run.commit(VersionMeta(1, tensors, total, 64, "none"))).error is None
    assert engine.policy_version == 1 and sub2.applied_epoch == other_run.epoch


# -- a publisher restart -----------------------------------------------------------------------

def test_replicas_register_again_after_a_publisher_restart_and_take_the_new_runs_version(monkeypatch):
    monkeypatch.setenv("RELAX_TEST_WEIGHTS_TOKEN", "shared-secret")
    cfg = WeightSyncConfig(transport="tcp", service_port=free_port(), service_token_env="RELAX_TEST_WEIGHTS_TOKEN",
                           poll_timeout_s=30.0)
    first = build_weight_sync(cfg, [])
    engine = TensorEngine(state(0.0))
    replica = connect_subscriber(first.service_url, engine, cfg, name="replica")
    second = None
    try:
        wait_until(lambda: first.coordinator.subscribers(), "the replica to subscribe")
        assert first.publish(state(1.0), 1).subscribers == 1
        first.close()  # the trainer dies; a new run starts with the same config and port
        second = build_weight_sync(cfg, [])
        polls = []
        real_wait = second.coordinator.wait_for_version

        def counting_wait(*args, **kwargs):
            polls.append(time.monotonic())
            return real_wait(*args, **kwargs)

        second.coordinator.wait_for_version = counting_wait
        wait_until(lambda: second.coordinator.subscribers(), "the replica to register with the new coordinator")
        stats = second.publish(state(7.0), 1)  # the new run's version 1: other weights than the old run's
        assert stats.subscribers == 1 and stats.lagging == ()
        assert engine.policy_version == 1 and torch.equal(engine.tensors["w"], state(7.0)["w"])
        assert replica.applied_epoch == second.coordinator.epoch != ""
        before = len(polls)
        time.sleep(1.0)
        assert len(polls) - before <= 3, f"{len(polls) - before} polls in 1 s: a busy loop"
    finally:
        replica.close()
        first.close()
        if second is not None:
            second.close()


def test_a_replica_that_reports_and_leaves_before_the_publisher_waits_still_counts():
    """A replica that applied its last version and unregistered at once (a race the publisher
    loses on a loaded machine) is counted as having applied it, not dropped from the stats."""
    from relax_agent.weights.coordinator import ApplyReport, Coordinator

    coord = Coordinator()
    sub = coord.register_subscriber("replica")
    coord.report(ApplyReport(subscriber=sub, version=3))
    coord.unregister_subscriber(sub)
    done, missing = coord.wait_reports(3, [sub], timeout_s=0.0)
    assert list(done) == [sub] and done[sub].version == 3 and missing == []
    gone = coord.register_subscriber("other")
    coord.unregister_subscriber(gone)  # left without reporting: in neither
    assert coord.wait_reports(3, [gone], timeout_s=0.0) == ({}, [])
