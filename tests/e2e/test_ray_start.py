"""The local Ray a run starts (``relax_agent.data.ray.start_ray``)."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from relax_agent.data import DataConfig  # noqa: E402
from relax_agent.data.ray import start_ray  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_local_ray_runs_the_run_s_workers_at_the_driver_s_priority():
    """Ray's default puts workers at nice 15, where any busy process on the machine starves the
    run's actors (heartbeats lag, healthy replicas get replaced as hung)."""
    assert not ray.is_initialized()
    assert start_ray(DataConfig(backend="ray", ray_num_cpus=1)) is True
    try:
        @ray.remote(num_cpus=0)
        def niceness() -> int:
            return os.getpriority(os.PRIO_PROCESS, 0)

        assert ray.get(niceness.remote(), timeout=300) == os.getpriority(os.PRIO_PROCESS, 0)
        assert start_ray(DataConfig(backend="ray")) is False  # already running: left alone
    finally:
        ray.shutdown()
