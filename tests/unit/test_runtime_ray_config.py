"""``runtime: ray`` without Ray: the config section, the combinations it refuses, replica picking,
scaling through the control endpoint and ``relax-agent scale``."""

from __future__ import annotations

import json
import stat
import time
import warnings

import pytest

from relax_agent.config import load_config
from relax_agent.errors import ConfigError


def test_runtime_ray_is_short_for_the_kind_and_keys_are_checked():
    assert load_config(None, ["runtime=ray"]).runtime.kind == "ray"
    cfg = load_config(None, ["runtime.kind=ray", "runtime.rollout_replicas=2", "runtime.max_trainer_restarts=1"])
    assert (cfg.runtime.rollout_replicas, cfg.runtime.max_trainer_restarts) == (2, 1)
    assert load_config(None, []).runtime.kind == "local"
    with pytest.raises(ConfigError, match="did you mean 'runtime.rollout_replicas'"):
        load_config(None, ["runtime.replicas=2"])
    with pytest.raises(ConfigError, match="runtime.rollout_replicas"):
        load_config(None, ["runtime.rollout_replicas=0"])


def test_ray_runtime_refuses_colocate_and_transports_other_than_tcp():
    from relax_agent.runtime.ray import check_ray_runtime

    with pytest.raises(ConfigError, match="mode='colocate'.*set mode=async"):
        check_ray_runtime(load_config(None, ["runtime=ray", "weights.transport=tcp"]))
    with pytest.raises(ConfigError, match="weights.transport='inproc'.*set weights.transport=tcp"):
        check_ray_runtime(load_config(None, ["runtime=ray", "mode=async"]))
    check_ray_runtime(load_config(None, ["runtime=ray", "mode=async", "weights.transport=tcp"]))


def test_ray_runtime_uses_the_ray_bus_with_adopted_values_and_warns_when_told_otherwise():
    from relax_agent.runtime.ray import bus_config, watchdog_s

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = bus_config(load_config(None, ["runtime=ray"]))
    assert (data.backend, data.ray_adopt_values) == ("ray", True)
    with pytest.warns(UserWarning, match="ignores data.backend='local'"):
        bus_config(load_config(None, ["runtime=ray", "data.backend=local"]))
    assert watchdog_s(load_config(None, ["rollout.episode_timeout_s=30"])) == 90.0
    assert watchdog_s(load_config(None, ["runtime.request_timeout_s=5"])) == 5.0


def _replicas(*states_in_flight):
    from relax_agent.runtime.ray_rollout import Replica, ReplicaPool

    pool = ReplicaPool()
    for slot, (state, in_flight) in enumerate(states_in_flight):
        pool.replicas.append(Replica(slot, f"r{slot}", None, 0.0, None, state=state, in_flight=in_flight))
    return pool


def test_groups_go_to_the_ready_replica_with_the_fewest_in_flight_within_its_capacity():
    pool = _replicas(("ready", 2), ("starting", 0), ("ready", 1), ("draining", 0))
    assert pool.pick().name == "r2" and pool.replicas[2].in_flight == 2
    assert pool.pick().name == "r0"  # 2 and 2: a tie goes to the lower slot
    assert pool.pick(max_in_flight=3).name == "r2"
    assert pool.pick(max_in_flight=3) is None  # both ready replicas are full; starting/draining never get work
    pool.fail(pool.replicas[0], "died")
    assert pool.replicas[0].state == "failed" and pool.pick().name == "r2"


@pytest.fixture()
def control(tmp_path):
    from relax_agent.runtime.ray_control import ControlServer
    from relax_agent.runtime.ray_rollout import ReplicaPool
    from relax_agent.runtime.ray_supervisor import Supervisor

    supervisor = Supervisor(load_config(None, ["runtime=ray"]), ReplicaPool(), None, None, None, "p", "ns")
    server = ControlServer(supervisor, tmp_path)
    yield supervisor, server
    server.close()


