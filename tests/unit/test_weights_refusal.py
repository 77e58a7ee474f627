"""A refused version is refused once: the tcp follower waits for a newer version instead of retrying."""

from __future__ import annotations

import logging

import pytest
import torch

from relax_agent.errors import WeightSyncError
from relax_agent.weights import TensorEngine, WeightSyncConfig, build_weight_sync


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(8, 4, generator=g), "norm.weight": torch.randn(4, generator=g)}


def test_tcp_refuses_a_version_missing_a_parameter_once_then_applies_the_next(caplog):
    engine = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", poll_timeout_s=5.0), [engine])
    (sub,) = sync.subscribers
    bad = make_state(1)
    bad.pop("norm.weight")
    try:
        with caplog.at_level(logging.WARNING, logger="relax_agent.weights"):
            with pytest.raises(WeightSyncError, match="not published: norm.weight"):
                sync.publish(bad, 1)
            assert sub.refused_version == 1 and engine.policy_version == 0
            assert torch.equal(engine.snapshot()[1]["norm.weight"], make_state(0)["norm.weight"])  # still serving v0
            assert sub.sync_latest(timeout_s=0.0) is None  # version 1 is not tried again
            stats = sync.publish(make_state(2), 2)
        refusals = [r for r in caplog.records if "refuses version 1" in r.getMessage()]
        assert len(refusals) == 1
        assert stats.subscribers == 1 and engine.policy_version == 2 and sub.applied_version == 2
        assert torch.equal(engine.snapshot()[1]["norm.weight"], make_state(2)["norm.weight"])
    finally:
        sync.close()
