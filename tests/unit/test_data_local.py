"""TransferQueue, in-process backend: readiness, cursors, samplers, leases, back-pressure, bad input."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from relax_agent.config import load_config
from relax_agent.data import (
    DataConfig,
    FieldSpec,
    GroupSampler,
    TokenBudgetSampler,
    build_transfer_queue,
    queue_capacity,
)
from relax_agent.data.local import LocalTransferQueue
from relax_agent.errors import ConfigError, DataError, LeaseError, QueueTimeoutError

SCHEMA = {
    "prompt_ids": FieldSpec("int64", ragged=True),
    "response_ids": FieldSpec("int64", ragged=True),
    "logprobs": FieldSpec("float32", ragged=True),
    "reward": FieldSpec("float32"),
    "routed_experts": FieldSpec("uint8", (2, 3), ragged=True),
    "messages": FieldSpec("object"),
}


def make_tq(lease_timeout_s: float = 300.0) -> LocalTransferQueue:
    tq = build_transfer_queue(DataConfig(lease_timeout_s=lease_timeout_s))
    assert isinstance(tq, LocalTransferQueue)
    return tq


def put_rows(tq, partition: str, ids: list[str], group: str = "g0", version: int = 0, **fields) -> None:
    tq.put(partition, ids, fields, group_ids=[group] * len(ids), versions=[version] * len(ids))


def test_get_waits_until_every_requested_field_is_written():
    tq = make_tq()
    tq.create_partition("p", 8, SCHEMA)
    put_rows(tq, "p", ["a", "b"], prompt_ids=[np.arange(3), np.arange(5)])
    with pytest.raises(QueueTimeoutError, match="not ready"):
        tq.get("p", ["prompt_ids", "reward"], "trainer", 2, timeout_s=0.05)
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("b", tq.get("p", ["prompt_ids", "reward"], "trainer", 2)))
    waiter.start()
    tq.put("p", ["a"], {"reward": [1.0]})
    time.sleep(0.05)
    assert "b" not in got  # only one of the two rows is ready
    tq.put("p", ["b"], {"reward": np.array([0.5], dtype=np.float32)})
    waiter.join(5)
    batch = got["b"]
    assert batch.sample_ids == ["a", "b"] and batch.group_ids == ["g0", "g0"] and batch.versions == [0, 0]
    np.testing.assert_array_equal(batch.fields["reward"], np.array([1.0, 0.5], dtype=np.float32))
    assert batch.fields["reward"].dtype == np.float32
    assert [len(r) for r in batch.fields["prompt_ids"]] == [3, 5]


def test_each_consumer_has_its_own_cursor():
    tq = make_tq()
    tq.create_partition("p", 8)
    put_rows(tq, "p", ["a", "b", "c"], reward=[1.0, 2.0, 3.0])
    first = tq.get("p", ["reward"], "trainer", 2)
    tq.ack(first.lease_id)
    assert tq.get("p", ["reward"], "trainer", 1).sample_ids == ["c"]
    assert tq.get("p", ["reward"], "logger", 3).sample_ids == ["a", "b", "c"]
    with pytest.raises(QueueTimeoutError):  # c is leased to the trainer, a and b acked
        tq.get("p", ["reward"], "trainer", 1, timeout_s=0.02)


def test_group_sampler_hands_out_whole_groups_only():
    tq = make_tq()
    tq.create_partition("p", 16, group_size=3)
    put_rows(tq, "p", ["a0", "a1"], group="A", reward=[0.0, 1.0])
    put_rows(tq, "p", ["b0", "b1", "b2"], group="B", reward=[0.0, 1.0, 0.0])
    with pytest.raises(QueueTimeoutError):  # one whole group, two asked for
        tq.get("p", ["reward"], "trainer", 6, timeout_s=0.02, sampler="group")
    put_rows(tq, "p", ["a2"], group="A", reward=[1.0])
    batch = tq.get("p", ["reward"], "trainer", 6, sampler="group")
    assert batch.sample_ids == ["b0", "b1", "b2", "a0", "a1", "a2"]
    with pytest.raises(DataError, match="not a multiple of group_size=3"):
        tq.get("p", ["reward"], "other", 4, sampler=GroupSampler(3))
    tq.create_partition("q", 4)
    with pytest.raises(DataError, match="needs group_size"):
        tq.get("q", ["reward"], "trainer", 2, sampler="group")


def test_token_budget_sampler_cuts_micro_batches_by_tokens():
    tq = make_tq()
    tq.create_partition("p", 16, SCHEMA)
    lengths = [4, 4, 7, 2, 9, 3]  # the last row waits: 3 tokens fill neither budget nor batch
    put_rows(tq, "p", [f"s{i}" for i in range(6)], response_ids=[np.zeros(n, np.int64) for n in lengths])
    budget = TokenBudgetSampler(max_tokens=10, length_field="response_ids")
    sizes = []
    for _ in range(3):
        batch = tq.get("p", ["response_ids"], "trainer", 8, sampler=budget)
        sizes.append([len(r) for r in batch.fields["response_ids"]])
    assert sizes == [[4, 4], [7, 2], [9]]


def test_expired_lease_is_redelivered_and_acks_are_idempotent():
    tq = make_tq(lease_timeout_s=0.1)
    tq.create_partition("p", 8)
    put_rows(tq, "p", ["a", "b"], reward=[1.0, 2.0])
    lost = tq.get("p", ["reward"], "trainer", 2)  # a consumer that never acks
    again = tq.get("p", ["reward"], "trainer", 2, timeout_s=5)  # blocks until the lease expires
    assert again.sample_ids == ["a", "b"] and again.lease_id != lost.lease_id
    assert tq.ack(again.lease_id) is True
    assert tq.ack(again.lease_id) is False
    with pytest.raises(LeaseError, match="handed out again"):
        tq.ack(lost.lease_id)
    with pytest.raises(LeaseError, match="unknown lease"):
        tq.ack("no-such-lease")
    stats = tq.stats("p")
    assert stats["redelivered_rows"] == 2 and stats["consumers"]["trainer"] == {"acked": 2, "leased": 0}


def test_late_ack_of_an_expired_lease_counts_while_its_rows_were_not_handed_out_again():
    tq = make_tq(lease_timeout_s=0.02)
    tq.create_partition("p", 8)
    put_rows(tq, "p", ["a"], reward=[1.0])
    slow = tq.get("p", ["reward"], "trainer", 1)
    time.sleep(0.05)
    assert tq.stats("p")["active_leases"] == 0
    assert tq.ack(slow.lease_id) is True
    with pytest.raises(QueueTimeoutError):
        tq.get("p", ["reward"], "trainer", 1, timeout_s=0.05)


def test_nack_hands_rows_out_again_at_once():
    tq = make_tq()
    tq.create_partition("p", 8)
    put_rows(tq, "p", ["a"], reward=[1.0])
    first = tq.get("p", ["reward"], "trainer", 1)
    assert tq.nack(first.lease_id) is True and tq.nack(first.lease_id) is False
    second = tq.get("p", ["reward"], "trainer", 1, timeout_s=0.5)
    assert second.sample_ids == ["a"]
    tq.ack(second.lease_id)
    with pytest.raises(LeaseError, match="already acked"):
        tq.nack(second.lease_id)


def test_producer_blocks_on_a_full_partition_and_nothing_is_lost_or_reordered():
    tq = make_tq()
    tq.create_partition("p", 4, retire_after=["trainer"])
    n = 30
    produced = []

    def producer():
        for i in range(n):
            tq.put("p", [f"s{i}"], {"x": [np.full(3, i)]}, group_ids=["g"], versions=[0], timeout_s=10)
            produced.append(i)

    thread = threading.Thread(target=producer)
    thread.start()
    seen, peak = [], 0
    while len(seen) < n:
        time.sleep(0.002)  # a slow consumer
        peak = max(peak, tq.stats("p")["rows"])
        batch = tq.get("p", ["x"], "trainer", 1 + len(seen) % 3 if n - len(seen) >= 3 else 1, timeout_s=10)
        seen.extend(int(row[0]) for row in batch.fields["x"])
        tq.ack(batch.lease_id)
    thread.join(10)
    assert seen == list(range(n)) and produced == list(range(n))
    assert peak <= 4
    stats = tq.stats("p")
    assert stats["rows"] == 0 and stats["retired_rows"] == n and stats["put_rows"] == n


def test_put_timeout_on_a_full_partition_changes_nothing():
    tq = make_tq()
    tq.create_partition("p", 2)
    put_rows(tq, "p", ["a", "b"], reward=[1.0, 2.0])
    with pytest.raises(QueueTimeoutError, match="0 free rows"):
        tq.put("p", ["c"], {"reward": [3.0]}, group_ids=["g"], versions=[0], timeout_s=0.05)
    with pytest.raises(DataError, match="can never fit"):
        tq.put("p", ["c", "d", "e"], {"reward": [1.0] * 3}, group_ids=["g"] * 3, versions=[0] * 3)
    assert tq.stats("p")["rows"] == 2
    assert tq.get("p", ["reward"], "t", 2).fields["reward"].tolist() == [1.0, 2.0]


def test_clear_drops_rows_and_leases_and_unblocks_producers():
    tq = make_tq()
    tq.create_partition("p", 1)
    put_rows(tq, "p", ["a"], reward=[1.0])
    lease = tq.get("p", ["reward"], "t", 1).lease_id
    waiting = threading.Thread(target=lambda: put_rows(tq, "p", ["b"], reward=[2.0]))
    waiting.start()
    tq.clear("p")
    waiting.join(5)
    assert not waiting.is_alive()
    assert tq.ack(lease) is False
    assert tq.get("p", ["reward"], "t", 1).sample_ids == ["b"]
    assert tq.stats("p")["fields"] == {"reward": "float64"}
    with pytest.raises(DataError, match=r"duplicate sample id 'a': a row with that id was stored before a clear"):
        put_rows(tq, "p", ["a"], reward=[3.0])  # the holder of the cleared lease may still train "a"


def test_dropping_dead_rows_frees_their_group_and_hands_the_rest_back():
    """What the Ray backend does when a reader finds values lost: the named rows and the rest of their
    group go for good (counted), the lease's other rows are handed out again at once."""
    tq = make_tq()
    tq.create_partition("p", 8, group_size=2)
    put_rows(tq, "p", ["a0", "a1"], group="a", reward=[0.0, 1.0])
    put_rows(tq, "p", ["b0", "b1"], group="b", reward=[2.0, 3.0])
    batch = tq.get("p", ["reward"], "t", 4, sampler="group")
    assert tq._store.drop_dead(batch.lease_id, ["a1"]) == ["a0", "a1"]
    assert tq.get("p", ["reward"], "t", 2, sampler="group", timeout_s=30).sample_ids == ["b0", "b1"]
    assert tq.stats("p")["dead_rows"] == 2 and tq.stats("p")["rows"] == 2
    with pytest.raises(LeaseError, match="was nacked"):
        tq._store.drop_dead(batch.lease_id, ["b0"])


