"""TransferQueue, Ray backend, against a real local Ray (started once for this module).

Producers and consumers run as Ray actors in their own processes; the consumer that dies is
killed with SIGKILL.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from relax_agent.data import DataConfig, FieldSpec, build_transfer_queue  # noqa: E402
from relax_agent.data.ray import LOCAL_RAY_SYSTEM_CONFIG, RayTransferQueue  # noqa: E402
from relax_agent.errors import DataError, LeaseError, QueueTimeoutError  # noqa: E402

pytestmark = pytest.mark.slow

LEASE_S = 1.0


@pytest.fixture(scope="module")
def tq():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    bus = build_transfer_queue(DataConfig(backend="ray", lease_timeout_s=LEASE_S, ray_inline_max_bytes=1024))
    assert isinstance(bus, RayTransferQueue)
    yield bus
    bus.close()
    ray.shutdown()


@ray.remote(num_cpus=0)
class Consumer:
    """A consumer process that takes a batch and holds it."""

    def __init__(self, bus: RayTransferQueue) -> None:
        self.bus = bus

    def pid(self) -> int:
        return os.getpid()

    def take(self, partition: str, consumer: str, n: int) -> list[str]:
        return self.bus.get(partition, ["x"], consumer, n, timeout_s=30).sample_ids


@ray.remote(num_cpus=0)
class Producer:
    """A producer process that puts rows one at a time (blocking while the partition is full)."""

    def __init__(self, bus: RayTransferQueue) -> None:
        self.bus = bus

    def pid(self) -> int:
        return os.getpid()

    def produce(self, partition: str, n: int, width: int) -> int:
        for i in range(n):
            self.bus.put(partition, [f"s{i}"], {"x": np.full((1, width), i, np.int64)}, group_ids=[f"g{i}"],
                         versions=[i], timeout_s=60)
        return n


def test_large_and_small_fields_round_trip_zero_copy(tq):
    tq.create_partition("rt", 64, {"tokens": FieldSpec("int64", (512,)), "reward": FieldSpec("float32"),
                                   "experts": FieldSpec("int16", (2, 4), ragged=True), "msg": FieldSpec("object")})
    tokens = np.arange(32 * 512, dtype=np.int64).reshape(32, 512)  # 128 KiB: object store
    experts = [np.full((n, 2, 4), n, np.int16) for n in (100, 3)]  # 1.6 KiB: object store
    ids = [f"s{i}" for i in range(32)]
    tq.put("rt", ids, {"tokens": tokens}, group_ids=["g"] * 32, versions=[7] * 32)
    tq.put("rt", ids, {"reward": np.linspace(0, 1, 32, dtype=np.float32), "msg": [{"i": i} for i in range(32)]})
    tq.put("rt", ids[:2], {"experts": experts})
    batch = tq.get("rt", ["tokens", "reward", "msg", "experts"], "trainer", 2)
    assert batch.sample_ids == ["s0", "s1"] and batch.versions == [7, 7]
    np.testing.assert_array_equal(batch.fields["tokens"], tokens[:2])
    assert not batch.fields["tokens"].flags.writeable  # a view of shared memory
    assert batch.fields["reward"].dtype == np.float32 and batch.fields["msg"] == [{"i": 0}, {"i": 1}]
    assert [e.shape for e in batch.fields["experts"]] == [(100, 2, 4), (3, 2, 4)]
    rest = tq.get("rt", ["tokens"], "trainer", 30)
    np.testing.assert_array_equal(rest.fields["tokens"], tokens[2:])
    assert tq.ack(batch.lease_id) is True and tq.ack(batch.lease_id) is False


def test_read_by_id_over_both_paths_resolves_object_store_rows(tq):
    """The trainer actor's read: named rows, object-store values fetched, through the socket channel
    (the reply is parked) and through Ray; a retired row is refused by name."""
    plain = RayTransferQueue(DataConfig(backend="ray", lease_timeout_s=LEASE_S, ray_inline_max_bytes=1024,
                                        ray_direct_channel=False))
    tq.create_partition("rd", 8, {"x": FieldSpec("int64", (600,)), "r": FieldSpec("float32")},
                        retire_after=["t"])
    big = np.arange(4 * 600, dtype=np.int64).reshape(4, 600)  # through the object store
    tq.put("rd", ["a", "b", "c", "d"], {"x": big, "r": np.arange(4, dtype=np.float32)}, group_ids=["g"] * 4,
           versions=[1] * 4)
    for bus in (tq, plain):
        fields = bus.read("rd", ["d", "b"], ["x", "r"])
        np.testing.assert_array_equal(fields["x"], big[[3, 1]])
        assert fields["r"].tolist() == [3.0, 1.0]
    batch = tq.get("rd", ["r"], "t", 4)
    tq.ack(batch.lease_id)
    with pytest.raises(DataError, match=r"rows are not live \(1 retired"):
        plain.read("rd", ["a"], ["r"])


def test_bad_input_is_refused_over_ray_and_rows_stay_readable(tq):
    tq.create_partition("bad", 8, {"x": FieldSpec("int64", (4,))})
    tq.put("bad", ["a"], {"x": np.ones((1, 4), np.int64)}, group_ids=["g"], versions=[0])
    with pytest.raises(DataError, match=r"field 'x' of sample 'b': dtype int32"):
        tq.put("bad", ["b"], {"x": np.ones((1, 4), np.int32)}, group_ids=["g"], versions=[0])
    with pytest.raises(DataError, match=r"sample 'b': shape \[1000\]"):  # large: checked from its shapes
        tq.put("bad", ["b"], {"x": np.ones((1, 1000), np.int64)}, group_ids=["g"], versions=[0])
    with pytest.raises(DataError, match="duplicate sample id 'a'"):
        tq.put("bad", ["a"], {"x": np.ones((1, 4), np.int64)}, group_ids=["g"], versions=[0])
    with pytest.raises(DataError, match="unknown field 'y'"):
        tq.put("bad", ["c"], {"y": [1]}, group_ids=["g"], versions=[0])
    with pytest.raises(QueueTimeoutError):
        tq.get("bad", ["x"], "t", 2, timeout_s=0.1)
    with pytest.raises(LeaseError):
        tq.ack("nope")
    with pytest.raises(DataError, match="unknown data-bus method '_adopt'"):
        tq._call("_adopt", {})
    assert tq.get("bad", ["x"], "t", 1).fields["x"].tolist() == [[1, 1, 1, 1]]


def test_rows_of_a_killed_consumer_are_redelivered_without_loss(tq):
    tq.create_partition("kill", 64)
    n = 24
    tq.put("kill", [f"s{i}" for i in range(n)], {"x": np.arange(n)}, group_ids=["g"] * n, versions=[0] * n)
    victim = Consumer.remote(tq)
    taken = ray.get(victim.take.remote("kill", "trainer", 8))
    assert taken == [f"s{i}" for i in range(8)]
    os.kill(ray.get(victim.pid.remote()), signal.SIGKILL)
    seen = []
    for _ in range(n // 8):  # the survivor gets the dead consumer's rows once their lease expires
        batch = tq.get("kill", ["x"], "trainer", 8, timeout_s=30)
        seen.extend(batch.sample_ids)
        tq.ack(batch.lease_id)
    assert sorted(seen) == sorted(f"s{i}" for i in range(n))
    assert tq.stats("kill")["redelivered_rows"] == 8
    with pytest.raises(QueueTimeoutError):  # nothing left, nothing twice
        tq.get("kill", ["x"], "trainer", 1, timeout_s=0.1)


def test_producer_process_blocks_on_a_full_partition_and_order_is_kept(tq):
    tq.create_partition("bp", 4, retire_after=["trainer"])
    n, width = 40, 2048  # 16 KiB per row: through the object store
    done = Producer.remote(tq).produce.remote("bp", n, width)
    seen, peak = [], 0
    while len(seen) < n:
        time.sleep(0.005)  # a slow consumer
        peak = max(peak, tq.stats("bp")["rows"])
        batch = tq.get("bp", ["x"], "trainer", 2, timeout_s=30)
        assert batch.fields["x"][0].shape == (width,)
        seen.extend(int(row[0]) for row in batch.fields["x"])
        tq.ack(batch.lease_id)
    assert ray.get(done) == n
    assert seen == list(range(n)) and peak <= 4
    assert tq.stats("bp")["retired_rows"] == n


def test_a_waiting_get_does_not_block_other_calls(tq):
    tq.create_partition("wait", 8)
    waiter = Consumer.remote(tq)
    pending = waiter.take.remote("wait", "reader", 1)  # blocks in the actor until a row arrives
    time.sleep(0.2)
    tq.put("wait", ["a"], {"x": [1]}, group_ids=["g"], versions=[0])
    assert ray.get(pending, timeout=30) == ["a"]
    ray.kill(waiter)


def test_ray_task_path_and_socket_channel_share_one_state(tq):
    plain = RayTransferQueue(DataConfig(backend="ray", lease_timeout_s=LEASE_S, ray_inline_max_bytes=1024,
                                        ray_direct_channel=False))
    assert plain._same_node_channel() is None and tq._same_node_channel() is not None
    tq.create_partition("both", 8)
    big = np.arange(4 * 600).reshape(4, 600)  # through the object store
    plain.put("both", ["a", "b", "c", "d"], {"x": big}, group_ids=["g"] * 4, versions=[1] * 4)
    tq.put("both", ["a", "b"], {"r": [1.0, 2.0]})  # small: through the socket
    batch = tq.get("both", ["x", "r"], "t", 2)  # reply holds object refs: parked, fetched via Ray
    np.testing.assert_array_equal(batch.fields["x"], big[:2])
    assert plain.ack(batch.lease_id) is True and tq.ack(batch.lease_id) is False
    assert plain.stats("both")["consumers"]["t"] == {"acked": 2, "leased": 0}


def test_rows_of_a_killed_producer_stay_readable_when_the_actor_adopts_them(tq):
    bus = RayTransferQueue(DataConfig(backend="ray", lease_timeout_s=LEASE_S, ray_inline_max_bytes=1024,
                                      ray_adopt_values=True, ray_actor_name="adopting"))
    bus.create_partition("prod", 8)
    producer = Producer.remote(bus)
    assert ray.get(producer.produce.remote("prod", 3, 512)) == 3  # 4 KiB rows: object store
    os.kill(ray.get(producer.pid.remote()), signal.SIGKILL)
    time.sleep(1.0)  # the owner's death is known; values it owned would be freed
    batch = bus.get("prod", ["x"], "trainer", 3, timeout_s=10)
    assert [int(row[0]) for row in batch.fields["x"]] == [0, 1, 2]
    bus.close()


def test_rows_a_dead_producer_took_with_it_are_dropped_and_rows_behind_them_delivered(tq):
    """Without adopted values a killed producer's object-store rows are lost: a get drops them (and the
    rest of their group), counts them, and delivers the good rows queued behind them; the ids of
    dropped rows are never stored again."""
    bus = RayTransferQueue(DataConfig(backend="ray", lease_timeout_s=LEASE_S, ray_inline_max_bytes=1024,
                                      ray_actor_name="not-adopting"))
    bus.create_partition("lost", 8)
    producer = Producer.remote(bus)
    assert ray.get(producer.produce.remote("lost", 2, 512)) == 2  # 4 KiB rows s0, s1: owned by the producer
    os.kill(ray.get(producer.pid.remote()), signal.SIGKILL)
    time.sleep(1.0)
    bus.put("lost", ["ok0", "ok1"], {"x": np.ones((2, 512), np.int64)}, group_ids=["h", "h"], versions=[0, 0])
    try:
        batch = bus.get("lost", ["x"], "trainer", 2, timeout_s=30)
        if batch.sample_ids != ["ok0", "ok1"]:  # Ray kept the dead owner's objects: nothing was lost
            pytest.skip(f"Ray still served the dead producer's objects ({batch.sample_ids})")
        assert np.asarray(batch.fields["x"]).tolist() == np.ones((2, 512), np.int64).tolist()
        stats = bus.stats("lost")
        assert stats["dead_rows"] == 2 and stats["rows"] == 2
        with pytest.raises(DataError, match="duplicate sample id 's0'"):
            bus.put("lost", ["s0"], {"x": np.zeros((1, 512), np.int64)}, group_ids=["g0"], versions=[0])
    finally:
        bus.close()


def test_get_timeout_names_the_field_no_row_has_and_a_running_ray_is_reused(tq):
    from relax_agent.data.ray import start_ray

    tq.create_partition("nofield", 8)
    tq.put("nofield", ["a"], {"x": [1]}, group_ids=["g"], versions=[0])
    with pytest.raises(QueueTimeoutError, match=r"no row has field\(s\) \['nope'\] yet"):
        tq.get("nofield", ["x", "nope"], "t", 1, timeout_s=0.1)
    assert start_ray(DataConfig(backend="ray")) is False and ray.is_initialized()  # not ours to start or stop


@pytest.mark.parametrize("bad", ["abc", 1.7, None, -1, True])
def test_a_bad_version_is_refused_by_name_and_the_channel_keeps_working(tq, bad):
    part = f"badv-{bad!r}"
    tq.create_partition(part, 4)
    with pytest.raises(DataError, match=re.escape(f"versions[0]={bad!r}")):
        tq.put(part, ["y"], {"r": [1.0]}, group_ids=["g"], versions=[bad])
    channel = tq._same_node_channel()
    ok, err = channel.call("put", (part, ["y"], {"r": [1.0]}, ["g"], [bad], None, False))  # skips the client check
    assert ok is False and isinstance(err, DataError)
    tq.put(part, ["ok"], {"r": [1.0]}, group_ids=["g"], versions=[np.int64(3)])  # same connection, still up
    assert tq.stats(part)["rows"] == 1
    batch = tq.get(part, ["r"], "t", 1, timeout_s=5)
    assert batch.sample_ids == ["ok"] and list(batch.versions) == [3] and type(batch.versions[0]) is int


def test_put_after_close_is_refused(tq):  # tq: Ray is up
    bus = RayTransferQueue(DataConfig(backend="ray", ray_actor_name="closing"))
    bus.create_partition("p", 4)
    bus.close()
    bus.close()  # idempotent
    with pytest.raises(DataError, match="after close"):
        bus.put("p", ["late"], {"r": [1.0]}, group_ids=["g"], versions=[0])
    with pytest.raises(DataError, match="after close"):
        bus.stats("p")


def test_a_bus_reattached_by_name_right_after_the_last_handle_dropped_works(tq):  # tq: Ray is up
    for round_ in range(3):  # each round's actor dies with its handle; the next finds the dying one by name
        bus = RayTransferQueue(DataConfig(backend="ray", ray_actor_name="reattach"))
        bus.create_partition("p", 4)
        bus.put("p", [f"s{round_}"], {"r": [float(round_)]}, group_ids=["g"], versions=[0])
        assert bus.get("p", ["r"], "t", 1, timeout_s=5).fields["r"] == [float(round_)]
        del bus
        gc.collect()


_SECOND_DRIVER = """
import json, sys
import numpy as np
import ray
from relax_agent.data import DataConfig
from relax_agent.data.ray import RayTransferQueue
args = json.loads(sys.argv[1])
ray.init(address=args["address"], include_dashboard=False, log_to_driver=False)  # its own (anonymous) namespace
bus = RayTransferQueue(DataConfig(backend="ray", ray_actor_name=args["name"]))
bus.put("shared", ["from-child"], {"x": [7]}, group_ids=["g"], versions=[0])
print("put done")
"""


def test_a_second_driver_joining_the_cluster_shares_the_bus(tq):
    import json
    import subprocess

    bus = RayTransferQueue(DataConfig(backend="ray", ray_actor_name="shared-bus", lease_timeout_s=LEASE_S))
    bus.create_partition("shared", 4)
    args = {"address": ray.get_runtime_context().gcs_address, "name": "shared-bus"}
    child = subprocess.run([sys.executable, "-c", _SECOND_DRIVER, json.dumps(args)], capture_output=True,
                           text=True, timeout=180)
    assert child.returncode == 0, child.stderr[-3000:]
    batch = bus.get("shared", ["x"], "trainer", 1, timeout_s=30)
    assert batch.sample_ids == ["from-child"] and batch.fields["x"].tolist() == [7]
    bus.close()


class _DriverOnly:
    """A value that pickles by reference to this test module, which only the test's process imports."""

    def __init__(self, n: int) -> None:
        self.n = n


