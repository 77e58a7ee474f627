"""Media survive the data bus: a trajectory's MediaInputs (pixel patches, grids, audio features)
put through the local and the Ray TransferQueue come back equal, and collate into a batch
whose rows keep their own media."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from relax_agent import records as R
from relax_agent.data import DataConfig, build_transfer_queue
from relax_agent.multimodal.parts import audio_part, image_part, video_part
from relax_agent.multimodal.processor import MediaFamily, MediaProcessor
from relax_agent.records import MediaInputs, Trajectory, Turn, rollout_schema, trajectory_fields
from relax_agent.train.collate import collate_fields

FAMILY = MediaFamily("qwen2_5_omni_thinker", {"image": 100, "video": 101, "audio": 102}, num_mel_bins=128)


def _media(seed: int) -> MediaInputs:
    rng = np.random.default_rng(seed)
    proc = MediaProcessor(FAMILY)
    frames = [rng.integers(0, 255, (40, 40, 3), dtype=np.uint8) for _ in range(3)]
    parts = [image_part(rng.integers(0, 255, (56, 70, 3), dtype=np.uint8)), audio_part(rng.uniform(-1, 1, 8000)),
             video_part(frames)]
    return MediaInputs.concat([proc.process(p) for p in parts])


def _traj(i: int, media: MediaInputs) -> Trajectory:
    media_ids = [FAMILY.token_ids[k] for k, n in zip(media.kinds, media.num_tokens, strict=True) for _ in range(n)]
    prompt = [1, *media_ids, 2]
    tokens = (*prompt, 7, 8)
    return Trajectory(f"g/{i}", "g", "t", tokens, (0,) * len(prompt) + (1, 1), (0.0,) * len(prompt) + (-0.5, -0.7),
                      len(prompt), (Turn(len(prompt), (7, 8), (-0.5, -0.7), 0, "stop"),), reward=float(i),
                      media=media)


def _equal(a: MediaInputs, b: MediaInputs) -> bool:
    return (a.kinds == b.kinds and a.num_tokens == b.num_tokens and sorted(a.arrays) == sorted(b.arrays)
            and all(a.arrays[k].dtype == b.arrays[k].dtype and np.array_equal(a.arrays[k], b.arrays[k]) for k in a.arrays))


def _roundtrip(bus, put) -> None:
    media = [_media(0), _media(1)]
    trajs = [_traj(i, m) for i, m in enumerate(media)]
    bus.create_partition("p", capacity_rows=2, schema=rollout_schema())
    put(bus, [t.sample_id for t in trajs], trajectory_fields(trajs))
    bus.put("p", [t.sample_id for t in trajs], {R.ADVANTAGE: np.asarray([1.0, -1.0], np.float32)})
    batch = bus.get("p", list(R.TRAIN_FIELDS), consumer="trainer", batch_size=2, timeout_s=60)
    got = dict(zip(batch.sample_ids, batch.fields[R.MEDIA], strict=True))
    for t, m in zip(trajs, media, strict=True):
        assert _equal(got[t.sample_id], m)
    train = collate_fields(batch.fields, pad_token_id=0)
    order = [batch.sample_ids.index(t.sample_id) for t in trajs]
    assert all(_equal(train.media[j], m) for j, m in zip(order, media, strict=True))
    assert bus.ack(batch.lease_id)


def _local_put(bus, ids, fields):
    bus.put("p", ids, fields, group_ids=["g"] * len(ids), versions=[0] * len(ids))


def test_media_survive_the_local_bus():
    bus = build_transfer_queue(DataConfig(backend="local"))
    _roundtrip(bus, _local_put)
    bus.close()


@pytest.mark.slow
def test_media_survive_the_ray_bus():
    ray = pytest.importorskip("ray")

    @ray.remote(num_cpus=0)
    class Producer:
        def put(self, bus, ids, fields):
            bus.put("p", ids, fields, group_ids=["g"] * len(ids), versions=[0] * len(ids))

    from relax_agent.data.ray import LOCAL_RAY_SYSTEM_CONFIG

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    try:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        bus = build_transfer_queue(DataConfig(backend="ray", ray_inline_max_bytes=256))
        producer = Producer.remote()
        _roundtrip(bus, lambda b, ids, fields: ray.get(producer.put.remote(b, ids, fields)))
        bus.close()
    finally:
        ray.shutdown()