@pytest.mark.parametrize(
    ("ids", "fields", "creating", "match"),
    [
        (["c"], {"reward": np.array([1.0])}, True, r"field 'reward' of sample 'c': dtype float64 does not match.*float32"),
        (["c"], {"routed_experts": [np.zeros((4, 2, 2), np.uint8)]}, True, r"'routed_experts' of sample 'c': shape \[4, 2, 2\]"),
        (["c"], {"routed_experts": [np.zeros((4, 2, 3), np.int16)]}, True, r"dtype int16 does not match.*uint8\[\*,2,3\]"),
        (["c"], {"advantage": [1.0]}, True, r"unknown field 'advantage'"),
        (["c", "a"], {"reward": [1.0, 2.0]}, True, r"duplicate sample id 'a'"),
        (["c", "c"], {"reward": [1.0, 2.0]}, True, r"sample id 'c' appears twice"),
        (["zz"], {"reward": [1.0]}, False, r"unknown sample id 'zz'"),
        (["a"], {"reward": [9.0]}, False, r"field 'reward' of sample 'a' is already written"),
        (["c", "d"], {"reward": [1.0, "x"]}, True, r"field 'reward' of sample 'd'.*does not fit"),
        (["c", "d"], {"reward": [1.0]}, True, r"field 'reward': 1 values for 2 sample ids"),
        (["c"], {"prompt_ids": [[[1, 2], [3]]]}, True, r"not a rectangular"),
    ],
)
def test_bad_put_is_refused_by_name_and_stored_rows_stay_intact(ids, fields, creating, match):
    tq = make_tq()
    tq.create_partition("p", 8, SCHEMA)
    experts = np.arange(24, dtype=np.uint8).reshape(4, 2, 3)
    put_rows(tq, "p", ["a", "b"], prompt_ids=[np.arange(3), np.arange(2)], reward=[1.0, 0.0],
             routed_experts=[experts, experts[:1]])
    kwargs = {"group_ids": ["g"] * len(ids), "versions": [1] * len(ids)} if creating else {}
    with pytest.raises(DataError, match=match):
        tq.put("p", ids, fields, **kwargs)
    stats = tq.stats("p")
    assert stats["rows"] == 2 and stats["put_rows"] == 2
    batch = tq.get("p", ["prompt_ids", "reward", "routed_experts"], "t", 2, timeout_s=1)
    assert batch.sample_ids == ["a", "b"]
    np.testing.assert_array_equal(batch.fields["reward"], [1.0, 0.0])
    np.testing.assert_array_equal(batch.fields["routed_experts"][0], experts)
    np.testing.assert_array_equal(batch.fields["routed_experts"][1], experts[:1])
    with pytest.raises(QueueTimeoutError):  # the refused rows were not created
        tq.get("p", ["reward"], "t2", 3, timeout_s=0.01)


