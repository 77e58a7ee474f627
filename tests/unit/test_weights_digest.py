"""Weight digests (weights.verify): what they tell apart, the vLLM server's copy of the algorithm,
and a verified load into the weights-only engine over the tcp transport."""

from __future__ import annotations

import pytest
import torch

from relax_agent.errors import WeightSyncError
from relax_agent.rollout.engines import vllm_server
from relax_agent.weights import TensorEngine, WeightSyncConfig, build_weight_sync
from relax_agent.weights.digest import TensorDigest, compare, expected_digests, sample_index, tensor_digest


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(300, 64, generator=g), "norm": torch.randn(64, generator=g),
            "proj": torch.randn(96, 64, generator=g)}


def test_sample_covers_small_tensors_in_full_and_large_ones_in_evenly_spaced_blocks_and_the_tail():
    assert sample_index(100, 4096).tolist() == list(range(100))
    got = sample_index(1000, 64).tolist()  # 4 blocks of 16, 250 apart, then the last 16
    assert got == [s + i for s in (0, 250, 500, 750) for i in range(16)] + list(range(984, 1000))


def test_digest_of_a_cast_equals_the_digest_the_engine_computes_on_its_copy():
    sent = weights()["embed"]
    held = torch.empty(300, 64, dtype=torch.bfloat16)
    held.copy_(sent)  # what an engine's load does
    assert tensor_digest(sent, torch.bfloat16) == tensor_digest(held)
    assert tensor_digest(sent, torch.bfloat16) != tensor_digest(sent)  # the dtype is part of it
    assert tensor_digest(sent).dtype == "float32" and tensor_digest(held).shape == (300, 64)


@pytest.mark.parametrize("change,found", [
    (lambda t: t.add(1e-3), True),                          # not reloaded / another version
    (lambda t: t.t().contiguous().reshape(300, 64), True),  # wrong layout, same shape
    (lambda t: t[:, :32], True),                            # another shape
    (lambda t: t.index_fill(0, torch.arange(100, 200), 0.0), True),  # a third of the rows lost
    (lambda t: torch.cat([t.reshape(-1)[:-3], torch.zeros(3)]).reshape(300, 64), True),  # a truncated tail
    (lambda t: t.index_put((torch.tensor([0]), torch.tensor([20])), torch.tensor(9.0)), False),  # one unsampled element
])
def test_digest_finds_whole_and_partial_corruption_but_not_one_unsampled_element(change, found):
    sent = weights()["embed"]
    assert (tensor_digest(change(sent.clone()), samples=64) != tensor_digest(sent, samples=64)) is found


def test_compare_names_each_tensor_that_differs_and_what_differs():
    sent = weights()
    expected = expected_digests(sent, None, samples=128)
    held = dict(sent, proj=sent["proj"] + 1, norm=sent["norm"][:32])
    actual = {n: tensor_digest(t, samples=128) for n, t in held.items() if n != "embed"}
    lines = compare(expected, actual)
    assert [line.split(":")[0] for line in lines] == ["embed", "norm", "proj"]
    assert "no such tensor" in lines[0] and "shape (32,)" in lines[1] and "values differ" in lines[2]
    assert compare(expected, {n: tensor_digest(t, samples=128) for n, t in sent.items()}) == []


def test_expected_digests_cast_floating_tensors_to_the_engine_layout_only():
    sent = {"w": torch.randn(8), "ids": torch.arange(8)}
    layout = {"w": ((8,), torch.float16), "ids": ((8,), torch.float16)}
    got = expected_digests(sent, layout)
    assert got["w"].dtype == "float16" and got["ids"].dtype == "int64"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 7, 2048, 2049, 100_003])
def test_the_vllm_servers_digest_is_the_same_algorithm(dtype, numel):
    t = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    assert TensorDigest.from_json(vllm_server.tensor_digest(t, 2048)) == tensor_digest(t)
    assert vllm_server.tensor_digest(t, 2048) == tensor_digest(t).to_json()
    assert vllm_server.tensor_digest(t, 64) == tensor_digest(t, samples=64).to_json()


def test_vllm_server_verification_names_the_tensor_and_version():
    sent = weights()
    expected = {n: tensor_digest(t).to_json() for n, t in sent.items()}
    read = [(n, t + 1 if n == "proj" else t) for n, t in sent.items()]
    with pytest.raises(vllm_server.VerificationError, match=r"version 7: 1 tensor\(s\).*proj: the server read"):
        vllm_server.verify_tensors(read, expected, 7)
    vllm_server.verify_tensors(list(sent.items()), expected, 7)


def test_tcp_publish_into_a_bf16_engine_verifies_and_a_corrupting_load_keeps_the_previous_version():
    engine = TensorEngine(weights(0), dtype=torch.bfloat16)
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", bucket_mb=0.01), [engine])
    try:
        stats = sync.publish(weights(1), 1)
        assert engine.policy_version == 1 and stats.verify_s > 0
        copy = engine._copy

        def copy_then_corrupt(state_dict):
            copy(state_dict)
            engine.tensors["norm"][0] += 1.0

        engine._copy = copy_then_corrupt
        with pytest.raises(WeightSyncError, match=r"version 2(.|\n)*norm: the engine's values differ"):
            sync.publish(weights(2), 2)
        version, held = engine.snapshot()
        assert version == 1
        assert all(torch.equal(held[n], t.to(torch.bfloat16)) for n, t in weights(1).items())
    finally:
        sync.close()


def test_tensors_corrupted_in_transit_are_refused_before_the_engine_loads_them():
    """Over tcp without bucket checksums the publisher's digests in the version's metadata still
    catch bytes that changed on the way; the engine is not touched."""
    engine = TensorEngine(weights(0))
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", checksum="none"), [engine])
    try:
        sync.publish(weights(1), 1)
        assert sync.coordinator.latest().digests.keys() == weights(1).keys()
        receiver = sync.subscribers[0]._receiver
        receive = receiver.receive

        def receive_then_corrupt(meta):
            tensors, stats = receive(meta)
            tensors["embed"][150, 0] += 1.0  # inside the sampled block that starts at element 9600
            return tensors, stats

        receiver.receive = receive_then_corrupt
        loads = engine.stats.weight_loads
        with pytest.raises(WeightSyncError, match=r"version 2: what it received differs(.|\n)*embed: "):
            sync.publish(weights(2), 2)
        version, held = engine.snapshot()
        assert version == 1 and engine.stats.weight_loads == loads and torch.equal(held["embed"], weights(1)["embed"])
    finally:
        sync.close()


def test_malformed_digests_in_version_metadata_are_refused():
    from relax_agent.weights.meta import VersionMeta

    meta = VersionMeta(1, (), 0, 64, "none").to_json()
    assert VersionMeta.from_json({**meta, "digests": {"w": [[2], "float32", "00", 16]}}).digests["w"][1] == "float32"
    with pytest.raises(WeightSyncError, match="digests must map"):
        VersionMeta.from_json({**meta, "digests": {"w": "abc"}})


def test_a_load_whose_expected_digests_cannot_be_computed_is_refused_not_served_unverified():
    import concurrent.futures

    engine = TensorEngine(weights(0))
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(RuntimeError("boom"))
    with pytest.raises(WeightSyncError, match=r"version 1 .*could not be computed: RuntimeError: boom"):
        engine.load_weights(weights(1), 1, expected_digests=failed)
    version, held = engine.snapshot()
    assert version == 0 and torch.equal(held["proj"], weights(0)["proj"])
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(expected_digests(weights(1), engine.weight_layout()))
    engine.load_weights(weights(1), 1, expected_digests=done)
    assert engine.policy_version == 1
