"""``runtime: ray`` on a local Ray (CPU, tiny model): rollout replicas and the trainer as actors.

One Ray session for the module (``ray.init(num_cpus=2)``, workers at nice 0 as the runtime starts
them); every run gets its own actor names (``data.ray_actor_name``). Kill tests count every sample
id through the rollout dumps and the trainer's acks on the bus: none lost, none trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.fixtures import run_in_thread, wait_for

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
"""Each test bounds its own waits (a named ``wait_for`` or ``join`` per phase, up to 1620 s in all for the
scale test); the suite's 600 s hang guard would cut a run that is only slow (a loaded machine) short."""
REPO = Path(__file__).resolve().parents[2]
STEPS, B, G = 4, 2, 4


@pytest.fixture(scope="module")
def ray_session():
    from relax_agent.data.ray import LOCAL_RAY_SYSTEM_CONFIG

    ray.init(num_cpus=2, include_dashboard=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    yield
    ray.shutdown()


class CountingBus:
    """Wraps the controller's bus: sample ids each consumer acked (counted once per first ack) and the
    fields each consumer read through the driver."""

    def __init__(self, inner):
        self.inner, self.acked, self._leases, self.fields = inner, Counter(), {}, {}

    def get(self, partition, fields, consumer, batch_size, **kw):
        self.fields.setdefault(consumer, set()).update(fields)
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


def config(tiny_model_dir, out, *overrides):
    """The tiny Echo run, async s=0 over tcp, each request decoded alone (sampling independent of load)."""
    from relax_agent.config import load_config

    return load_config(REPO / "examples/tiny.yaml", [
        f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0", "eval.at_start=false",
        "eval.at_end=false", "logging.tensorboard=false", "logging.plot=false", "checkpoint.every_steps=0",
        f"run.output_dir={out}", "run.num_threads=1", "engine.max_batch_size=1", "mode=async",
        "weights.transport=tcp", f"trainer.steps={STEPS}", f"rollout.tasks_per_step={B}", f"rollout.group_size={G}",
        *overrides])


def build(tiny_model_dir, out, name, *overrides):
    """A controller of ``runtime: ray`` (2 replicas unless overridden) with a counting bus."""
    from relax_agent.control import build_controller
    from relax_agent.roles import build_run_roles

    cfg = config(tiny_model_dir, out, "runtime.kind=ray", "runtime.rollout_replicas=2", "runtime.trainer_num_cpus=0.25",
                 "runtime.heartbeat_interval_s=0.5", "runtime.heartbeat_timeout_s=10", f"data.ray_actor_name=t-{name}",
                 *overrides)
    ctrl = build_controller(cfg, build_run_roles(cfg))
    ctrl.bus = CountingBus(ctrl.bus)
    return ctrl


def final_weights(summary) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(summary["checkpoint"]) / "model" / "model.safetensors"))


_REFERENCE_RUN = """
import json, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.e2e.test_runtime_ray import config
from relax_agent.control import build_controller
from relax_agent.roles import build_run_roles
cfg = config(Path({model!r}), Path({out!r}))
ctrl = build_controller(cfg, build_run_roles(cfg))
try:
    summary = ctrl.train()
finally:
    ctrl.close()
print(json.dumps({{"checkpoint": str(summary["checkpoint"])}}))
"""


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """The same run under ``runtime: local`` (async s=0, tcp): rows and final weights.

    It runs in a fresh process started as Ray starts its workers (``OMP_NUM_THREADS=1``): on some CPUs the
    OpenMP pool a process starts with changes the last bits of a forward pass even at one torch thread,
    and a local run inside this test process sampled a near-tie token at step 3 differently from the
    Ray actors, which a comparison of exact responses cannot tell from a lost or repeated step."""
    out = tmp_path_factory.mktemp("local")
    script = _REFERENCE_RUN.format(repo=str(REPO), model=str(tiny_model_dir), out=str(out))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {"rows": dumped(out), "weights": final_weights(summary)}