def test_fields_of_every_kind_round_trip():
    tq = make_tq()
    tq.create_partition("p", 8, SCHEMA | {"pixel_values": FieldSpec("float32", (6,), ragged=True),
                                         "loss_mask": FieldSpec("uint8", ragged=True)})
    messages = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "image"}]}]]
    experts = [np.ones((5, 2, 3), np.uint8), np.zeros((2, 2, 3), np.uint8)]
    put_rows(tq, "p", ["a", "b"], messages=messages, routed_experts=experts,
             pixel_values=[np.full((4, 6), 0.5, np.float32), np.zeros((1, 6), np.float32)])
    tq.put("p", ["b", "a"], {"loss_mask": [[1, 1], [0, 1, 1, 1, 1]], "logprobs": [np.zeros(2, np.float32)] * 2})
    batch = tq.get("p", ["messages", "routed_experts", "pixel_values", "loss_mask"], "t", 2)
    assert batch.fields["messages"] == messages
    assert [e.shape for e in batch.fields["routed_experts"]] == [(5, 2, 3), (2, 2, 3)]
    assert batch.fields["pixel_values"][0].dtype == np.float32 and batch.fields["pixel_values"][0].shape == (4, 6)
    assert [m.tolist() for m in batch.fields["loss_mask"]] == [[0, 1, 1, 1, 1], [1, 1]]
    assert batch.fields["loss_mask"][0].dtype == np.uint8


