"""``runtime: ray`` on three hosts: Linux network namespaces on this machine (issue 25, item 6).

:mod:`tests.e2e.netns_cluster` builds the hosts (10.77.0.1 the Ray head, .2 and .3 Ray workers with
the custom resource ``rollout_host``), Ray with token authentication. ``relax-agent train`` runs in
the head's namespace with ``data.ray_address`` = the head: the trainer asks for ``head_host`` (the
head), the replicas for ``rollout_host`` (the workers, spread), the bus and the weight coordinator
stay with the driver. A fourth namespace on the same bridge, outside Ray, is the stranger.

The tiny Echo run of ``test_runtime_ray`` (2 groups of 4 per step), async ``max_staleness: 1``.
Every sample id is counted through the rollout dumps; placement through ``placement.jsonl``.
Needs root and ``ip``; without them every test skips naming why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("ray")

from tests.e2e.netns_cluster import NetnsCluster, unavailable  # noqa: E402
from tests.fixtures import wait_for  # noqa: E402

WHY = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")]
REPO = Path(__file__).resolve().parents[2]
B, G = 2, 4
HEAD, WORKERS, STRANGER = "10.77.0.1", {"10.77.0.2", "10.77.0.3"}, 4


@pytest.fixture(scope="module")
def cluster():
    c = NetnsCluster(prefix="rxt", subnet="10.77.0", hosts=3, num_cpus=1, object_store_bytes=200_000_000,
                     worker_resources={"rollout_host": 2}, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                     ray_system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3})
    try:
        c.up()
        c.add_host(STRANGER)  # on the bridge, not in Ray
        yield c
    finally:
        c.down()


def run_args(tiny_model_dir, out: Path, steps: int) -> list[str]:
    """``relax-agent train`` of the tiny Echo run, async over tcp, whatever the runtime."""
    return [str(Path(sys.executable).with_name("relax-agent")), "train", str(REPO / "examples/tiny.yaml"),
            f"model.path={tiny_model_dir}", "env.id=examples.custom_env:examples/Echo-v0", "eval.at_start=false",
            "eval.at_end=false", "logging.tensorboard=false", "logging.plot=false", "checkpoint.every_steps=0",
            f"run.output_dir={out}", "run.num_threads=1", "engine.max_batch_size=1", "mode=async", "max_staleness=1",
            "weights.transport=tcp", f"trainer.steps={steps}", f"rollout.tasks_per_step={B}",
            f"rollout.group_size={G}"]


def train(cluster, tiny_model_dir, out: Path, name: str, steps: int, *overrides: str,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """``relax-agent train`` in the head's namespace (the driver), in the background (``env``: added to
    the driver's environment only)."""
    cmd = [*run_args(tiny_model_dir, out, steps), "runtime.kind=ray", "runtime.rollout_replicas=2",
           "runtime.trainer_num_cpus=0.25", "runtime.heartbeat_interval_s=0.5", "runtime.heartbeat_timeout_s=10",
           f"data.ray_address={cluster.head_address}", f"data.ray_actor_name=rxt-{name}",
           'runtime.rollout_resources={"rollout_host": 1}', "runtime.rollout_spread=true",
           'runtime.trainer_resources={"head_host": 0.01}', "runtime.control_host=0.0.0.0", *overrides, "--quiet"]
    with open(out.parent / f"{name}.log", "w") as log:  # the child keeps its own copy of the descriptor
        return cluster.popen(1, cmd, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT,
                             env={**cluster.ray_env(), **(env or {})})


REWARD_HOST, REWARD_PORT, REWARD_TOKEN_ENV = 2, 18301, "RXT_REWARD_TOKEN"
_REWARD = """
def score(item):
    # 0.25 or 0.75 by the reply's length: values the Echo env never gives
    return 0.25 + 0.5 * (len(item.response_text()) % 2)
"""


