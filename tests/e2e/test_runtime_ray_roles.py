"""``runtime: ray``: deaths blamed on the role that died, and a hung trainer acted on.

Runs on the fake engine and the fake trainer (no model loads; a step takes ~0.1 s), one replica,
on one local Ray for the module. ``trainer.advantage=reinforce_pp`` normalises rewards over the
step's batch, so most steps train (and publish) although a group's echo replies are all alike.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from tests.fixtures import run_in_thread, wait_for

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_session():
    from relax_agent.data.ray import LOCAL_RAY_SYSTEM_CONFIG

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    yield
    ray.shutdown()


def overrides(tiny_model_dir, out, name, *extra):
    """A fake-engine, fake-trainer ``runtime: ray`` run of many quick steps (each test ends it early)."""
    return [f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0", "engine.kind=fake",
            "trainer.backend=fake", "trainer.advantage=reinforce_pp", "trainer.steps=300", "eval.at_start=false",
            "eval.at_end=false", "logging.tensorboard=false", "logging.plot=false", "checkpoint.every_steps=2",
            f"run.output_dir={out}", "mode=async", "weights.transport=tcp", "runtime.kind=ray",
            "runtime.rollout_replicas=1", "runtime.trainer_num_cpus=0.25", "runtime.heartbeat_interval_s=0.5",
            f"data.ray_actor_name=roles-{name}", *extra]


def build(tiny_model_dir, out, name, *extra):
    from relax_agent.config import load_config
    from relax_agent.control import build_controller
    from relax_agent.roles import build_run_roles

    cfg = load_config(REPO / "examples/tiny.yaml", overrides(tiny_model_dir, out, name, *extra))
    return build_controller(cfg, build_run_roles(cfg))


def steps_logged(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_killed_weight_coordinator_ends_the_run_naming_it_and_restarts_no_trainer(ray_session, tiny_model_dir,
                                                                                    tmp_path):
    """Was: the trainer's publish raised the coordinator's ActorDiedError inside the trainer actor,
    read as the trainer dying: three restarts (each failing to register with the dead coordinator),
    then "trainer ... restarts are used up"."""
    from relax_agent.commands import common
    from relax_agent.errors import RoleDiedError

    ctrl = build(tiny_model_dir, tmp_path, "coord")
    namespace = ctrl.cfg.data.ray_namespace
    thread, box = run_in_thread(ctrl.train)
    try:
        wait_for(lambda: ctrl.version >= 2, 120, "two published versions")
        ray.kill(ray.get_actor("roles-coord.weights", namespace=namespace))
        thread.join(120)
        assert not thread.is_alive(), "the run went on after its weight coordinator died"
        supervisor = ctrl.runtime.rollout.supervisor
        status = supervisor.status()
    finally:
        ctrl.close()
    exc = box.get("error")
    assert isinstance(exc, RoleDiedError), repr(exc)
    text = str(exc)
    assert text.startswith("the weight coordinator (Ray actor 'roles-coord.weights' in namespace ")
    assert "ActorDiedError: actor roles-coord.weights (CoordinatorActor, pid " in text
    assert "is dead: it was killed by `ray.kill`" in text and "ray::" not in text and "\n" not in text
    assert supervisor.restarts["trainer"] == 0 and "trainer_failed" not in [e["event"] for e in status["events"]]
    died = [e for e in status["events"] if e["event"] == "role_died"]
    assert [e["detail"] for e in died] == [text] and status["fatal"] == text
    # the CLI's one line: the cause and the command that resumes
    with common.console.capture() as captured, pytest.raises(common.typer.Exit) as ended:
        common.fail(exc, resume=common.resume_command(Path("run.yaml"), ["runtime.kind=ray", "run.output_dir=a b"]))
    assert ended.value.exit_code == 1
    assert captured.get().splitlines() == [
        f"error: {text}; resume from the last checkpoint with: relax-agent train run.yaml runtime.kind=ray "
        "'run.output_dir=a b' --resume"]


def test_a_killed_data_bus_ends_the_train_command_with_one_error_line(ray_session, tiny_model_dir, tmp_path):
    """Was: the driver's next read of the bus raised ``ConnectionError`` from its socket: a raw traceback."""
    from typer.testing import CliRunner

    from relax_agent.cli import app

    args = overrides(tiny_model_dir, tmp_path, "bus")

    def kill_after_two_steps():
        wait_for(lambda: len(steps_logged(tmp_path)) >= 2, 120, "two steps")
        ray.kill(ray.get_actor("roles-bus", namespace="relax_agent"))

    killer, killed = run_in_thread(kill_after_two_steps)
    result = CliRunner().invoke(app, ["train", "examples/tiny.yaml", *args, "--quiet"])
    killer.join(5)
    assert "error" not in killed, killed.get("error")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "ray::" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    line = errors[0]
    assert line.startswith("error: the data bus (Ray actor 'roles-bus' in namespace 'relax_agent') died "
                           "(ActorDiedError: actor roles-bus (MetadataActor, pid "), line
    assert "killed by `ray.kill`" in line
    assert line.endswith("resume from the last checkpoint with: relax-agent train examples/tiny.yaml "
                         + " ".join(args) + " --resume")
    # the last complete step was checkpointed, so that command continues the run
    assert (tmp_path / "checkpoints").is_dir() and any((tmp_path / "checkpoints").iterdir())