def test_first_put_fixes_a_field_without_schema():
    tq = make_tq()
    tq.create_partition("p", 8)
    put_rows(tq, "p", ["a"], tokens=[[1, 2, 3]], reward=[1.0], ok=[True], meta=[{"k": 1}], pix=np.zeros((1, 2, 4), np.float32))
    assert tq.stats("p")["fields"] == {"tokens": "int64[*]", "reward": "float64", "ok": "bool", "meta": "object",
                                       "pix": "float32[*,4]"}
    with pytest.raises(DataError, match="does not match the partition's float32"):
        put_rows(tq, "p", ["b"], pix=np.zeros((1, 2, 3), np.float32))


def test_batch_put_and_get_share_memory_and_are_read_only():
    tq = make_tq()
    tq.create_partition("p", 64, {"tokens": FieldSpec("int64", (16,))})
    data = np.arange(64 * 16).reshape(64, 16)
    put_rows(tq, "p", [f"s{i}" for i in range(64)], tokens=data)
    batch = tq.get("p", ["tokens"], "t", 32)
    assert batch.fields["tokens"].shape == (32, 16) and np.shares_memory(batch.fields["tokens"], data)
    assert not batch.fields["tokens"].flags.writeable
    np.testing.assert_array_equal(batch.fields["tokens"], data[:32])
    tq.nack(batch.lease_id)
    tq.ack(tq.get("p", ["tokens"], "t", 16).lease_id)
    rest = tq.get("p", ["tokens"], "t", 48)  # two runs of the same chunk joined
    np.testing.assert_array_equal(rest.fields["tokens"], data[16:])