def assert_same_as_local(reference, out, summary):
    """Same samples (ids, versions, rewards, responses) and the same final weights as the local run.

    Weights agree to 1e-4: the replicas' log-probs come from other processes and differ in the last
    bits, which Adam (lr 1e-3) turns into differences of ~1e-5; a step missing or taken twice moves
    weights by ~lr = 1e-3."""
    key = lambda r: (r["sample_id"], r["sample_version"], r["trained_at_version"], r["reward"], r["response"])  # noqa: E731
    assert sorted(map(key, dumped(out))) == sorted(map(key, reference["rows"]))
    got = final_weights(summary)
    diff = {name: float((got[name] - t).abs().max()) for name, t in reference["weights"].items()}
    assert max(diff.values()) <= 1e-4, sorted(diff.items(), key=lambda kv: -kv[1])[:5]


def dumped(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted((out / "rollouts").glob("step_*.jsonl")) for line in f.read_text().splitlines()]


def assert_every_sample_once(out: Path, bus: CountingBus, steps: int = STEPS) -> None:
    """s = 0: every sample id of every step is in the dumps exactly once (0 lost, 0 trained twice), each
    was acked exactly once by the advantage consumer and the trainer, every step was logged once, and
    no token, mask, log-prob, media or route array went through the driver (the trainer actor reads
    them from the bus)."""
    from relax_agent import records as R

    rows = dumped(out)
    ids = Counter(r["sample_id"] for r in rows)
    assert [i for i, n in ids.items() if n > 1] == []
    assert set(ids) == {f"s{k}/g{g}/{i}" for k in range(steps) for g in range(B) for i in range(G)}
    assert not any(r["dropped_stale"] for r in rows)
    loop_acks = {k for k in bus.acked if not k.startswith("checkpoint:")}
    assert loop_acks == {f"{c}:{i}" for c in ("trainer", "advantage") for i in ids}
    assert set(bus.acked.values()) == {1}
    assert bus.fields["trainer"] == {R.ADVANTAGE, R.TRAINABLE, R.TRAJECTORY, *R.EPISODE_FIELDS}  # scalars only
    assert not bus.fields["trainer"] & {R.TOKEN_IDS, R.LOSS_MASK, R.ROLLOUT_LOGPROBS, R.MEDIA, *R.ROUTE_FIELDS}
    assert bus.fields["advantage"] == {R.REWARD, R.TRAINABLE, R.POLICY_TOKENS}
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1))


def test_two_replicas_train_four_steps_within_staleness(ray_session, tiny_model_dir, tmp_path):
    ctrl = build(tiny_model_dir, tmp_path, "main", "max_staleness=1", "eval.at_end=true")
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
    assert summary["eval_end"]["eval/num_tasks"] == 4  # evaluation episodes ran on the replicas too
    assert sum(1 for n in served.values() if n > 0) == 2, served  # both replicas played groups
    metrics = [m for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
               if "rollout/reward" in (m := json.loads(line))]  # step rows (not the evaluation's)
    assert [m["runtime/rollout_replicas"] for m in metrics] == [2.0] * STEPS
    assert all(m["runtime/rollout_restarts"] == 0 for m in metrics)


