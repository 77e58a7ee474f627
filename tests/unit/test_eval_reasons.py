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


class _ReasonEnv:
    """Gives the reason ``"saw <the action's content>"``; ends after one step."""

    def reset(self, seed=None, options=None):
        return "", {}

    def step(self, action):
        return "", 0.0, True, False, {"reason": f"saw {action['content']}"}

    def close(self):
        pass


class _OwnDriver:
    """A driver of its own kind: plays no env, has no parser."""

    engine = None

    async def play(self, spec, params):
        raise AssertionError("not played here")


def test_replay_reason_replays_the_parsed_actions_only_through_a_driver_that_plays_an_env():
    from types import SimpleNamespace

    from relax_agent.evaluation import replay_reason
    from relax_agent.rollout.engines.fake import FakeEngine
    from relax_agent.rollout.parsers import build_parser
    from relax_agent.rollout.runner import RolloutLimits, RolloutRunner

    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "the answer", "tool_calls": []}]
    traj = SimpleNamespace(error=None, messages=messages)
    runner = RolloutRunner(_ReasonEnv, FakeEngine(["x"]), object(), build_parser("hermes"), RolloutLimits())
    assert runner.env_player() is runner.driver
    assert replay_reason(runner, {}, 0, traj) == "saw the answer"
    assert replay_reason(runner, {}, 0, SimpleNamespace(error="boom", messages=messages)) is None
    own = RolloutRunner(None, None, None, None, RolloutLimits(), driver=_OwnDriver())
    assert own.env_player() is None
    assert replay_reason(own, {}, 0, traj) is None