def test_scale_through_the_control_endpoint(control, tmp_path):
    from relax_agent.runtime.ray_control import scale_run

    supervisor, server = control
    path = tmp_path / "runtime.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["url"] == server.url
    assert scale_run(tmp_path, 3)["target"] == 3 and supervisor.target == 3
    with pytest.raises(ConfigError, match=r"HTTP 422 .*--rollout 0: expected an integer >= 1"):
        scale_run(tmp_path, 0)
    assert supervisor.target == 3
    path.write_text(json.dumps({**json.loads(path.read_text()), "token": "wrong"}))
    with pytest.raises(ConfigError, match="HTTP 401"):
        scale_run(tmp_path, 2)


def test_scale_cli_names_a_folder_without_a_running_controller(tmp_path):
    from typer.testing import CliRunner

    from relax_agent.cli import app

    result = CliRunner().invoke(app, ["scale", str(tmp_path), "--rollout", "2"])
    assert result.exit_code == 2 and "runtime.json does not exist" in result.output


def test_control_endpoint_closes_and_removes_its_file(tmp_path):
    from relax_agent.runtime.ray_control import ControlServer, scale_run
    from relax_agent.runtime.ray_rollout import ReplicaPool
    from relax_agent.runtime.ray_supervisor import Supervisor

    supervisor = Supervisor(load_config(None, ["runtime=ray"]), ReplicaPool(), None, None, None, "p", "ns")
    server = ControlServer(supervisor, tmp_path)
    info = (tmp_path / "runtime.json").read_text()
    server.close()
    assert not (tmp_path / "runtime.json").exists()
    (tmp_path / "runtime.json").write_text(info)  # a file left by a run that was killed
    with pytest.raises(ConfigError, match="does not answer"):
        scale_run(tmp_path, 2, timeout_s=2.0)


class _Supervisor:
    def __init__(self, allow):
        self.allow, self.reasons = allow, []

    def allow_trainer_restart(self, reason):
        self.reasons.append(reason)
        return self.allow

    def dead_role(self):
        return None

    def trainer_beat(self):
        return None

    def note_trainer_call(self, call):
        pass

    def note_trainer_hung(self, detail):
        pass

    def metrics(self):
        return {}


def _trainer_service(tmp_path, allow=True):
    from relax_agent.runtime.ray_trainer.service import RayTrainerService, _Base

    svc = RayTrainerService.__new__(RayTrainerService)  # no actor: the restart bookkeeping only
    svc.cfg = load_config(None, ["runtime.kind=ray", f"run.output_dir={tmp_path}", "runtime.max_trainer_restarts=2"])
    svc.supervisor, svc.actor = _Supervisor(allow), None
    svc._base, svc._log, svc._version, svc._saved = _Base(None, 0), [], 0, False
    return svc


def test_a_dead_trainer_past_the_restart_budget_ends_the_run(tmp_path):
    from relax_agent.errors import RelaxError

    svc = _trainer_service(tmp_path, allow=False)
    with pytest.raises(RelaxError, match="runtime.max_trainer_restarts=2 restarts are used up"):
        svc._recover(RuntimeError("actor died"))
    assert svc.supervisor.reasons == ["RuntimeError: actor died"]


def test_a_trainer_failure_caused_by_a_dead_role_restarts_nothing_and_names_the_role(tmp_path):
    from relax_agent.errors import RoleDiedError

    svc = _trainer_service(tmp_path)
    died = RoleDiedError("the weight coordinator (Ray actor 'p.weights' in namespace 'ns') died (...)")
    svc.supervisor.dead_role = lambda: died
    with pytest.raises(RoleDiedError) as raised:
        svc._recover(RuntimeError("ActorDiedError inside the trainer's publish"))
    assert raised.value is died and svc.supervisor.reasons == []  # no restart counted or tried


def test_a_restart_refuses_a_redo_log_with_a_gap(tmp_path):
    from relax_agent.errors import CheckpointError

    svc = _trainer_service(tmp_path)
    svc._log, svc._version = [("train", {}, 1), ("train", {}, 3)], 3
    with pytest.raises(CheckpointError, match=r"redo log holds versions \[1, 3\], expected \[1, 2\]"):
        svc._restart()


