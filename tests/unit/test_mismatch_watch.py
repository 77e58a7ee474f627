"""The alarm on a jump in the rollout-vs-trainer log-prob mismatch."""

from __future__ import annotations

import warnings

import pytest

from relax_agent.control.mismatch_watch import ALARM, MismatchWatch
from relax_agent.progress import format_step
from relax_agent.train.algorithms import MISMATCH_ABS_DIFF_MEAN


def rows(*values):
    return [{MISMATCH_ABS_DIFF_MEAN: v} for v in values]


def test_a_jump_from_the_runs_level_alarms_once_per_step_it_lasts():
    watch = MismatchWatch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flags = [watch.observe(r) for r in rows(2e-6, 3e-6, 2e-6, 0.04, 2e-6)]
    assert flags == [{ALARM: 0.0}] * 3 + [{ALARM: 1.0}, {ALARM: 0.0}]
    assert len(caught) == 1 and "0.04" in str(caught[0].message) and "weight" in str(caught[0].message)


def test_noise_under_the_floor_and_a_steady_bf16_level_do_not_alarm():
    watch = MismatchWatch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(watch.observe(r) == {ALARM: 0.0} for r in rows(2e-6, 5e-5, 8e-4))  # 400x, under 1e-3
        watch = MismatchWatch()
        assert all(watch.observe(r) == {ALARM: 0.0} for r in rows(0.012, 0.015, 0.011, 0.02, 0.013))
    assert watch.observe({"train/loss": 0.1}) == {}  # no update, no mismatch
    assert watch.observe({MISMATCH_ABS_DIFF_MEAN: float("nan")}) == {}


def test_a_step_with_stale_samples_is_not_judged():
    watch = MismatchWatch()
    watch.observe({MISMATCH_ABS_DIFF_MEAN: 2e-6, "async/staleness_max": 0.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the policy moved since the sample was drawn: not the engines' fault
        assert watch.observe({MISMATCH_ABS_DIFF_MEAN: 0.05, "async/staleness_max": 2.0}) == {}
    assert list(watch.history) == [2e-6]


def test_the_level_is_the_recent_median_so_a_slow_drift_is_not_a_jump():
    watch = MismatchWatch(window=3)
    values = [1e-3 * 2 ** k for k in range(10)]  # doubles each step: never 10x the median of the last 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [watch.observe(r)[ALARM] for r in rows(*values)] == [0.0] * 10


@pytest.mark.parametrize("kwargs", [{"jump": 1.0}, {"floor": -1.0}, {"window": 0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="expected jump > 1"):
        MismatchWatch(**kwargs)


def test_the_step_line_names_the_alarm():
    assert "log-prob mismatch jumped" in format_step(3, {"train/loss": 0.1, ALARM: 1.0})
    assert "mismatch" not in format_step(3, {"train/loss": 0.1, ALARM: 0.0})
