"""Rows on the bus under a group this run never started (another process with bus access put them) are
acked and dropped untrained with a warning: they crashed the run with a raw KeyError."""

from __future__ import annotations

from types import SimpleNamespace

from relax_agent.config import validate_config
from relax_agent.control import build_controller
from relax_agent.control.pipeline import Run
from relax_agent.roles import Roles
from relax_agent.rollout.engines.fake import FakeEngine
from relax_agent.train.backends.fake import FakeTrainer
from tests.unit.test_dynamic_sampling import RewardRunner


def test_a_group_this_run_never_started_is_dropped_not_a_crash(tmp_path, capsys):
    cfg = validate_config({"run": {"output_dir": str(tmp_path)}, "rollout": {"tasks_per_step": 2, "group_size": 2},
                           "trainer": {"steps": 1, "backend": "fake"}, "eval": {"at_start": False, "at_end": False},
                           "checkpoint": {"every_steps": 0}, "logging": {"tensorboard": False, "plot": False}})
    engine = FakeEngine(lambda prompt, params: [5, 6, 2])
    tokenizer = SimpleNamespace(pad_token_id=0, decode=lambda ids: " ".join(map(str, ids)))
    roles = Roles(cfg, "cpu", tokenizer, engine, FakeTrainer(), RewardRunner(engine, lambda t, s: 1.0),
                  [{"id": f"t{i}"} for i in range(4)], [])
    ctrl = build_controller(cfg, roles)
    run = Run(ctrl)
    acked = []
    run._ack = acked.append
    try:
        for versions in ([0, 0], [0, 3]):
            batch = SimpleNamespace(group_ids=["s9/g9", "s9/g9"], versions=versions, sample_ids=["s9/g9/0", "s9/g9/1"],
                                    lease_id=f"lease-{versions[1]}", fields={})
            assert run._take(batch, []) is None
        assert acked == ["lease-0", "lease-3"] and run.foreign_rows == 4
        err = capsys.readouterr().err
        assert "2 rows of group 's9/g9' (versions [0]) on the bus were not started by this run; dropped untrained" in err
        run.seq_of["s1/g0"] = 0  # a group of the run with two versions is not one group either
        batch = SimpleNamespace(group_ids=["s1/g0"] * 2, versions=[0, 1], sample_ids=["s1/g0/0", "s1/g0/1"],
                                lease_id="lease-mixed", fields={})
        assert run._take(batch, []) is None and acked[-1] == "lease-mixed"
    finally:
        run.close()
        ctrl.close()