def test_after_a_checkpoint_the_redo_log_keeps_only_what_came_later(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step_000002"
    (ckpt / "model").mkdir(parents=True)
    for name in ("trainer.pt", "rng.pt", "model/model.safetensors"):
        (ckpt / name).write_text("x")
    (ckpt / "state.json").write_text(json.dumps({"step": 2, "policy_version": 3}))
    svc = _trainer_service(tmp_path)
    svc._log = [("sft", {}, 1e-4), ("end_sft", None, 1), ("train", {}, 2), ("train", {}, 3), ("train", {}, 4)]
    svc._trim_to_checkpoint()
    assert len(svc._log) == 5  # nothing was saved since the last trim
    svc._saved = True
    svc._trim_to_checkpoint()
    assert (svc._base.checkpoint, svc._base.version) == (ckpt, 3)
    assert svc._log == [("train", {}, 4)]


class _Call:
    """A fake ObjectRef: ``future()`` is a concurrent future the test completes (or never does)."""

    def __init__(self, result=None, error=None):
        import concurrent.futures

        self._future = concurrent.futures.Future()
        if error is not None:
            self._future.set_exception(error)
        elif result is not None:
            self._future.set_result(result)

    def future(self):
        return self._future


class _Handle:
    def __init__(self, call):
        self.play_group = type("M", (), {"remote": staticmethod(lambda *args: call)})()


class _Coordinator:
    latest_version = 3


def _service(calls, watchdog_s=0.3):
    from relax_agent.runtime.ray_rollout import RayRolloutService, Replica, ReplicaPool

    pool = ReplicaPool()
    for slot, call in enumerate(calls):
        pool.replicas.append(Replica(slot, f"r{slot}", _Handle(call), 0.0, None, state="ready"))
    return RayRolloutService(pool, lambda *a, **k: [], _Coordinator(), watchdog_s), pool


def _job():
    from relax_agent.runtime.base import GroupDone, GroupJob

    job = GroupJob(0, "s0/g0", {"id": "t"}, 0, 2)
    return job, GroupDone(job, ["s0/g0/0", "s0/g0/1"], 3, 0.1)


def test_a_group_past_the_watchdog_is_played_again_on_another_replica():
    import asyncio

    from relax_agent.rollout.engines.base import SamplingParams

    job, done = _job()
    svc, pool = _service([_Call(), _Call(done)])  # replica 0 never answers
    assert asyncio.run(svc.play_group(job, SamplingParams(8))) == done
    r0, r1 = pool.replicas
    assert r0.state == "failed" and "runtime.request_timeout_s=0.3" in r0.reason
    assert (r0.in_flight, r1.in_flight, r1.groups_done, svc.retried_groups) == (0, 0, 1, 1)
    assert r0.first_group is None and r1.first_group == (3, 3)  # its first group: version 3, the latest


def test_a_group_whose_replica_died_is_played_again_and_records_the_first_version():
    import asyncio

    import ray

    from relax_agent.rollout.engines.base import SamplingParams

    job, done = _job()
    svc, pool = _service([_Call(error=ray.exceptions.ActorDiedError()), _Call(done)], watchdog_s=60)
    assert asyncio.run(svc.play_group(job, SamplingParams(8))) == done
    r0, r1 = pool.replicas
    assert r0.state == "failed" and "died during group s0/g0" in r0.reason
    assert r1.groups_done == 1 and svc.retried_groups == 1 and r1.first_group == (3, 3)


def test_a_replicas_first_group_is_recorded_before_the_group_is_counted(monkeypatch):
    """A reader that sees ``groups_done`` reach 1 (the supervisor, a scale test) also sees ``first_group``."""
    import asyncio

    from relax_agent.rollout.engines.base import SamplingParams

    job, done = _job()
    svc, pool = _service([_Call(done)], watchdog_s=60)
    seen = []
    release = pool.release

    def watching_release(rep, ok):
        seen.append((rep.groups_done, rep.first_group))
        release(rep, ok)

    monkeypatch.setattr(pool, "release", watching_release)
    assert asyncio.run(svc.play_group(job, SamplingParams(8))) == done
    assert seen == [(0, (3, 3))] and pool.replicas[0].groups_done == 1


def test_scale_beyond_the_replica_bound_is_refused_with_422_naming_it(control, tmp_path, monkeypatch):
    """``{"rollout": 10000}`` would start ten thousand actors: refused, naming the bound; the target stays."""
    from relax_agent.runtime import ray_supervisor
    from relax_agent.runtime.ray_control import scale_run

    supervisor, _ = control
    assert scale_run(tmp_path, 64)["target"] == 64  # the default bound itself is accepted
    with pytest.raises(ConfigError, match=r"HTTP 422 .*--rollout 10000: more than the 64 rollout replicas .*"
                                          r"runtime.max_rollout_replicas=64"):
        scale_run(tmp_path, 10000)
    assert supervisor.target == 64
    # on a Ray cluster of 4 CPUs: (4 - 0.5 for the trainer) / 0.25 per replica = 14
    monkeypatch.setattr(ray_supervisor.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray_supervisor.ray, "cluster_resources", lambda: {"CPU": 4.0})
    assert supervisor.max_replicas()[0] == 14
    with pytest.raises(ConfigError, match=r"HTTP 422 .*--rollout 15: more than the 14 .*cluster's 4 CPUs"):
        scale_run(tmp_path, 15)
    assert scale_run(tmp_path, 14)["target"] == 14


def test_rollout_replicas_above_the_bound_are_refused_at_load():
    with pytest.raises(ConfigError, match=r"runtime.rollout_replicas=100 is more than runtime.max_rollout_replicas=64"):
        load_config(None, ["runtime.kind=ray", "runtime.rollout_replicas=100"])
    assert load_config(None, ["runtime.rollout_replicas=100", "runtime.max_rollout_replicas=128"]).runtime.rollout_replicas == 100


def test_the_control_endpoint_closes_idle_connections_and_caps_open_ones(tmp_path):
    """Idle (unauthenticated) connections each held a driver thread forever: now they are closed after
    the idle timeout, and one beyond the cap gets 503 at once; the endpoint keeps serving."""
    import socket
    import time

    from relax_agent.runtime.ray_control import ControlServer, scale_run
    from relax_agent.runtime.ray_rollout import ReplicaPool
    from relax_agent.runtime.ray_supervisor import Supervisor

    supervisor = Supervisor(load_config(None, ["runtime=ray"]), ReplicaPool(), None, None, None, "p", "ns")
    server = ControlServer(supervisor, tmp_path, idle_timeout_s=1.0, max_connections=2)
    host, port = server.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(2)]
    try:
        time.sleep(0.3)  # both accepted and waiting for a request line
        with socket.create_connection((host, int(port)), timeout=10) as third:
            assert third.recv(1024).startswith(b"HTTP/1.1 503")
        start = time.monotonic()
        for conn in idle:
            assert conn.recv(1024) == b""  # closed by the server, nothing sent
        assert time.monotonic() - start < 5.0
        assert scale_run(tmp_path, 2)["target"] == 2  # slots are free again
    finally:
        for conn in idle:
            conn.close()
        server.close()


