"""Routed experts cross processes on the Ray data bus unchanged: a producer actor puts them, the driver gets them."""

from __future__ import annotations

import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from relax_agent.data import DataConfig, FieldSpec, build_transfer_queue  # noqa: E402

pytestmark = pytest.mark.slow


def routes(n: int, seed: int) -> np.ndarray:
    """[n, layers=4, top_k=2] uint8 expert ids."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 16, (n, 4, 2)).astype(np.uint8)


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, bus) -> None:
        self.bus = bus

    def put(self, partition: str, lengths: list[int]) -> None:
        ids = [f"s{i}" for i in range(len(lengths))]
        self.bus.put(partition, ids, {"routed_experts": [routes(n, i) for i, n in enumerate(lengths)]},
                     group_ids=["g"] * len(ids), versions=[1] * len(ids))


def test_routes_survive_the_ray_data_bus():
    from relax_agent.data.ray import LOCAL_RAY_SYSTEM_CONFIG

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    try:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        # Small inline limit: the larger rows travel through the Ray object store.
        bus = build_transfer_queue(DataConfig(backend="ray", ray_inline_max_bytes=256))
        lengths = [3, 300, 41]
        bus.create_partition("r3", capacity_rows=len(lengths),
                             schema={"routed_experts": FieldSpec("uint8", (4, 2), ragged=True)})
        ray.get(Producer.remote(bus).put.remote("r3", lengths))
        batch = bus.get("r3", ["routed_experts"], consumer="trainer", batch_size=len(lengths), timeout_s=60)
        got = dict(zip(batch.sample_ids, batch.fields["routed_experts"], strict=True))
        for i, n in enumerate(lengths):
            assert got[f"s{i}"].dtype == np.uint8 and np.array_equal(got[f"s{i}"], routes(n, i))
        assert bus.ack(batch.lease_id)
        bus.close()
    finally:
        ray.shutdown()