def test_the_driver_loads_no_model_and_the_warm_up_renders_its_demonstrations_on_a_replica(
        ray_session, tiny_model_dir, tmp_path, monkeypatch):
    """Each actor builds what it runs: the driver (this process) only checks the config and loads the tasks
    and the tokenizer, so loading a policy here fails the test; the replica renders the warm-up's
    demonstrations (the same rows the driver's own env, renderer and parser give), the trainer actor
    trains on them and the first RL step's groups are sampled with the warm-up's weights."""
    import relax_agent.models as models
    from relax_agent.roles import DriverRoles, build_run_roles, make_env_factory, resolved_parser_name
    from relax_agent.rollout.chat import ChatRenderer
    from relax_agent.rollout.demonstrations import demonstration_fields
    from relax_agent.rollout.parsers import build_parser

    def refuse(*args, **kwargs):
        raise AssertionError("the driver of a runtime: ray run loaded the policy")

    monkeypatch.setattr(models, "load_policy", refuse)
    ctrl = build(tiny_model_dir, tmp_path, "nomodel", "env.id=relax/BFCL-simple-v0", "trainer.steps=1",
                 "runtime.rollout_replicas=1", "trainer.sft_warmup_steps=2", "trainer.sft_batch_size=2",
                 "trainer.sft_lr=1e-3", "rollout.max_new_tokens=8")
    try:
        summary = ctrl.train()
        cfg, roles = ctrl.cfg, build_run_roles(ctrl.cfg)
    finally:
        ctrl.close()
    assert isinstance(roles, DriverRoles)
    tok = roles.tokenizer
    renderer = ChatRenderer(tok, cfg.rollout.tools_in, cfg.rollout.system_prompt, cfg.rollout.tool_example)
    parser = build_parser(resolved_parser_name(cfg, tok, cfg.model.path, quiet=True))
    local = demonstration_fields(make_env_factory(cfg), renderer, parser, roles.train_tasks, cfg.run.seed)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    warm = next(r for r in rows if "sft/demonstrations" in r)
    assert warm["sft/demonstrations"] == len(local["task_id"]) > 0 and warm["policy_version"] == 1
    sft = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert [r["sft/step"] for r in sft] == [1, 2] and all(r["sft/tokens"] > 0 for r in sft)
    assert {r["sample_version"] for r in dumped(tmp_path)} == {1}  # sampled with the warm-up's weights
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1] and "rollout/reward" in summary["last"]


def replica_in_step(ctrl, step):
    """Wait until the loop trains towards ``step`` and a ready replica plays a group; returns it."""
    from relax_agent.runtime.ray_rollout import READY

    def busy():
        if ctrl.step < step:
            return None
        return next((r for r in ctrl.runtime.rollout.pool.in_state(READY) if r.in_flight > 0 and r.pid), None)

    wait_for(lambda: busy() is not None, 300, f"a replica playing a group of step {step + 1}")
    return busy()


def test_sigkill_of_a_rollout_replica_mid_step_loses_nothing(ray_session, tiny_model_dir, tmp_path, reference):
    """The only replica is killed while it plays step 2's groups: the run can only finish once its
    replacement serves (how fast is measured by benchmarks/runtime.py, not asserted here)."""
    ctrl = build(tiny_model_dir, tmp_path, "kill-rollout", "runtime.rollout_replicas=1")
    thread, box = run_in_thread(ctrl.train)
    try:
        victim = replica_in_step(ctrl, 1)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.time()
        thread.join(600)
        assert "error" not in box, box.get("error")
        pool = ctrl.runtime.rollout.pool
        events = list(pool.events)
        served = {r.name: r.groups_done for r in pool.replicas}
        retried = ctrl.runtime.rollout.retried_groups
        restarts = ctrl.runtime.rollout.supervisor.restarts["rollout"]
    finally:
        ctrl.close()
    assert_every_sample_once(tmp_path, ctrl.bus)
    assert_same_as_local(reference, tmp_path, box["result"])
    assert retried >= 1 and restarts == 1
    failed = [e for e in events if e[1] == "failed"]
    assert [e[2] for e in failed] == [victim.name] and "died" in failed[0][3]
    ready = [e for e in events if e[1] == "ready" and e[0] > killed_at]
    assert len(ready) == 1 and served[ready[0][2]] > 0, (events, served)
    print(f"replacement serving {ready[0][0] - killed_at:.1f} s after the kill")