def serve_reward(cluster, folder: Path, token: str) -> subprocess.Popen:
    """A reward service on worker host 2 (uvicorn, bound to that host's address, token required); returns
    once it answers on its port."""
    (folder / "rxt_reward.py").write_text(_REWARD)
    log = folder / "reward.log"
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = cluster.popen(REWARD_HOST, [str(Path(sys.executable).with_name("relax-agent")), "serve-reward",
                                           str(folder / "rxt_reward.py") + ":score", "--host", cluster.ip(REWARD_HOST),
                                           "--port", str(REWARD_PORT), "--token-env", REWARD_TOKEN_ENV],
                             cwd=str(folder), env={**cluster.ray_env(), REWARD_TOKEN_ENV: token},
                             stdout=out, stderr=subprocess.STDOUT)
    wait_for(lambda: "Uvicorn running" in log.read_text(), 60, "the reward service on host 2", proc)
    return proc


def finish(proc: subprocess.Popen, out: Path, timeout_s: float = 300.0) -> None:
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    log = (out.parent / f"{out.name}.log").read_text() if (out.parent / f"{out.name}.log").exists() else ""
    assert rc == 0, f"relax-agent train exited {rc}:\n{log[-4000:]}"


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def dumped(out: Path) -> list[dict]:
    return [row for f in sorted((out / "rollouts").glob("step_*.jsonl")) for row in jsonl(f)]


def assert_every_sample_trained_once(out: Path, steps: int) -> list[dict]:
    """0 lost, 0 trained twice, staleness within 1. With ``max_staleness: 1`` a group that waited past the
    bound is dropped (dumped with ``dropped_stale``, never trained) and the loop draws another group, so:
    no sample id is dumped twice, ``steps x B x G`` rows were taken by steps, every one within the bound, and the
    first ``steps`` draws are complete (each of their ids trained or dropped stale: none vanished)."""
    rows = dumped(out)
    ids = Counter(r["sample_id"] for r in rows)
    assert [i for i, n in ids.items() if n > 1] == []
    trained = [r for r in rows if not r["dropped_stale"]]  # taken by a step (a uniform group's rows have no gradient)
    assert len(trained) == steps * B * G
    assert all(0 <= r["trained_at_version"] - r["sample_version"] <= 1 for r in trained)
    assert all(r["trained_at_version"] - r["sample_version"] > 1 for r in rows if r["dropped_stale"])
    missing = {f"s{k}/g{g}/{i}" for k in range(steps) for g in range(B) for i in range(G)} - set(ids)
    assert missing == set()
    assert [m["step"] for m in jsonl(out / "metrics.jsonl") if "rollout/reward" in m] == list(range(1, steps + 1))
    return trained


_STRANGER = r"""
import json, socket, struct, sys, time
import httpx
url, weights = sys.argv[1], sys.argv[2]
out = {}
# the controller: no token, then a guessed one
out["scale_no_token"] = httpx.post(url + "/scale", json={"rollout": 1}, timeout=10).status_code
out["scale_wrong_token"] = httpx.post(url + "/scale", json={"rollout": 1}, timeout=10,
                                      headers={"Authorization": "Bearer guess"}).status_code
out["status_no_token"] = httpx.get(url + "/status", timeout=10).status_code
# the reward service on a worker host: no token
out["reward_no_token"] = httpx.post(sys.argv[4] + "/v1/reward", json={"items": []}, timeout=10).status_code
# the weight server: answer its challenge wrongly, then ask for version 1 from bucket 0
host, port = weights.rsplit(":", 1)
with socket.create_connection((host, int(port)), timeout=10) as conn:
    magic = conn.recv(4)
    conn.recv(64)
    conn.sendall(b"RLXW" + b"\0" * 32 + struct.pack("!4sqq", b"RLXW", 1, 0))
    got = b""
    try:
        while chunk := conn.recv(65536):
            got += chunk
    except OSError:  # reset: closed without a byte
        pass
out["weights_challenge"] = magic.decode()
out["weights_bytes_after_wrong_answer"] = len(got)
# Ray itself: joining the cluster without its token
import ray
t0 = time.monotonic()
try:
    ray.init(address=sys.argv[3], log_to_driver=False)
    out["joined_ray"] = True
    ray.shutdown()
except Exception as exc:
    out["joined_ray"] = False
    out["ray_error"] = type(exc).__name__
out["ray_refused_after_s"] = round(time.monotonic() - t0, 1)
print(json.dumps(out))
"""


