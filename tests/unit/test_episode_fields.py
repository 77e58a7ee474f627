"""Step metrics and overlong shaping read the rollout's scalar fields from the bus, not the trajectory."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from relax_agent import metrics as M
from relax_agent import records as R
from relax_agent.config import OverlongConfig
from relax_agent.control.advantages import OVERLONG_MASKED, AdvantageConsumer, overlong_field_metrics
from relax_agent.control.reporting import episode_metrics
from relax_agent.data import build_transfer_queue
from relax_agent.records import Trajectory, Turn


def _traj(i: int, replies: list[int], reward: float, stop: str = "terminated", error: str | None = None,
          metrics: dict | None = None, versions: list[tuple[int, ...]] | None = None) -> Trajectory:
    """An episode of ``len(replies)`` turns of the given reply lengths after a 2-token prompt."""
    ids, mask, lps, turns = [5, 6], [0, 0], [0.0, 0.0], []
    for k, n in enumerate(replies):
        tv = versions[k] if versions else ()
        turns.append(Turn(len(ids), (7,) * n, (-0.5,) * n, 0, "length" if stop == "length" else "stop",
                          token_versions=tv))
        ids += [7] * n + [9]
        mask += [1] * n + [0]
        lps += [-0.5] * n + [0.0]
    return Trajectory(f"g/{i}", "g", "t", tuple(ids), tuple(mask), tuple(lps), 2, tuple(turns), reward,
                      metrics=metrics or {}, stop_reason=stop, error=error)


def _episodes() -> list[Trajectory]:
    return [
        _traj(0, [4, 3], 0.75, metrics={"correct": 1.0, "well_formed": 1.0}, versions=[(1, 1, 2, 2), (2, 2, 2)]),
        _traj(1, [16], 0.25, stop="length", metrics={"correct": 0.0, "well_formed": 1.0}),
        _traj(2, [5], 0.0, stop="env_error", error="tool crashed", metrics={"correct": 1.0, "well_formed": 1.0}),
        _traj(3, [2, 2, 2], 1.0, stop="max_turns", metrics={"correct": 1.0, "well_formed": 0.0,
                                                             "media/audio_clips_cut": 2.0}),
    ]


@pytest.fixture
def bus_fields():
    """The episode fields of :func:`_episodes` as the loop reads them back from a bus."""
    trajs = _episodes()
    bus = build_transfer_queue()
    try:
        bus.create_partition("p", 8, R.rollout_schema(), group_size=4)
        bus.put("p", [t.sample_id for t in trajs], R.trajectory_fields(trajs), group_ids=["g"] * 4, versions=[0] * 4)
        batch = bus.get("p", list(R.EPISODE_FIELDS), "c", 4, timeout_s=5.0)
        yield dict(batch.fields)
    finally:
        bus.close()


def test_step_metrics_come_from_the_episode_fields_on_the_bus(bus_fields):
    m = episode_metrics(bus_fields, rollout_s=2.0)
    # three episodes did not fail: rewards .75 .25 1, correct 1 0 1, well formed 1 1 0
    assert m[M.REWARD] == pytest.approx(2.0 / 3) and m[M.ACCURACY] == pytest.approx(2.0 / 3)
    assert m[M.FORMAT_RATE] == pytest.approx(2.0 / 3)
    assert m["rollout/failed"] == 1.0 and m["rollout/episodes"] == 4.0
    assert m["rollout/response_tokens"] == (7 + 16 + 5 + 6) / 4 and m[M.TOKENS_PER_S] == 34 / 2.0
    assert m[M.CROSSED_UPDATE_TURNS] == pytest.approx(1 / 7)  # one of seven turns spans versions 1 and 2
    assert m["rollout/audio_clips_cut"] == 2.0
    assert {k: v for k, v in m.items() if k.startswith("stop/")} == {
        "stop/terminated": 1.0, "stop/length": 1.0, "stop/env_error": 1.0, "stop/max_turns": 1.0}
    assert list(bus_fields[R.ERROR]) == [None, None, "tool crashed", None]
    assert list(bus_fields[R.TURNS]) == [2, 1, 1, 3] and list(bus_fields[R.LONGEST_REPLY]) == [4, 16, 5, 2]


def test_overlong_metrics_come_from_the_fields(bus_fields):
    soft = overlong_field_metrics(bus_fields, OverlongConfig(mode="soft", buffer_tokens=4), 16)
    assert soft["overlong/truncated_frac"] == 0.25
    assert soft["overlong/penalty_mean"] == pytest.approx(-1.0 / 3)  # only the 16-token reply, -1, over 3 ok
    assert overlong_field_metrics(bus_fields, OverlongConfig(mode="mask"), 16)[OVERLONG_MASKED] == 1.0


def test_the_advantage_consumer_shapes_overlong_rows_without_reading_the_trajectory():
    trajs = _episodes()
    bus = build_transfer_queue()
    try:
        bus.create_partition("p", 8, R.rollout_schema(), group_size=4)
        fields = R.trajectory_fields(trajs)
        fields[R.TRAJECTORY] = [None] * 4  # nothing to read there: shaping must use the scalar fields
        bus.put("p", [t.sample_id for t in trajs], fields, group_ids=["g"] * 4, versions=[0] * 4)
        consumer = AdvantageConsumer(bus, "p", 4, overlong=OverlongConfig(mode="mask"), max_new_tokens=16)
        assert R.TRAJECTORY not in consumer.fields
        assert consumer.process_one(timeout_s=5.0)
        out = bus.get("p", [R.TRAINABLE, R.ADVANTAGE], "c", 4, timeout_s=5.0).fields
    finally:
        bus.close()
    assert list(out[R.TRAINABLE]) == [True, False, False, True]  # the truncated one taken out, the failed one too
    adv = np.asarray(out[R.ADVANTAGE])
    assert adv[1] == 0.0 and adv[2] == 0.0 and adv[0] < 0 < adv[3]  # rewards .75 and 1 of the two left


def test_episode_fields_of_a_trajectory_keep_its_values():
    t = dataclasses.replace(_episodes()[0], metrics={"correct": 1.0, "well_formed": 0.5})
    f = R.episode_fields([t])
    assert (f[R.STOP_REASON], list(f[R.CORRECT]), list(f[R.WELL_FORMED]), list(f[R.FAILED])) == (
        ["terminated"], [1.0], [0.5], [False])
    assert list(f[R.RESPONSE_TOKENS]) == [7] and list(f[R.CROSSED_UPDATE_TURNS]) == [1]
