"""runtime.autoscale: the decision from the trainer's idle time, its bounds and cooldown, the config checks,
and the loop's step hook that carries it (with a fake supervisor; the Ray run is in tests/e2e)."""

from __future__ import annotations

import logging

import pytest

from relax_agent import metrics as M
from relax_agent.config import AutoscaleConfig, load_config
from relax_agent.errors import ConfigError
from relax_agent.preflight import check_mode
from relax_agent.runtime.autoscale import AUTOSCALE, IDLE_FRACTION, Autoscaler


class FakeSupervisor:
    """The supervisor's scaling surface: a target, a cluster bound and the scale calls made."""

    def __init__(self, target: int = 1, bound: int = 8) -> None:
        self.target, self.bound, self.calls = target, bound, []

    def scale(self, replicas: int) -> dict:
        assert 1 <= replicas <= self.bound
        self.calls.append(replicas)
        self.target = replicas
        return {}

    def max_replicas(self) -> tuple[int, str]:
        return self.bound, f"the cluster holds {self.bound}"


def row(idle: float, step_s: float = 10.0) -> dict:
    return {M.STEP_TIME: step_s, M.DATA_WAIT: idle * step_s}


def run(scaler: Autoscaler, idles: list[float]) -> list[dict]:
    return [scaler.observe(row(i)) for i in idles]


def cfg(**kw) -> AutoscaleConfig:
    return AutoscaleConfig(enabled=True, **kw)


def test_a_starved_trainer_gets_one_replica_per_full_window_after_the_first_step_and_a_cooldown():
    sup = FakeSupervisor(target=1)
    scaler = Autoscaler(cfg(window_steps=2, cooldown_steps=1), sup, max_rollout_replicas=64)
    out = run(scaler, [0.9, 0.6, 0.5, 0.7, 0.8, 0.6, 0.5])
    # step 1 is the start (not counted); steps 2+3 fill the window (mean 0.55 > 0.25) -> 2 replicas;
    # step 4 is the cooldown; steps 5+6 -> 3 replicas; step 7 is the cooldown again
    assert [o[AUTOSCALE] for o in out] == [0, 0, 1, 0, 0, 1, 0]
    assert sup.calls == [2, 3]
    assert out[2][IDLE_FRACTION] == pytest.approx(0.55) and out[5][IDLE_FRACTION] == pytest.approx(0.7)
    assert IDLE_FRACTION not in out[0] and IDLE_FRACTION not in out[3]


def test_a_busy_trainer_drains_replicas_down_to_the_minimum_and_no_further():
    sup = FakeSupervisor(target=4)
    scaler = Autoscaler(cfg(min_replicas=3, window_steps=1, cooldown_steps=0), sup, max_rollout_replicas=64)
    out = run(scaler, [0.5, 0.0, 0.01, 0.0, 0.0])
    assert sup.calls == [3]  # one drained, then held at min_replicas
    assert [o[AUTOSCALE] for o in out] == [0, -1, 0, 0, 0]


def test_idle_times_between_the_thresholds_change_nothing():
    sup = FakeSupervisor(target=2)
    scaler = Autoscaler(cfg(window_steps=2, cooldown_steps=0), sup, max_rollout_replicas=64)
    run(scaler, [0.9, 0.1, 0.2, 0.05, 0.24, 0.03])
    assert sup.calls == []


def test_the_window_mean_decides_not_one_step():
    sup = FakeSupervisor(target=1)
    scaler = Autoscaler(cfg(window_steps=3, cooldown_steps=0), sup, max_rollout_replicas=64)
    run(scaler, [1.0, 0.9, 0.0, 0.0])  # window (0.9, 0, 0): mean 0.3 > 0.25
    assert sup.calls == [2]
    sup2 = FakeSupervisor(target=1)
    run(Autoscaler(cfg(window_steps=3, cooldown_steps=0), sup2, 64), [1.0, 0.6, 0.0, 0.0])  # mean 0.2
    assert sup2.calls == []


def test_growth_stops_at_max_replicas_and_at_the_clusters_bound_which_it_names(caplog):
    sup = FakeSupervisor(target=1, bound=8)
    run(Autoscaler(cfg(max_replicas=2, window_steps=1, cooldown_steps=0), sup, 64), [1.0] * 6)
    assert sup.calls == [2]
    sup = FakeSupervisor(target=1, bound=2)
    with caplog.at_level(logging.INFO, logger="relax_agent.runtime"):
        run(Autoscaler(cfg(window_steps=1, cooldown_steps=0), sup, max_rollout_replicas=64), [1.0] * 6)
    assert sup.calls == [2]
    assert "rollout replicas 1 -> 2 (the bound: the cluster holds 2)" in caplog.text, caplog.text
    sup = FakeSupervisor(target=1, bound=8)
    run(Autoscaler(cfg(window_steps=1, cooldown_steps=0), sup, max_rollout_replicas=3), [1.0] * 6)
    assert sup.calls == [2, 3]  # runtime.max_rollout_replicas when autoscale.max_replicas is unset


def test_a_shrunken_cluster_brings_the_target_down_to_its_bound():
    sup = FakeSupervisor(target=4, bound=8)
    scaler = Autoscaler(cfg(window_steps=1, cooldown_steps=0), sup, max_rollout_replicas=64)
    run(scaler, [0.5, 0.1])
    sup.bound = 2  # a host left
    run(scaler, [0.1])
    assert sup.calls == [2]


def test_a_target_set_by_hand_is_where_the_autoscaler_goes_on_from():
    sup = FakeSupervisor(target=1)
    scaler = Autoscaler(cfg(window_steps=1, cooldown_steps=0), sup, max_rollout_replicas=64)
    run(scaler, [0.5, 0.1])
    sup.target = 5  # relax-agent scale --rollout 5
    run(scaler, [0.9])
    assert sup.calls == [6]


def test_a_row_without_step_time_is_not_judged():
    assert Autoscaler.idle_fraction({M.DATA_WAIT: 1.0}) is None
    assert Autoscaler.idle_fraction(row(0.4)) == pytest.approx(0.4)
    assert Autoscaler.idle_fraction({M.STEP_TIME: 1.0, M.DATA_WAIT: 3.0}) == 1.0  # clock skew clipped
    sup = FakeSupervisor()
    scaler = Autoscaler(cfg(window_steps=1, cooldown_steps=0), sup, 64)
    assert [scaler.observe(r) for r in ({}, {}, {M.STEP_TIME: 0.0})] == [{AUTOSCALE: 0.0}] * 3
    assert sup.calls == []


def test_config_refuses_inverted_thresholds_and_bounds_naming_the_keys():
    with pytest.raises(ConfigError, match=r"runtime.autoscale.scale_down_below=0.3 is not below "
                                          r"runtime.autoscale.scale_up_above=0.25"):
        load_config(None, ["runtime.autoscale.scale_down_below=0.3"])
    with pytest.raises(ConfigError, match=r"runtime.autoscale.min_replicas=3 is more than runtime.autoscale.max_replicas=2"):
        load_config(None, ["runtime.autoscale.min_replicas=3", "runtime.autoscale.max_replicas=2"])
    with pytest.raises(ConfigError, match="scale_up_above"):
        load_config(None, ["runtime.autoscale.scale_up_above=1.5"])


def test_autoscale_without_the_ray_runtime_is_refused_before_any_model_loads():
    cfg_ = load_config(None, ["runtime.autoscale.enabled=true"])
    with pytest.raises(ConfigError, match=r"runtime.autoscale.enabled=true with runtime.kind='local'.*set runtime.kind=ray"):
        check_mode(cfg_, "cpu")
