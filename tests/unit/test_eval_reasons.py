"""Evaluation inside a training run keeps the env's reasons (BFCL's checker message), as `relax-agent eval`
does: the reason travels with the trajectory instead of being recovered from a runner the rollout
service does not expose."""

from __future__ import annotations

import json

import pytest

from relax_agent.config import validate_config
from relax_agent.control import build_controller
from relax_agent.roles import build_roles

pytest.importorskip("bfcl_eval")


def test_an_evaluation_during_training_records_the_envs_reasons(tmp_path):
    cfg = validate_config({
        "run": {"output_dir": str(tmp_path)}, "env": {"id": "relax/BFCL-simple-v0"},
        "engine": {"kind": "fake"}, "trainer": {"backend": "fake", "steps": 1},
        "eval": {"num_tasks": 3, "seeds": [0]}, "logging": {"tensorboard": False, "plot": False}})
    ctrl = build_controller(cfg, build_roles(cfg))
    try:
        result = ctrl.run_eval()
    finally:
        ctrl.close()
    lines = (tmp_path / "eval" / "step_000000.samples.jsonl").read_text().splitlines()
    reasons = [json.loads(line)["verdict"]["reason"] for line in lines]
    assert len(reasons) == 3
    # the fake engine echoes prompt tokens: never a call; BFCL's own reason, not the generic fallback
    assert all(not r.startswith("not correct") for r in reasons), reasons
    assert result["eval/failure_reasons"][0][1] == 3