def test_a_stopped_replica_is_detected_by_heartbeat_age_and_replaced(ray_session, tiny_model_dir, tmp_path,
                                                                     reference):
    ctrl = build(tiny_model_dir, tmp_path, "stop-rollout", "runtime.rollout_replicas=1", "runtime.heartbeat_timeout_s=6")
    thread, box = run_in_thread(ctrl.train)
    victim = None
    try:
        victim = replica_in_step(ctrl, 1)
        os.kill(victim.pid, signal.SIGSTOP)
        thread.join(600)
        assert "error" not in box, box.get("error")
        events = list(ctrl.runtime.rollout.pool.events)
    finally:
        ctrl.close()
        if victim is not None and Path(f"/proc/{victim.pid}").exists():
            os.kill(victim.pid, signal.SIGKILL)  # the supervisor should have; never leave it stopped
    assert_every_sample_once(tmp_path, ctrl.bus)
    assert_same_as_local(reference, tmp_path, box["result"])
    failed = [e for e in events if e[1] == "failed"]
    assert [e[2] for e in failed] == [victim.name] and "no heartbeat" in failed[0][3], failed
    assert not Path(f"/proc/{victim.pid}").exists() or "zombie" in Path(f"/proc/{victim.pid}/status").read_text()


def test_sigkill_of_the_trainer_restarts_it_from_the_checkpoint(ray_session, tiny_model_dir, tmp_path, reference):
    ctrl = build(tiny_model_dir, tmp_path, "kill-trainer", "runtime.rollout_replicas=1", "checkpoint.every_steps=2")
    thread, box = run_in_thread(ctrl.train)
    try:
        wait_for(lambda: ctrl.step >= 3, 300, "step 3")  # checkpoint at step 2, step 3 only in the redo log
        old = ctrl.runtime.trainer.pid
        os.kill(old, signal.SIGKILL)
        thread.join(600)
        assert "error" not in box, box.get("error")
        new = ctrl.runtime.trainer.pid
        left_on_bus = ctrl.bus.stats("rollouts")["rows"]
    finally:
        ctrl.close()
    assert new != old
    assert box["result"]["last"]["policy_version"] == STEPS
    assert_every_sample_once(tmp_path, ctrl.bus)
    assert_same_as_local(reference, tmp_path, box["result"])
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["runtime/trainer_restarts"] for m in metrics] == [0, 0, 0, 1]
    # step 3's rows waited on the bus for the restart to replay them; the checkpoints of steps 2 and 4
    # released every trained row once (nothing is left on the bus)
    released = sorted(k.split(":", 1)[1] for k in ctrl.bus.acked if k.startswith("checkpoint:"))
    assert released == sorted(r["sample_id"] for r in dumped(tmp_path))
    assert left_on_bus == 0


def gate_trainer(ctrl, gated_calls):
    """Hold the trainer service's ``train`` call number ``n`` until ``gates[n]`` is set; returns
    (calls so far, gates)."""
    calls, gates = [], {n: threading.Event() for n in gated_calls}
    real = ctrl.runtime.trainer.train

    def train(ref):
        calls.append(ref.version)
        gate = gates.get(len(calls))
        if gate is not None:
            assert gate.wait(600), f"train call {len(calls)} was never released"
        return real(ref)

    ctrl.runtime.trainer.train = train
    return calls, gates


def scale_cli(out, n):
    from typer.testing import CliRunner

    from relax_agent.cli import app

    result = CliRunner().invoke(app, ["scale", str(out), "--rollout", str(n)])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def test_scale_out_and_in_while_training(ray_session, tiny_model_dir, tmp_path, reference):
    """1 -> 2 replicas before step 2 is trained (through ``relax-agent scale``), 2 -> 1 after step 3's
    groups: the new replica's first group carries the latest version, scale-in drains it, and the run
    matches the local one sample for sample."""
    from relax_agent.runtime.ray_rollout import READY, REMOVED

    ctrl = build(tiny_model_dir, tmp_path, "scale", "runtime.rollout_replicas=1")
    calls, gates = gate_trainer(ctrl, (2, 3))
    pool = ctrl.runtime.rollout.pool
    thread, box = run_in_thread(ctrl.train)
    try:
        wait_for(lambda: len(calls) >= 2, 300, "step 2's groups played")
        assert scale_cli(tmp_path, 2)["target"] == 2
        wait_for(lambda: len(pool.in_state(READY)) == 2, 300, "a second ready replica")
        new = next(r for r in pool.in_state(READY) if r.slot == 1)
        gates[2].set()
        wait_for(lambda: len(calls) >= 3, 300, "step 3's groups played")
        assert new.first_group == (2, 2), new.first_group  # pulled version 2 before its first group
        status = scale_cli(tmp_path, 1)
        assert status["target"] == 1
        wait_for(lambda: new.state == REMOVED, 120, "the second replica drained and removed")
        gates[3].set()
        thread.join(600)
        assert "error" not in box, box.get("error")
        events = [(e, name, detail) for _, e, name, detail in pool.events]
    finally:
        for gate in gates.values():
            gate.set()
        ctrl.close()
    assert ("removed", new.name, "drained") in events and not any(e == "failed" for e, _, _ in events)
    assert_every_sample_once(tmp_path, ctrl.bus)
    assert_same_as_local(reference, tmp_path, box["result"])
    assert not (tmp_path / "runtime.json").exists()  # the control endpoint is gone with the run