_DEAD_COORDINATOR = """The actor died unexpectedly before finishing this task.
\tclass_name: CoordinatorActor
\tactor_id: 5f0f25d226b7601854adf84c01000000
\tpid: 29994
\tname: t.weights
\tnamespace: relax_agent
\tip: 127.0.0.1
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker
unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the process was killed"""


def test_a_failure_across_ray_is_told_by_its_root_cause_not_ray_s_wrapper():
    ray = pytest.importorskip("ray")
    from relax_agent.commands.common import _unwrapped
    from relax_agent.errors import WeightSyncError
    from relax_agent.runtime.ray_roles import describe_failure

    inner = WeightSyncError("version 3 refused")
    wrapped = ray.exceptions.RayTaskError(
        "TrainerActor.train", "ray::TrainerActor.train() (pid=12, ip=127.0.0.1, actor_id=ab, repr=<x>)\n  File ...",
        inner, pid=12, ip="127.0.0.1").as_instanceof_cause()
    assert isinstance(wrapped, WeightSyncError) and str(wrapped).startswith("ray::TrainerActor.train()")
    assert describe_failure(wrapped) == "WeightSyncError: version 3 refused"
    assert _unwrapped(wrapped) is inner and _unwrapped(inner) is inner
    dead = ray.exceptions.ActorDiedError()
    dead.error_msg = _DEAD_COORDINATOR
    assert str(dead) == _DEAD_COORDINATOR
    assert describe_failure(dead) == (
        "ActorDiedError: actor t.weights (CoordinatorActor, pid 29994) is dead: its worker process has died. Worker "
        "exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End "
        "of file")
    assert describe_failure(ray.exceptions.ActorDiedError()) == (
        "ActorDiedError: The actor died unexpectedly before finishing this task")


