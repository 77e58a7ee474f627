"""Recorded routes travel through the TransferQueue (local backend) unchanged and collate as recorded."""

from __future__ import annotations

import numpy as np
import pytest

from relax_agent.data import DataConfig, FieldSpec, build_transfer_queue
from relax_agent.errors import DataError
from relax_agent.records import Trajectory, Turn
from relax_agent.train.batch import collate

LAYERS, TOP_K = 3, 2


def routes(n: int, seed: int, dtype=np.uint8, experts: int = 8) -> np.ndarray:
    """[n, layers, top_k] distinct expert ids per (token, layer), like a router's top-k."""
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(experts, TOP_K, replace=False) for _ in range(LAYERS)] for _ in range(n)]).astype(dtype)


def test_uint8_routes_survive_the_data_bus_and_collate():
    tq = build_transfer_queue(DataConfig())
    spec = FieldSpec("uint8", (LAYERS, TOP_K), ragged=True)
    tq.create_partition("step-0", capacity_rows=4, schema={"routed_experts": spec, "token_ids": ("int64", (), True)})
    sent = {f"s{i}": routes(n, i) for i, n in enumerate((5, 17, 1, 9))}
    ids = {sid: np.arange(len(r) + 3) for sid, r in sent.items()}  # 3 prompt tokens before each turn
    tq.put("step-0", list(sent), {"routed_experts": list(sent.values()), "token_ids": list(ids.values())},
           group_ids=["g0", "g0", "g1", "g1"], versions=[2, 2, 2, 2])
    batch = tq.get("step-0", ["routed_experts", "token_ids"], consumer="trainer", batch_size=4)
    got = dict(zip(batch.sample_ids, batch.fields["routed_experts"], strict=True))
    assert set(got) == set(sent)
    for sid, r in sent.items():
        assert got[sid].dtype == np.uint8 and np.array_equal(got[sid], r)
    trajs = []
    for sid, r in got.items():
        n = len(r)
        turn = Turn(3, tuple(range(n)), (-1.0,) * n, 2, "length", r)
        trajs.append(Trajectory(sid, "g", "t", tuple(range(n + 3)), (0, 0, 0) + (1,) * n, (0.0,) * 3 + (-1.0,) * n,
                                3, (turn,), 1.0))
    train = collate(trajs, [1.0] * len(trajs), pad_token_id=0)
    for i, sid in enumerate(batch.sample_ids):
        n = len(sent[sid])
        assert np.array_equal(train.routed_experts[i, 3:3 + n].numpy(), sent[sid])
        assert train.routes_mask[i].sum() == n
    assert tq.ack(batch.lease_id)


def test_int16_routes_survive_and_a_wrong_dtype_is_refused():
    tq = build_transfer_queue(DataConfig())
    tq.create_partition("p", capacity_rows=2, schema={"routed_experts": FieldSpec("int16", (LAYERS, TOP_K), ragged=True)})
    sent = routes(6, 0, np.int16, experts=512)
    tq.put("p", ["a"], {"routed_experts": [sent]}, group_ids=["g"], versions=[0])
    got = tq.get("p", ["routed_experts"], consumer="c", batch_size=1).fields["routed_experts"][0]
    assert got.dtype == np.int16 and np.array_equal(got, sent)
    with pytest.raises(DataError):
        tq.put("p", ["b"], {"routed_experts": [routes(2, 1).astype(np.float32)]}, group_ids=["g"], versions=[0])