def test_autoscale_adds_a_replica_while_the_trainer_waits_and_stops_at_its_bound(ray_session, tiny_model_dir,
                                                                                 tmp_path):
    """s = 0: the trainer waits for every step's rollouts, so with any idle time above 1% the autoscaler
    adds a replica after step 2 (step 1 is not judged), and none past ``max_replicas=2``; every sample
    is trained once."""
    steps = 5
    ctrl = build(tiny_model_dir, tmp_path, "autoscale", "runtime.rollout_replicas=1", f"trainer.steps={steps}",
                 "runtime.autoscale.enabled=true", "runtime.autoscale.max_replicas=2",
                 "runtime.autoscale.window_steps=1", "runtime.autoscale.cooldown_steps=0",
                 "runtime.autoscale.scale_up_above=0.01", "runtime.autoscale.scale_down_below=0.0")
    pool = ctrl.runtime.rollout.pool
    try:
        ctrl.train()
        events = [(e, name) for _, e, name, _ in pool.events]
    finally:
        ctrl.close()
    metrics = [m for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
               if "rollout/reward" in (m := json.loads(line))]
    assert [m["runtime/autoscale"] for m in metrics] == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert all(m["runtime/trainer_idle_frac"] > 0.01 for m in metrics[1:2])
    assert [m["runtime/rollout_target"] for m in metrics][2:] == [2.0] * (steps - 2)
    assert [name for e, name in events if e == "started"] == [f"t-autoscale.rollout-{k}.{k}" for k in (0, 1)]
    assert_every_sample_once(tmp_path, ctrl.bus, steps)


SLOW_REWARD_PY = '''
import json, os, time

LOG = {log!r}


def score(item):
    """Length of the reply / 100, after 1 s of "work"; logs start/end per item with this replica's pid."""
    with open(LOG, "a") as f:
        f.write(json.dumps({{"ev": "start", "id": item.id, "pid": os.getpid()}}) + "\\n")
    time.sleep(1.0)
    with open(LOG, "a") as f:
        f.write(json.dumps({{"ev": "end", "id": item.id, "pid": os.getpid()}}) + "\\n")
    return {{"reward": min(len(item.response_text()), 100) / 100.0, "metrics": {{"chars": float(len(item.response_text()))}}}}
'''