def test_a_trainer_hang_bound_not_above_the_publish_timeout_is_refused_naming_both_keys():
    from relax_agent.preflight import check_ray_combination

    base = ["runtime=ray", "mode=async", "weights.transport=tcp"]
    with pytest.raises(ConfigError, match=r"runtime.trainer_hang_timeout_s=600 is not above "
                                          r"weights.publish_timeout_s=600"):
        check_ray_combination(load_config(None, [*base, "runtime.trainer_hang_timeout_s=600"]))
    assert load_config(None, base).runtime.trainer_hang_timeout_s == 1800.0
    check_ray_combination(load_config(None, [*base, "runtime.trainer_hang_timeout_s=5", "weights.publish_timeout_s=2"]))
    check_ray_combination(load_config(None, [*base, "runtime.trainer_hang_timeout_s=null"]))
    with pytest.raises(ConfigError, match="runtime.trainer_hang_timeout_s"):
        load_config(None, [*base, "runtime.trainer_hang_timeout_s=0"])


def _supervisor_with(states):
    """A supervisor without Ray: its pool holds replicas in ``states``; returns (supervisor, replicas)."""
    from relax_agent.runtime.ray_rollout import Replica, ReplicaPool
    from relax_agent.runtime.ray_supervisor import Supervisor

    sup = Supervisor.__new__(Supervisor)
    sup.pool, sup._failed_starts = ReplicaPool(), 0
    sup.rt = load_config(None, ["runtime.kind=ray"]).runtime
    reps = [Replica(i, f"r-{i}", None, 0.0, None, state=state) for i, state in enumerate(states)]
    sup.pool.replicas.extend(reps)
    sup.target = len(reps)
    return sup, reps


def test_a_slot_whose_starts_keep_failing_beside_a_ready_replica_is_given_up_not_retried_forever():
    from relax_agent.runtime.ray_rollout import Replica

    sup, _ = _supervisor_with(["ready", "starting"])
    for k in range(3):
        rep = sup.pool.replicas[-1]
        sup._failed_start(rep, "start failed: ModelLoadError: no such file", stuck=False)
        if k < 2:  # the supervisor would start a replacement in the slot
            sup.pool.replicas.append(Replica(1, f"r-1.{k}", None, 0.0, None))
    assert sup.target == 1 and sup.pool.fatal is None
    events = [e for _, e, _, _ in sup.pool.events]
    assert events.count("failed") == 3 and events[-1] == "scaled_back"
    assert "3 starts in a row failed (last: start failed: ModelLoadError" in sup.pool.events[-1][3]


def test_a_start_that_hangs_with_no_replica_serving_ends_the_run_at_once():
    sup, (rep,) = _supervisor_with(["starting"])
    sup._failed_start(rep, "not ready within runtime.replica_start_timeout_s=600", stuck=True)
    assert "no rollout replica is serving after a replica start that hung" in str(sup.pool.fatal)
    sup2, (rep2,) = _supervisor_with(["starting"])
    sup2._failed_start(rep2, "start failed: boom", stuck=False)  # a fast failure is tried again (up to 3)
    assert sup2.pool.fatal is None and sup2.target == 1


def test_a_trainer_killed_by_rays_memory_monitor_is_restarted_and_named_with_the_memory_settings(tmp_path):
    """Ray's memory monitor kills the trainer: the call raises ``OutOfMemoryError`` (not an actor
    error), which is handled as a death: restarted within the budget, and past it one error naming the
    cause and the settings that lower the node's memory use."""
    import ray

    from relax_agent.errors import RelaxError

    svc = _trainer_service(tmp_path, allow=False)
    calls = []

    def ref():
        calls.append(1)
        raise ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")

    svc._get = lambda r, per_op=1: r()
    with pytest.raises(RelaxError) as err:
        svc._call(lambda: ref)
    text = str(err.value)
    assert "restarts are used up" in text and "RAY_memory_usage_threshold" in text and "micro_batch_tokens" in text
    assert "OutOfMemoryError: Task was killed" in svc.supervisor.reasons[0]