def test_retired_rows_free_capacity_over_many_puts():
    tq = make_tq()
    tq.create_partition("p", 8, retire_after=["trainer", "logger"])
    total = 3000
    for start in range(0, total, 4):
        ids = [f"s{i}" for i in range(start, start + 4)]
        put_rows(tq, "p", ids, x=np.arange(start, start + 4))
        for consumer in ("trainer", "logger"):
            batch = tq.get("p", ["x"], consumer, 4, timeout_s=1)
            assert batch.fields["x"].tolist() == list(range(start, start + 4))
            tq.ack(batch.lease_id)
    assert tq.stats("p")["retired_rows"] == total
    with pytest.raises(DataError, match="already consumed and retired"):
        tq.put("p", ["s5"], {"y": [1]})


def test_partition_errors_and_settings():
    tq = make_tq()
    with pytest.raises(DataError, match="partition 'nope' does not exist"):
        tq.get("nope", ["x"], "t", 1)
    tq.create_partition("p", 4, {"x": "int64"}, group_size=2)
    tq.create_partition("p", 4, {"x": "int64"}, group_size=2)  # same settings: fine
    with pytest.raises(DataError, match="already exists with other settings"):
        tq.create_partition("p", 8)
    with pytest.raises(DataError, match="unknown field"):
        tq.get("p", ["y"], "t", 1)
    with pytest.raises(DataError, match="capacity_rows=0"):
        tq.create_partition("q", 0)
    with pytest.raises(DataError, match="not a numpy dtype"):
        FieldSpec("int65")


def test_queue_capacity_and_config():
    assert queue_capacity(rollout_batch=8, max_staleness=0, group_size=4) == 32
    assert queue_capacity(rollout_batch=8, max_staleness=2, group_size=4) == 96
    with pytest.raises(ConfigError):
        queue_capacity(8, -1, 4)
    cfg = load_config(None, ["data.backend=ray", "data.lease_timeout_s=30"])
    assert cfg.data.backend == "ray" and cfg.data.lease_timeout_s == 30
    with pytest.raises(ConfigError, match="lease_timeout"):
        load_config(None, ["data.lease_timeout=30"])


def test_batch_larger_than_the_capacity_is_refused():
    tq = make_tq()
    tq.create_partition("p", 4)
    with pytest.raises(DataError, match="batch_size=5 can never be ready with capacity_rows=4"):
        tq.get("p", ["x"], "t", 5)