def test_async_staleness_one_across_three_hosts_and_a_stranger_is_refused(cluster, tiny_model_dir, tmp_path):
    """Trainer on the head, replicas on both workers; every sample trained once within the bound; a
    process on a fourth host (same subnet, not in Ray, no token) is refused by the controller, the
    weight server and Ray, and the run does not notice it."""
    out = tmp_path / "run"
    steps = 8
    token = "rxt-" + os.urandom(8).hex()
    reward = serve_reward(cluster, tmp_path, token)
    reward_url = f"http://{cluster.ip(REWARD_HOST)}:{REWARD_PORT}"
    proc = train(cluster, tiny_model_dir, out, "run", steps, "reward.source=remote", f"reward.url={reward_url}",
                 f"reward.token_env={REWARD_TOKEN_ENV}", env={REWARD_TOKEN_ENV: token})
    try:
        info = wait_for(lambda: (out / "runtime.json").exists() and json.loads((out / "runtime.json").read_text()),
                        240, "the control endpoint", proc)
        trainer = wait_for(lambda: [p for p in jsonl(out / "placement.jsonl") if p["role"] == "trainer"], 60,
                           "the trainer's placement", proc)[0]
        assert info["url"].startswith(f"http://{HEAD}:")  # 0.0.0.0 bound, the driver's node advertised
        probe = cluster.exec(STRANGER, [sys.executable, "-c", _STRANGER, info["url"], trainer["weights_address"],
                                        cluster.head_address, reward_url],
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                             timeout=180)
        assert probe.returncode == 0, probe.stderr[-3000:]
        stranger = json.loads(probe.stdout.strip().splitlines()[-1])
    finally:
        try:
            finish(proc, out)
        finally:
            reward.terminate()
            reward.wait(30)
    assert stranger["scale_no_token"] == stranger["scale_wrong_token"] == stranger["status_no_token"] == 401
    assert stranger["reward_no_token"] == 401
    assert stranger["weights_challenge"] == "RLXN" and stranger["weights_bytes_after_wrong_answer"] == 0
    assert stranger["joined_ray"] is False, stranger
    assert_every_sample_trained_once(out, steps)
    placed = jsonl(out / "placement.jsonl")
    assert [p["node_ip"] for p in placed if p["role"] == "trainer"] == [HEAD]
    assert trainer["weights_address"].startswith(f"{HEAD}:")  # the trainer's node, resolved in the actor
    rollout = [p for p in placed if p["role"] == "rollout"]
    assert len(rollout) == 2 and {p["node_ip"] for p in rollout} == WORKERS, rollout  # one per worker host
    metrics = [m for m in jsonl(out / "metrics.jsonl") if "rollout/reward" in m]
    assert all(m["runtime/rollout_restarts"] == 0 and m["runtime/trainer_restarts"] == 0 for m in metrics)
    # every episode was scored by the service on host 2, reached from the replicas on hosts 2 and 3 with the
    # token the driver handed them (their hosts' Ray processes do not have it)
    rows = dumped(out)
    assert {r["reward"] for r in rows} <= {0.25, 0.75} and {r["reward_status"] for r in rows} == {"ok"}
    print(f"\nstranger: {stranger}")