def test_replicas_get_the_reward_service_tokens_of_the_driver(monkeypatch):
    """A replica on another host has none of the driver's environment: the token of each remote reward
    service goes with it (and nothing else of the environment does)."""
    from relax_agent.runtime.ray import replica_env_vars

    cfg = load_config(None, ["runtime.kind=ray", "reward.source=remote", "reward.url=http://10.0.0.2:8001",
                             "reward.token_env=RXT_TEST_REWARD_TOKEN"])
    monkeypatch.setenv("RXT_TEST_REWARD_TOKEN", "s3cret")
    monkeypatch.setenv("RXT_TEST_OTHER", "not for replicas")
    assert replica_env_vars(cfg) == {"RXT_TEST_REWARD_TOKEN": "s3cret"}
    assert replica_env_vars(load_config(None, ["runtime.kind=ray"])) == {}  # the env's own reward: nothing


def test_a_trainer_that_stops_beating_during_a_call_is_a_hang_in_seconds_not_the_30_minute_bound(tmp_path, monkeypatch,
                                                                                                 caplog):
    """A stopped trainer (SIGSTOP) was acted on only after runtime.trainer_hang_timeout_s (1800 s), with no
    console line before: now silence past 2 x runtime.heartbeat_timeout_s is the hang, warned at half of it."""
    import logging

    from relax_agent.runtime.ray_trainer import service as svc_module

    svc = _trainer_service(tmp_path)
    svc.cfg = load_config(None, ["runtime.kind=ray", f"run.output_dir={tmp_path}", "runtime.heartbeat_timeout_s=0.4",
                                 "runtime.heartbeat_interval_s=0.05"])
    svc.pid = 4242
    last_beat = [time.monotonic()]
    svc.supervisor.trainer_beat = lambda: (time.monotonic() - last_beat[0], {"pid": 4242, "busy": True, "doing": "train"})
    hung, killed = [], []
    svc.supervisor.note_trainer_hung = hung.append
    svc._kill_actor = lambda sigkill=False: killed.append(sigkill)
    monkeypatch.setattr(svc_module.ray, "wait", lambda refs, timeout: (time.sleep(timeout), ([], refs))[1])
    with caplog.at_level(logging.WARNING, logger="relax_agent.runtime"), \
            pytest.raises(svc_module._TrainerHung, match=r"sent no heartbeat for more than 2 x runtime.heartbeat_timeout_s"
                                                       r" = 0.8 s; no heartbeat for [\d.]+ s \(stopped or wedged\)"):
        svc._get(object())
    assert killed == [True] and len(hung) == 1
    assert any("has sent no heartbeat for" in r.getMessage() and "judged hung at 0.8 s" in r.getMessage()
               for r in caplog.records)


def test_a_trainer_that_beats_through_a_long_call_is_not_a_hang(tmp_path, monkeypatch):
    from relax_agent.runtime.ray_trainer import service as svc_module

    svc = _trainer_service(tmp_path)
    svc.cfg = load_config(None, ["runtime.kind=ray", f"run.output_dir={tmp_path}", "runtime.heartbeat_timeout_s=0.2",
                                 "runtime.heartbeat_interval_s=0.05"])
    svc.pid = 4242
    svc.supervisor.trainer_beat = lambda: (0.01, {"pid": 4242, "busy": True, "doing": "train"})  # beating
    calls = []

    def wait(refs, timeout):
        calls.append(1)
        time.sleep(timeout)
        return (refs, []) if len(calls) > 30 else ([], refs)  # 1.5 s: long past the 0.4 s silence bound

    monkeypatch.setattr(svc_module.ray, "wait", wait)
    monkeypatch.setattr(svc_module.ray, "get", lambda ref: "done")
    assert svc._get(object()) == "done"