@pytest.mark.parametrize("value", [lambda x: x, _DriverOnly(3)], ids=["lambda", "class-by-value"])
def test_a_value_the_channel_cannot_carry_is_refused_at_put(tq, value):
    part = f"poison-put-{type(value).__name__}"
    slow = RayTransferQueue(DataConfig(backend="ray", ray_actor_name=part, lease_timeout_s=300,
                                       ray_inline_max_bytes=1024))
    slow.create_partition(part, 4)
    big = np.zeros((1, 1024), np.int64)  # an object-store field: the put travels as a Ray task (cloudpickle)
    with pytest.raises(DataError, match=r"field 'meta' of sample 'bad'.*cannot be pickled"):
        slow.put(part, ["bad"], {"meta": [value], "x": big}, group_ids=["g"], versions=[0])
    with pytest.raises(DataError, match=r"cannot be pickled|could not be unpickled"):  # the socket path too
        slow.put(part, ["bad"], {"meta": [value]}, group_ids=["g"], versions=[0])
    assert slow.stats(part)["rows"] == 0
    slow.put(part, ["ok"], {"meta": [{"n": 3}], "x": big}, group_ids=["g"], versions=[0])
    assert slow.get(part, ["meta"], "t", 1, timeout_s=10).fields["meta"] == [{"n": 3}]  # the channel still works


def test_a_row_the_reader_cannot_unpickle_fails_that_read_and_is_released_at_once(tq, monkeypatch):
    import relax_agent.data.ray.wire as ray_wire

    slow = RayTransferQueue(DataConfig(backend="ray", ray_actor_name="poison-get", lease_timeout_s=300))
    slow.create_partition("poison-get", 4)
    slow.put("poison-get", ["p0", "p1"], {"meta": [{"a": 1}, {"b": 2}]}, group_ids=["g", "g"], versions=[0, 0])

    def cannot_load(blob: bytes) -> list:
        raise ModuleNotFoundError("No module named 'only_on_the_producer'")

    monkeypatch.setattr(ray_wire, "unpickle_rows", cannot_load)  # this reader lacks a module the values need
    with pytest.raises(DataError, match=r"rows \['p0', 'p1'\] hold values this process cannot unpickle.*released"):
        slow.get("poison-get", ["meta"], "t", 2, timeout_s=10)
    monkeypatch.undo()
    assert slow.stats("poison-get")["active_leases"] == 0  # not held until lease_timeout_s (300 s)
    batch = slow.get("poison-get", ["meta"], "t", 2, timeout_s=10)
    assert batch.fields["meta"] == [{"a": 1}, {"b": 2}]
