"""Refused versions: refused once, withdrawn (never the latest), publishable again; bad versions and publish after close."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch

from relax_agent.errors import WeightRefusedError, WeightSyncError
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


@pytest.fixture(params=["inproc", "tcp"])
def transport(request) -> str:
    return request.param


def test_publish_after_close_is_refused_naming_the_version(transport):
    engine = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport=transport), [engine])
    sync.publish(make_state(1), 1)
    sync.close()
    with pytest.raises(WeightSyncError, match=r"publish\(version=20\).*closed"):
        sync.publish(make_state(2), 20)
    assert engine.policy_version == 1


def test_a_refused_version_never_becomes_latest_and_can_be_published_again(transport):
    fp32, bf16 = TensorEngine(make_state(0)), TensorEngine(make_state(0), dtype=torch.bfloat16)
    sync = build_weight_sync(WeightSyncConfig(transport=transport, poll_timeout_s=5.0), [fp32, bf16])
    bad = make_state(2)
    bad.pop("norm.weight")
    try:
        sync.publish(make_state(1), 1)
        with pytest.raises(WeightSyncError, match="not published: norm.weight"):
            sync.publish(bad, 2)
        assert sync.latest_version == 1 and (fp32.policy_version, bf16.policy_version) == (1, 1)
        late = TensorEngine(make_state(0))
        sync.attach(late, name="late")  # pulls version 1, never the refused 2
        assert late.policy_version == 1 and torch.equal(late.snapshot()[1]["norm.weight"], make_state(1)["norm.weight"])
        stats = sync.publish(make_state(2), 2)  # the corrected state dict under the same number
        assert stats.subscribers == 3 and sync.latest_version == 2
        assert (fp32.policy_version, bf16.policy_version, late.policy_version) == (2, 2, 2)
        assert torch.equal(fp32.snapshot()[1]["norm.weight"], make_state(2)["norm.weight"])
    finally:
        sync.close()


class FailsOnce(TensorEngine):
    """Refuses its first load (as an engine whose load fails), then loads normally."""

    failed = False

    def load_weights(self, tensors, version):
        if not self.failed:
            self.failed = True
            raise RuntimeError("engine busy")
        return super().load_weights(tensors, version)


def test_a_version_one_engine_applied_and_another_refused_is_withdrawn_but_not_reused():
    ok, flaky = TensorEngine(make_state(0)), FailsOnce(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", poll_timeout_s=5.0), [ok])
    try:
        sync.attach(flaky, name="flaky")
        with pytest.raises(WeightSyncError, match="engine busy"):
            sync.publish(make_state(1), 1)
        assert sync.latest_version == -1 and ok.policy_version == 1 and flaky.policy_version == 0
        with pytest.raises(WeightSyncError, match="not newer than the latest version 1"):
            sync.publish(make_state(1), 1)
        sync.publish(make_state(2), 2)
        assert (ok.policy_version, flaky.policy_version, sync.latest_version) == (2, 2, 2)
    finally:
        sync.close()


@pytest.mark.parametrize("bad", [10.5, "abc", None, -1, True, np.float64(3.0)])
def test_a_version_that_is_not_a_non_negative_int_is_refused_by_value(transport, bad):
    engine = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport=transport), [engine])
    try:
        with pytest.raises(WeightSyncError, match=re.escape(f"publish(version={bad!r})")):
            sync.publish(make_state(1), bad)
        assert sync.latest_version == -1 and engine.policy_version == 0
        sync.publish(make_state(1), np.int64(4))
        assert type(sync.latest_version) is int and sync.latest_version == 4 and engine.policy_version == 4
    finally:
        sync.close()


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_non_finite_weights_are_not_published(transport):
    engine = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport=transport, poll_timeout_s=5.0), [engine])
    bad = make_state(1)
    bad["norm.weight"][2] = float("nan")
    bad["embed.weight"][0, 0] = float("inf")
    try:
        with pytest.raises(WeightSyncError, match=r"2 tensor\(s\) hold NaN or inf \(embed.weight, norm.weight\)"):
            sync.publish(bad, 1)
        assert engine.policy_version == 0 and sync.latest_version == -1  # nothing was ever published
        assert torch.equal(engine.snapshot()[1]["norm.weight"], make_state(0)["norm.weight"])
        sync.publish(make_state(2), 1)  # the number was never used: a good state dict takes it
        assert engine.policy_version == 1
    finally:
        sync.close()


def test_check_finite_off_publishes_non_finite_weights():
    engine = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport="inproc", check_finite=False), [engine])
    bad = make_state(1)
    bad["norm.weight"][0] = float("nan")
    try:
        sync.publish(bad, 1)
        assert engine.policy_version == 1 and torch.isnan(engine.snapshot()[1]["norm.weight"][0])
    finally:
        sync.close()


class FailsLoads(TensorEngine):
    """Fails its next ``failures`` loads (a transient fault: memory, a kernel, a disk), then loads."""

    def __init__(self, state_dict, failures: int):
        super().__init__(state_dict)
        self.failures, self.loads = failures, 0

    def load_weights(self, state_dict, version, *args, **kwargs):
        self.loads += 1
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError(f"transient load failure of version {version}")
        return super().load_weights(state_dict, version, *args, **kwargs)


def test_a_refused_version_is_published_again_and_applied_when_the_fault_passes(transport, caplog):
    engine = FailsLoads(make_state(0), failures=1)
    sync = build_weight_sync(WeightSyncConfig(transport=transport, poll_timeout_s=5.0), [engine])
    try:
        with caplog.at_level(logging.WARNING, logger="relax_agent.weights"):
            stats = sync.publish(make_state(1), 1)
        assert engine.loads == 2 and engine.policy_version == 1 and stats.retries == 1
        assert stats.as_metrics()["weights/publish_retries"] == 1.0
        assert torch.equal(engine.snapshot()[1]["norm.weight"], make_state(1)["norm.weight"])
        assert any("publishing it again" in r.getMessage() for r in caplog.records)
        assert sync.publish(make_state(2), 2).retries == 0
    finally:
        sync.close()


def test_a_refusal_that_outlasts_the_retries_ends_the_publish_and_the_engine_keeps_its_version(transport):
    engine = FailsLoads(make_state(0), failures=10)
    sync = build_weight_sync(WeightSyncConfig(transport=transport, poll_timeout_s=5.0, publish_retries=2), [engine])
    try:
        with pytest.raises(WeightRefusedError, match="transient load failure of version 1") as err:
            sync.publish(make_state(1), 1)
        assert err.value.retryable and engine.loads == 3 and engine.policy_version == 0
    finally:
        sync.close()


def test_weights_that_do_not_fit_are_refused_once_without_retries():
    engine = TensorEngine(make_state(0))
    sync = build_weight_sync(WeightSyncConfig(transport="tcp", poll_timeout_s=5.0, publish_retries=3), [engine])
    (sub,) = sync.subscribers
    bad = make_state(1)
    bad["norm.weight"] = torch.zeros(5)
    try:
        with pytest.raises(WeightRefusedError, match="do not fit") as err:
            sync.publish(bad, 1)
        assert not err.value.retryable and sub.refused_version == 1 and engine.policy_version == 0
    finally:
        sync.close()