def reward_events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_sigkill_of_a_reward_replica_retries_its_items(ray_session, tiny_model_dir, tmp_path):
    """Reward as a Ray Serve deployment with 2 replicas; one is SIGKILLed while it scores items: every
    item it held is scored again by a replica that survives (Serve replaces the dead one), and every
    sample has its real reward with status ok (none is masked, none scored 0)."""
    import socket

    from ray import serve

    from relax_agent.reward_services.ray_serve import APP_NAME, build_app

    log = tmp_path / "reward_calls.jsonl"
    target = tmp_path / "slow_reward.py"
    target.write_text(SLOW_REWARD_PY.format(log=str(log)))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(f"{target}:score", replicas=2, num_cpus_per_replica=0.1), name=APP_NAME, route_prefix="/")
        ctrl = build(tiny_model_dir, tmp_path / "run", "reward", "runtime.rollout_replicas=1", "reward.source=remote",
                     f"reward.url=http://127.0.0.1:{port}")
        thread, box = run_in_thread(ctrl.train)
        try:
            def in_flight():
                events = reward_events(log)
                ended = {(e["id"], e["pid"]) for e in events if e["ev"] == "end"}
                return next((e for e in events if e["ev"] == "start" and (e["id"], e["pid"]) not in ended), None)

            wait_for(lambda: ctrl.step >= 1 and in_flight() is not None, 300, "an item being scored in step 2")
            victim = in_flight()["pid"]
            os.kill(victim, signal.SIGKILL)
            thread.join(600)
            assert "error" not in box, box.get("error")
        finally:
            ctrl.close()
    finally:
        serve.shutdown()
    events = reward_events(log)
    ended = {(e["id"], e["pid"]) for e in events if e["ev"] == "end"}
    lost = {e["id"] for e in events if e["ev"] == "start" and e["pid"] == victim and (e["id"], victim) not in ended}
    assert lost  # the kill hit items in flight...
    rescored = {e["id"] for e in events if e["ev"] == "end" and e["pid"] != victim}
    assert lost <= rescored  # ...and each was scored again elsewhere
    rows = dumped(tmp_path / "run")
    assert len(rows) == STEPS * B * G
    for r in rows:
        assert r["reward_status"] == "ok", r
        assert r["reward"] == pytest.approx(min(r["metrics"]["reward/chars"], 100) / 100.0)


def test_train_cli_starts_its_own_ray_and_resumes(tiny_model_dir, tmp_path):
    """``relax-agent train ... runtime.kind=ray`` in a fresh process: the runtime starts a local Ray
    (``data.ray_num_cpus``), trains 2 steps with 2 replicas and exits 0 (no control endpoint file
    left); ``--resume`` to 3 steps rebuilds the trainer actor from the checkpoint and publishes its
    weights, so step 3's groups are sampled with version 2."""
    import subprocess
    import sys

    out = tmp_path / "run"

    def train(steps, *extra):
        cmd = [sys.executable, "-m", "relax_agent.cli", "train", "examples/tiny.yaml", f"model.path={tiny_model_dir}",
               "env.id=examples.custom_env:examples/Echo-v0", "eval.at_start=false", "eval.at_end=false",
               f"trainer.steps={steps}", "checkpoint.every_steps=0", "logging.tensorboard=false",
               "logging.plot=false", "run.num_threads=1", f"run.output_dir={out}", "mode=async",
               "weights.transport=tcp", "runtime.kind=ray", "runtime.rollout_replicas=2",
               "runtime.trainer_num_cpus=0.25", "data.ray_actor_name=t-cli", "--quiet", *extra]
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert not (out / "runtime.json").exists()
        # a clean run (and its resume) says nothing per actor: no progress bars, no Ray warning about
        # blocking gets, no re-registration of the replicas after a resume, no raylet line about a worker
        # that "died or was killed" (replicas SIGKILLed at the end before Ray had ended them)
        noise = ("blocking ray.get", "no longer knows this subscriber", "Writing model shards", "(RolloutReplica",
                 "A worker died or was killed")
        assert [n for n in noise if n in res.stderr] == [], res.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [m for m in rows if "rollout/reward" in m]

    steps = train(2)
    assert [m["policy_version"] for m in steps] == [1, 2]
    assert [m["runtime/rollout_replicas"] for m in steps] == [2.0, 2.0]
    assert json.loads((out / "summary.json").read_text())["checkpoint"].endswith("step_000002")
    steps = train(3, "--resume")
    assert [(m["step"], m["policy_version"]) for m in steps] == [(1, 1), (2, 2), (3, 3)]
    step3 = [json.loads(line) for line in (out / "rollouts" / "step_000003.jsonl").read_text().splitlines()]
    assert {r["sample_version"] for r in step3} == {2}