def test_a_hung_trainer_is_reported_killed_and_restarted_from_the_checkpoint(ray_session, tiny_model_dir, tmp_path,
                                                                            caplog):
    """The fake trainer's 3rd update sleeps forever (once: a marker file). Was: the run waited forever,
    nothing on the console or in ``/status``."""
    marker = tmp_path / "hung-once"
    ctrl = build(tiny_model_dir, tmp_path / "run", "hang", "trainer.steps=8", "trainer.fake.hang_at_update=3",
                 f"trainer.fake.hang_marker={marker}", "runtime.trainer_hang_timeout_s=5",
                 "weights.publish_timeout_s=2")
    supervisor = ctrl.runtime.rollout.supervisor
    seen = []
    with caplog.at_level(logging.WARNING, logger="relax_agent.runtime"):
        thread, box = run_in_thread(ctrl.train)
        try:
            deadline = time.monotonic() + 300
            while thread.is_alive():  # read /status while the call hangs
                assert time.monotonic() < deadline, "the hung trainer was never acted on"
                status = supervisor.status()["trainer"]
                if status["call"] is not None and status["doing"] == "train":
                    seen.append(status["call"]["running_s"])
                thread.join(0.2)
            assert "error" not in box, box.get("error")
            status = supervisor.status()
        finally:
            ctrl.close()
    assert marker.exists()
    assert max(seen) > 3.0  # /status showed the call running in `train` for seconds before the kill
    trainer = status["trainer"]
    assert (trainer["hangs"], trainer["restarts"], trainer["hung"]) == (1, 1, False)
    detail = trainer["last_hang"]["detail"]
    assert detail.startswith("the trainer actor (pid ") and "has been in `train` for " in detail
    assert "more than runtime.trainer_hang_timeout_s=5;" in detail
    assert "the process runs, the call does not return" in detail
    assert [e["detail"] for e in status["events"] if e["event"] == "trainer_hung"] == [detail]
    assert [e["detail"] for e in status["events"] if e["event"] == "trainer_failed"] == [detail]
    console = [r.getMessage() for r in caplog.records]
    assert f"runtime: {detail}: killing it" in console
    assert any(m.startswith("runtime: the trainer actor hung (") and "restarting it from" in m for m in console)
    rows = [m for m in steps_logged(tmp_path / "run") if "rollout/reward" in m]
    assert [m["step"] for m in rows] == list(range(1, 9))  # no step lost or trained twice
    trained = [m for m in rows if m["train/samples"] > 0]
    assert trained[-1]["runtime/trainer_hangs"] == 1.0 and trained[-1]["runtime/trainer_restarts"] == 1.0
    final = json.loads((Path(box["result"]["checkpoint"]) / "model" / "fake_model.json").read_text())
    assert final["step"] == rows[-1]["policy_version"] == len(trained)  # each update taken once


def test_a_killed_heartbeat_table_ends_the_run_naming_it(ray_session, tiny_model_dir, tmp_path):
    from relax_agent.errors import RoleDiedError

    ctrl = build(tiny_model_dir, tmp_path, "health")
    thread, box = run_in_thread(ctrl.train)
    try:
        wait_for(lambda: ctrl.version >= 2, 120, "two published versions")
        ray.kill(ray.get_actor("roles-health.health", namespace=ctrl.cfg.data.ray_namespace))
        thread.join(120)
        assert not thread.is_alive(), "the run went on after its heartbeat table died"
        restarts = dict(ctrl.runtime.rollout.supervisor.restarts)
    finally:
        ctrl.close()
    exc = box.get("error")
    assert isinstance(exc, RoleDiedError), repr(exc)
    assert str(exc).startswith("the heartbeat table (Ray actor 'roles-health.health' in namespace ")
    assert "(HealthActor, pid " in str(exc) and "killed by `ray.kill`" in str(exc)
    assert restarts == {"rollout": 0, "trainer": 0}


def test_a_stopped_trainer_process_is_a_hang_without_heartbeats_and_is_restarted(ray_session, tiny_model_dir,
                                                                               tmp_path, caplog):
    """SIGSTOP of the trainer's process: no call returns and no heartbeat comes; killed and restarted."""
    import os
    import signal

    ctrl = build(tiny_model_dir, tmp_path, "stop", "trainer.steps=12", "runtime.trainer_hang_timeout_s=8",
                 "weights.publish_timeout_s=2")
    trainer = ctrl.runtime.trainer
    with caplog.at_level(logging.WARNING, logger="relax_agent.runtime"):
        thread, box = run_in_thread(ctrl.train)
        stopped = None
        try:
            wait_for(lambda: ctrl.step >= 3, 120, "step 3")
            stopped = trainer.pid
            os.kill(stopped, signal.SIGSTOP)
            thread.join(300)
            assert not thread.is_alive(), "the stopped trainer was never acted on"
            assert "error" not in box, box.get("error")
            status = ctrl.runtime.rollout.supervisor.status()["trainer"]
        finally:
            ctrl.close()
            if stopped is not None and Path(f"/proc/{stopped}").exists():
                os.kill(stopped, signal.SIGKILL)  # the runtime should have; never leave it stopped
    assert trainer.pid != stopped
    assert (status["hangs"], status["restarts"]) == (1, 1)
    assert "(stopped or wedged)" in status["last_hang"]["detail"], status["last_hang"]
    assert any("(stopped or wedged): killing it" in r.getMessage() for r in caplog.records)
    rows = [m for m in steps_logged(tmp_path) if "rollout/reward" in m]
    assert [m["step"] for m in rows] == list(range(1, 13))
    assert not Path(f"/proc/{stopped}").exists() or "zombie" in Path(f"/proc/{stopped}/status").read_text().lower()