def test_staleness_zero_across_hosts_trains_the_same_samples_as_one_host(cluster, tiny_model_dir, tmp_path):
    """``max_staleness: 0`` with the replicas on two worker hosts and the trainer on the head gives the
    same sample ids, policy versions and rewards as the same run under ``runtime: local`` in one
    process on this host (each run in a fresh process with ``OMP_NUM_THREADS=1``, as Ray starts its
    workers): on-policy stays exactly on-policy across hosts."""
    steps = 4
    local = tmp_path / "local"
    done = subprocess.run([*run_args(tiny_model_dir, local, steps), "max_staleness=0", "--quiet"], cwd=str(REPO),
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "hosts"
    finish(train(cluster, tiny_model_dir, out, "hosts", steps, "max_staleness=0"), out)
    key = lambda r: (r["sample_id"], r["sample_version"], r["trained_at_version"], r["reward"])  # noqa: E731
    across, one = sorted(map(key, dumped(out))), sorted(map(key, dumped(local)))
    assert len(one) == steps * B * G and across == one
    assert {r["sample_version"] for r in dumped(out)} == set(range(steps))  # step k sampled with version k
    assert {p["node_ip"] for p in jsonl(out / "placement.jsonl") if p["role"] == "rollout"} == WORKERS


def test_autoscale_adds_a_replica_on_the_other_worker_host_while_the_trainer_waits(cluster, tiny_model_dir,
                                                                                     tmp_path):
    """One replica to start, ``runtime.autoscale`` on (at most 2; s = 0, so the trainer waits for every
    step's rollouts): after step 2 the autoscaler adds a replica, which Ray spreads to the other worker
    host; none is added past the bound, and every sample is trained once."""
    out = tmp_path / "autoscale"
    steps = 40  # ~1 s a step: the run outlives the second replica's start on its host
    proc = train(cluster, tiny_model_dir, out, "autoscale", steps, "max_staleness=0", "runtime.rollout_replicas=1",
                 "runtime.autoscale.enabled=true", "runtime.autoscale.max_replicas=2",
                 "runtime.autoscale.window_steps=1", "runtime.autoscale.cooldown_steps=0",
                 "runtime.autoscale.scale_up_above=0.01", "runtime.autoscale.scale_down_below=0.0")
    try:
        wait_for(lambda: len([p for p in jsonl(out / "placement.jsonl") if p["role"] == "rollout"]) == 2, 300,
                 "the autoscaled second replica", proc)
    finally:
        finish(proc, out)
    assert_every_sample_trained_once(out, steps)
    metrics = [m for m in jsonl(out / "metrics.jsonl") if "rollout/reward" in m]
    assert [m["runtime/autoscale"] for m in metrics] == [0.0, 1.0] + [0.0] * (steps - 2)
    assert [m["runtime/rollout_target"] for m in metrics][2:] == [2.0] * (steps - 2)
    rollout = [p for p in jsonl(out / "placement.jsonl") if p["role"] == "rollout"]
    assert len(rollout) == 2 and {p["node_ip"] for p in rollout} == WORKERS, rollout
    assert metrics[-1]["runtime/rollout_replicas"] == 2.0


def test_a_worker_host_killed_mid_run_loses_no_sample_and_trains_none_twice(cluster, tiny_model_dir, tmp_path):
    """Every process of host 3 is SIGKILLed after step 2: its replica is replaced on host 2, the run
    ends with every sample id trained exactly once. Runs last: it leaves the cluster one host short."""
    out = tmp_path / "kill"
    # ~1.5 s a step: 60 steps outlive node-death detection and the replacement's start (~10-40 s, longer
    # with both cores busy); the test waits for a step that counts the replacement while the run lives
    steps = 60
    proc = train(cluster, tiny_model_dir, out, "kill", steps)
    try:
        wait_for(lambda: {p["node_ip"] for p in jsonl(out / "placement.jsonl") if p["role"] == "rollout"} == WORKERS,
                 240, "a replica on each worker host", proc)
        wait_for(lambda: any(m.get("step", 0) >= 2 for m in jsonl(out / "metrics.jsonl")), 120, "step 2", proc)
        killed_at = time.time()
        killed = cluster.kill_host(3)
        assert killed and cluster.pids(cluster.ns(3)) == []
        wait_for(lambda: [p for p in jsonl(out / "placement.jsonl") if p["role"] == "rollout"
                          and p["time"] > killed_at], 240, "the replacement replica", proc)
        replaced_at = time.time()
        back = wait_for(lambda: [m for m in jsonl(out / "metrics.jsonl") if m.get("time", 0) > replaced_at
                                 and m.get("runtime/rollout_replicas") == 2.0], 120,
                        "a step served by 2 replicas again", proc)
    finally:
        finish(proc, out)
    assert_every_sample_trained_once(out, steps)
    after = [p for p in jsonl(out / "placement.jsonl") if p["role"] == "rollout" and p["time"] > killed_at]
    assert after and {p["node_ip"] for p in after} == {"10.77.0.2"}, after  # replaced on the surviving host
    metrics = [m for m in jsonl(out / "metrics.jsonl") if "rollout/reward" in m]
    assert metrics[-1]["runtime/rollout_restarts"] >= 1
    assert back[0]["runtime/rollout_replicas"] == 2.0 and metrics[-1]["runtime/rollout_replicas"] == 2.0
    print(f"\nkilled {len(killed)} processes of host 3; replacement ready "
          f"{min(p['time'] for p in after) - killed_at:.1f} s after the kill")


def test_a_host_that_joins_the_running_cluster_gets_a_replica_with_the_latest_weights(cluster, tiny_model_dir,
                                                                                      tmp_path):
    """The replicas fill every ``rollout_host`` slot of the live worker hosts; host 5 joins the Ray cluster
    mid-run and ``relax-agent scale --rollout N+1`` (from the head, through the controller endpoint)
    starts one more replica, which can only go to host 5: it pulls the current policy version over tcp
    from the trainer on the head before it serves, and the run trains every sample once."""
    workers = [n for n in cluster.wait_nodes(1) if "rollout_host" in n["Resources"]]
    slots = int(sum(n["Resources"]["rollout_host"] for n in workers))
    out = tmp_path / "join"
    # The run must outlive the join and the new replica's first start on host 5. With both cores busy that took
    # 22 s, while the loop went from step 1 to step 40: 48 steps left a margin of 8, 160 leaves ~120
    steps = 160
    proc = train(cluster, tiny_model_dir, out, "join", steps, f"runtime.rollout_replicas={slots}")
    try:
        wait_for(lambda: len([p for p in jsonl(out / "placement.jsonl") if p["role"] == "rollout"]) == slots, 240,
                 f"{slots} replicas", proc)
        wait_for(lambda: any(m.get("step", 0) >= 1 for m in jsonl(out / "metrics.jsonl")), 120, "step 1", proc)
        cluster.join_host(5)
        joined_at = time.time()
        scale = cluster.exec(1, [str(Path(sys.executable).with_name("relax-agent")), "scale", str(out), "--rollout",
                                 str(slots + 1)], capture_output=True, text=True, timeout=60)
        assert scale.returncode == 0, scale.stdout + scale.stderr
        new = wait_for(lambda: [p for p in jsonl(out / "placement.jsonl") if p["role"] == "rollout"
                                and p["time"] > joined_at], 120, "the new replica", proc)
        # The loop's version when the replica was asked for: it pulls after the request, so what it serves is at
        # least that new (versions only grow). The loop goes on training while the replica loads its weights and
        # warms up (two versions under load), so the version at its ready time would bound the load, not the pull.
        version_then = max((m["policy_version"] for m in jsonl(out / "metrics.jsonl")
                            if "policy_version" in m and m.get("time", 0) <= joined_at), default=0)
    finally:
        finish(proc, out)
    assert [p["node_ip"] for p in new] == ["10.77.0.5"], new
    assert new[0]["policy_version"] >= max(version_then, 1)  # pulled across hosts before it served
    assert_every_sample_trained_once(out, steps)
    metrics = [m for m in jsonl(out / "metrics.jsonl") if "rollout/reward" in m]
    assert metrics[-1]["runtime/rollout_replicas"] == slots + 1
    print(f"\nhost 5 joined; its replica ready {new[0]['time'] - joined_at:.1f} s later at policy version "
          f"{new[0]['policy_version']} (the loop was at {version_then})")
