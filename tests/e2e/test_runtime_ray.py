"""``runtime: ray`` on a local Ray (CPU, tiny model): rollout replicas and the trainer as actors.

One Ray session for the module (``ray.init(num_cpus=2)``); every run gets its own actor names
(``data.ray_actor_name``). Kill tests count every sample id through the rollout dumps and the
trainer's acks on the bus: none lost, none trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS, B, G = 4, 2, 4


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


class CountingBus:
    """Wraps the controller's bus: sample ids each consumer acked (counted once per first ack)."""

    def __init__(self, inner):
        self.inner, self.acked, self._leases = inner, Counter(), {}

    def get(self, partition, fields, consumer, batch_size, **kw):
        batch = self.inner.get(partition, fields, consumer, batch_size, **kw)
        self._leases[batch.lease_id] = (consumer, list(batch.sample_ids))
        return batch

    def ack(self, lease_id):
        first = self.inner.ack(lease_id)
        if first:
            consumer, ids = self._leases[lease_id]
            self.acked.update(f"{consumer}:{i}" for i in ids)
        return first

    def __getattr__(self, name):
        return getattr(self.inner, name)


def build(tiny_model_dir, out, name, *overrides):
    from relax_agent.config import load_config
    from relax_agent.control import build_controller
    from relax_agent.roles import build_roles

    cfg = load_config(REPO / "examples/tiny.yaml", [
        f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0", "eval.at_start=false",
        "eval.at_end=false", "logging.tensorboard=false", "logging.plot=false", "checkpoint.every_steps=0",
        f"run.output_dir={out}", "run.num_threads=1", "mode=async", "weights.transport=tcp",
        f"trainer.steps={STEPS}", f"rollout.tasks_per_step={B}", f"rollout.group_size={G}",
        "runtime.kind=ray", "runtime.rollout_replicas=2", "runtime.trainer_num_cpus=0.25",
        "runtime.heartbeat_interval_s=0.5", "runtime.heartbeat_timeout_s=10", f"data.ray_actor_name=t-{name}",
        *overrides])
    ctrl = build_controller(cfg, build_roles(cfg))
    ctrl.bus = CountingBus(ctrl.bus)
    return ctrl


def dumped(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted((out / "rollouts").glob("step_*.jsonl")) for line in f.read_text().splitlines()]


def assert_every_sample_once(out: Path, bus: CountingBus, s: int = 0) -> list[dict]:
    """Every sample id of every step is in the dumps exactly once and was acked once by the trainer."""
    rows = dumped(out)
    ids = Counter(r["sample_id"] for r in rows)
    assert max(ids.values()) == 1, [i for i, n in ids.items() if n > 1]
    trained = [r for r in rows if not r["dropped_stale"]]
    if s == 0:
        expected = {f"s{k}/g{g}/{i}" for k in range(STEPS) for g in range(B) for i in range(G)}
        assert set(ids) == expected
    assert len(trained) == STEPS * B * G
    assert all(bus.acked[f"trainer:{r['sample_id']}"] == 1 for r in rows)
    assert all(n == 1 for n in bus.acked.values())
    return rows


def run_in_thread(ctrl):
    box = {}

    def target():
        try:
            box["summary"] = ctrl.train()
        except BaseException as exc:  # reported by the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def wait_for(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)


def test_two_replicas_train_four_steps_within_staleness(ray_session, tiny_model_dir, tmp_path):
    ctrl = build(tiny_model_dir, tmp_path, "main", "max_staleness=1")
    try:
        summary = ctrl.train()
        pool = ctrl.runtime.rollout.pool
        served = {r.name: r.groups_done for r in pool.replicas}
    finally:
        ctrl.close()
    rows = dumped(tmp_path)
    trained = [r for r in rows if not r["dropped_stale"]]
    assert len(trained) == STEPS * B * G
    assert all(0 <= r["trained_at_version"] - r["sample_version"] <= 1 for r in trained)
    assert summary["last"]["policy_version"] == STEPS
    assert sum(1 for n in served.values() if n > 0) == 2, served  # both replicas played groups
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["runtime/rollout_replicas"] for m in metrics] == [2.0] * STEPS
    assert all(m["runtime/rollout_restarts"] == 0 for m in metrics)
