"""Flat layout, zero-copy sources, checksums, layout diffs and the coordinator (in-process and HTTP)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from relax_agent.errors import WeightSyncError
from relax_agent.weights.coordinator import ApplyReport, Coordinator
from relax_agent.weights.meta import (
    ALIGN_BYTES,
    FlatSource,
    VersionMeta,
    bucket_checksums,
    flat_views,
    format_diff,
    layout_diff,
    plan_layout,
    snapshot_into,
    snapshot_with_checksums,
)
from relax_agent.weights.service import HttpCoordinator, serve_coordinator
from relax_agent.weights.subscriber import map_names


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(7, 5, generator=g)
    return {"emb": emb, "norm": torch.randn(3, generator=g).to(torch.bfloat16),
            "steps": torch.tensor(12345678901, dtype=torch.int64), "mask": torch.tensor([True, False, True]),
            "head": emb, "half": torch.randn(2, 3, generator=g).half()}


def test_layout_aligns_offsets_and_aliases_tied_tensors():
    tensors, total = plan_layout(mixed_state())
    by_name = {t.name: t for t in tensors}
    assert by_name["head"].alias_of == "emb" and by_name["head"].offset == by_name["emb"].offset
    assert all(t.offset % ALIGN_BYTES == 0 for t in tensors)
    sent = [t for t in tensors if t.alias_of is None]
    assert total == sum(-(-t.nbytes // ALIGN_BYTES) * ALIGN_BYTES for t in sent)
    assert by_name["norm"].dtype == "bfloat16" and by_name["steps"].shape == ()


def test_snapshot_and_views_round_trip_every_dtype_exactly():
    state = mixed_state()
    tensors, total = plan_layout(state)
    buffer = torch.full((total,), 0xAB, dtype=torch.uint8)
    snapshot_into(buffer, state, tensors)
    views = flat_views(buffer, tensors)
    assert views.keys() == state.keys()
    for name, value in state.items():
        assert views[name].dtype == value.dtype and torch.equal(views[name], value), name


def test_zero_copy_source_yields_the_snapshot_bytes_for_any_range():
    state = mixed_state()
    tensors, total = plan_layout(state)
    buffer = torch.zeros(total, dtype=torch.uint8)
    snapshot_into(buffer, state, tensors)
    snap, direct = FlatSource(tensors, total, buffer=buffer), FlatSource(tensors, total, state_dict=state)
    for start, end in [(0, total), (0, 1), (5, 70), (63, 200), (total - 3, total)]:
        got = b"".join(bytes(s) for s in direct.segments(start, end))
        assert got == b"".join(bytes(s) for s in snap.segments(start, end)) and len(got) == end - start
    for algo in ("xxh3", "crc32"):
        assert bucket_checksums(direct, 128, algo) == bucket_checksums(snap, 128, algo)
        assert len(bucket_checksums(snap, 128, algo)) == -(-total // 128)
    assert bucket_checksums(snap, 128, "none") == ()


@pytest.mark.parametrize("bucket_bytes", [64, 128, 4096])
def test_overlapped_snapshot_checksums_equal_the_plain_ones(bucket_bytes):
    state = mixed_state()
    tensors, total = plan_layout(state)
    buffer = torch.zeros(total, dtype=torch.uint8)
    checks = snapshot_with_checksums(buffer, state, tensors, bucket_bytes, "xxh3")
    assert checks == bucket_checksums(FlatSource(tensors, total, state_dict=state), bucket_bytes, "xxh3")
    assert all(torch.equal(v, state[k]) for k, v in flat_views(buffer, tensors).items())


def test_checksum_changes_with_one_flipped_bit():
    state = {"w": torch.arange(64, dtype=torch.float32)}
    tensors, total = plan_layout(state)
    before = bucket_checksums(FlatSource(tensors, total, state_dict=state), 64, "xxh3")
    state["w"].view(torch.int32)[17] ^= 1
    after = bucket_checksums(FlatSource(tensors, total, state_dict=state), 64, "xxh3")
    assert [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b] == [1]


def test_no_snapshot_source_refuses_non_contiguous_tensors():
    state = {"w": torch.randn(4, 4).t()}
    tensors, total = plan_layout(state)
    with pytest.raises(WeightSyncError, match="snapshot=true"):
        FlatSource(tensors, total, state_dict=state)


def test_layout_diff_lists_names_shapes_and_dtypes_but_allows_float_casts():
    f32, bf16, i64 = torch.float32, torch.bfloat16, torch.int64
    published = {"a": ((2, 3), f32), "b": ((4,), f32), "c": ((1,), i64), "gone": ((1,), f32)}
    engine = {"a": ((2, 3), bf16), "b": ((5,), f32), "c": ((1,), f32), "new": ((1,), f32)}
    diff = layout_diff(published, engine)
    assert diff == ["missing in the engine: gone", "not published: new", "shape of b: published (4,), engine (5,)",
                    "dtype of c: published int64, engine float32"]
    assert layout_diff({"a": ((2,), f32)}, {"a": ((2,), torch.float16)}) == []
    assert format_diff([f"d{i}" for i in range(25)], limit=2) == "25 differences:\n  d0\n  d1\n  ... and 23 more"


def test_name_maps_rename_and_drop():
    assert map_names(["x", "y"], {"x": "model.x"}) == {"x": "model.x", "y": "y"}
    assert map_names(["x", "y"], lambda n: None if n == "y" else "m." + n) == {"x": "m.x"}
    assert map_names(["x"], None) == {"x": "x"}


def meta(version: int) -> VersionMeta:
    tensors, total = plan_layout({"w": torch.zeros(3)})
    return VersionMeta(version, tensors, total, 64, "xxh3", (2**64 - 1,), "tcp", "127.0.0.1:1")


def test_meta_json_round_trip():
    m = meta(3)
    assert VersionMeta.from_json(m.to_json()) == m


def test_coordinator_long_poll_wakes_on_commit_and_times_out():
    coord = Coordinator()
    assert coord.wait_for_version(None, 0.01) is None
    threading.Timer(0.05, coord.commit, args=(meta(1),)).start()
    assert coord.wait_for_version(None, 5.0).version == 1
    assert coord.wait_for_version(1, 0.01) is None
    assert coord.wait_for_version(0, 0.01).version == 1
    with pytest.raises(WeightSyncError, match="not newer"):
        coord.commit(meta(1))


def test_coordinator_long_poll_ends_when_its_subscriber_leaves():
    coord = Coordinator()
    sub = coord.register_subscriber("e")
    threading.Timer(0.05, coord.unregister_subscriber, args=(sub,)).start()
    start = time.monotonic()
    assert coord.wait_for_version(None, 10.0, sub) is None
    assert time.monotonic() - start < 5.0


def test_wait_applied_collects_reports_and_names_the_missing():
    coord = Coordinator()
    a, b = coord.register_subscriber("a"), coord.register_subscriber("b")
    coord.commit(meta(1))
    coord.report(ApplyReport(a, 1, None, {"pause_s": 0.1}))
    with pytest.raises(WeightSyncError, match=rf"\['b.{coord.epoch}.1'\] did not report"):
        coord.wait_applied(1, [a, b], 0.05)
    coord.report(ApplyReport(b, 1, "refused"))
    reports = coord.wait_applied(1, [a, b], 1.0)
    assert reports[a].stats == {"pause_s": 0.1} and reports[b].error == "refused"
    coord.unregister_subscriber(b)  # its last report still answers a publish waiting for it
    assert list(coord.wait_applied(1, [a, b], 1.0)) == [a, b]
    c = coord.register_subscriber("c")
    coord.unregister_subscriber(c)  # left without reporting: neither applied nor missing
    assert list(coord.wait_applied(1, [a, c], 1.0)) == [a]


def test_http_coordinator_speaks_the_same_protocol():
    coord = Coordinator()
    publisher = coord.register_publisher(None)
    service = serve_coordinator(coord, "127.0.0.1", 0, publisher_token=publisher)
    client = HttpCoordinator(service.url, token=service.token, publisher_token=publisher)
    try:
        sub = client.register_subscriber("remote")
        assert client.latest() is None and client.wait_for_version(None, 0.05, sub) is None
        threading.Timer(0.1, coord.commit, args=(meta(4),)).start()
        stamped = dataclasses.replace(meta(4), commit=1, epoch=coord.epoch)
        assert client.wait_for_version(None, 5.0, sub) == stamped
        client.report(ApplyReport(sub, 4, None, {"receive_s": 0.5}))
        assert coord.wait_applied(4, [sub], 1.0)[sub].stats == {"receive_s": 0.5}
        with pytest.raises(WeightSyncError, match="409"):
            client.commit(meta(4))
        client.commit(meta(5))
        assert client.latest().version == 5 and client.status()["subscribers"] == [sub]
        client.unregister_subscriber(sub)
        assert coord.subscribers() == []
    finally:
        client.close()
        service.close()
    with pytest.raises(WeightSyncError, match="ConnectError"):
        HttpCoordinator(service.url, timeout_s=1.0).latest()