def test_concurrent_producers_and_consumers_deliver_each_row_once_per_consumer():
    tq = make_tq(lease_timeout_s=0.05)
    tq.create_partition("p", 16, retire_after=["trainer"])
    producers, per_producer = 3, 40
    acked: list[str] = []
    lock = threading.Lock()

    def produce(p: int) -> None:
        for i in range(per_producer):
            tq.put("p", [f"p{p}-{i}"], {"x": [i]}, group_ids=[f"g{p}"], versions=[0], timeout_s=10)

    def consume(c: int) -> None:
        rng = np.random.default_rng(c)
        while True:
            try:
                batch = tq.get("p", ["x"], "trainer", 2, timeout_s=0.5)
            except QueueTimeoutError:
                return
            roll = rng.random()
            if roll < 0.15:
                continue  # this worker "dies": the lease expires and another worker gets the rows
            if roll < 0.3:
                tq.nack(batch.lease_id)
                continue
            if tq.ack(batch.lease_id):
                with lock:
                    acked.extend(batch.sample_ids)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    threads += [threading.Thread(target=consume, args=(c,)) for c in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = {f"p{p}-{i}" for p in range(producers) for i in range(per_producer)}
    assert sorted(acked) == sorted(expected)  # every row acked exactly once: no loss, no duplicate
    assert tq.stats("p")["rows"] == 0


@pytest.mark.parametrize("bad", ["abc", 1.7, None, -1, True, np.float64(2.0)])
def test_a_bad_version_is_refused_by_name_before_any_row_is_stored(bad):
    tq = make_tq()
    tq.create_partition("p", 4)
    with pytest.raises(DataError, match=re.escape(f"versions[1]={bad!r}")):
        tq.put("p", ["a", "b"], {"r": [1.0, 2.0]}, group_ids=["g", "g"], versions=[0, bad])
    assert tq.stats("p")["rows"] == 0
    tq.put("p", ["a"], {"r": [1.0]}, group_ids=["g"], versions=[np.int32(7)])
    batch = tq.get("p", ["r"], "t", 1, timeout_s=1)
    assert list(batch.versions) == [7] and type(batch.versions[0]) is int


def test_read_returns_named_rows_in_the_given_order_without_a_lease():
    """The trainer service reads the rows the loop leased: by id, in the loop's order, no cursor moves."""
    tq = make_tq()
    tq.create_partition("p", 8, SCHEMA, group_size=2, retire_after=["trainer"])
    put_rows(tq, "p", ["a", "b"], response_ids=[np.arange(3), np.arange(5)],
             reward=np.asarray([0.5, 1.0], np.float32))
    fields = tq.read("p", ["b", "a"], ["response_ids", "reward"])
    assert [r.tolist() for r in fields["response_ids"]] == [[0, 1, 2, 3, 4], [0, 1, 2]]
    assert fields["reward"].tolist() == [1.0, 0.5]
    batch = tq.get("p", ["reward"], "trainer", 2, timeout_s=1)  # reading leased nothing
    assert batch.sample_ids == ["a", "b"]
    assert tq.read("p", ["a"], ["reward"])["reward"].tolist() == [0.5]  # leased rows stay readable
    tq.ack(batch.lease_id)
    with pytest.raises(DataError, match=r"2 of 2 rows are not live \(2 retired, 0 never put\)"):
        tq.read("p", ["a", "b"], ["reward"])


@pytest.mark.parametrize("ids, fields, message", [
    (["a", "zz"], ["reward"], r"1 of 2 rows are not live \(0 retired, 1 never put\), e.g. \['zz'\]"),
    (["a", "a"], ["reward"], r"sample_ids repeat \['a'\]"),
    ([], ["reward"], "no sample_ids given"),
    (["a"], ["logprobs"], r"rows \['a'\] have no field 'logprobs' yet"),
    (["a"], ["nope"], r"unknown field\(s\) \['nope'\]"),
    ("a", ["reward"], "is not a sequence of ids"),
])
def test_read_refuses_bad_ids_and_fields_by_name(ids, fields, message):
    tq = make_tq()
    tq.create_partition("p", 8, SCHEMA)
    put_rows(tq, "p", ["a"], reward=np.asarray([0.5], np.float32))
    with pytest.raises(DataError, match=message):
        tq.read("p", ids, fields)


def test_ids_sampler_leases_exactly_the_named_rows_once_all_are_ready():
    from relax_agent.data import IdsSampler

    tq = make_tq()
    tq.create_partition("p", 8, SCHEMA, retire_after=["keeper"])
    put_rows(tq, "p", ["a", "b", "c"], reward=np.asarray([0.0, 1.0, 2.0], np.float32))
    with pytest.raises(QueueTimeoutError):  # "d" is not there: waits
        tq.get("p", ["reward"], "keeper", 2, timeout_s=0.05, sampler=IdsSampler(("c", "d")))
    batch = tq.get("p", ["reward"], "keeper", 2, timeout_s=1, sampler=IdsSampler(("c", "a")))
    assert batch.sample_ids == ["c", "a"] and batch.fields["reward"].tolist() == [2.0, 0.0]
    tq.ack(batch.lease_id)
    assert tq.stats("p")["rows"] == 1  # c and a retired, b stays
    with pytest.raises(DataError, match="names 1 rows but batch_size=2"):
        tq.get("p", ["reward"], "keeper", 2, timeout_s=1, sampler=IdsSampler(("b",)))
