"""``runtime: ray`` across hosts: rollout on one vs two worker hosts, what passes through the driver,
and failover of a killed host. Hosts are Linux network namespaces on this machine
(:mod:`tests.e2e.netns_cluster`: 10.78.0.1 the Ray head with the driver, the trainer, the bus and
the weight coordinator; .2 and .3 Ray workers for rollout replicas), so they share its CPUs.

Workload: benchmarks/runtime.py's (the modes Echo task behind a slow tool: every ``env.step`` waits
a lognormal latency, median ``--latency-median-s``; a tiny random llama; async, ``--staleness``
versions of lag), each replica playing at most ``--groups-per-replica`` groups at once, so rollout
capacity is bound by tool slots per host and a second host adds capacity. Prints, in one run:

1. samples/s with 1 replica on one worker host and with 2 replicas spread over both (target >= 1.7x);
2. bytes the driver's bus reads carried per step: token, mask, log-prob, media and route arrays
   (target 0: the trainer actor reads those from the bus itself) and the pickled trajectories the
   loop reads for its metrics and dumps (with the token ids inside them);
3. autoscaling (``--autoscale-steps``): a run that starts with 1 replica and ``runtime.autoscale`` on
   (at most 2): the step after which the autoscaler added the second replica, the replicas serving per
   step, and samples/s once both served;
4. failover: ``--kills`` times, every process of worker host 3 is SIGKILLed while training; seconds
   until a replacement replica is ready on the surviving host (target p50 <= 15 s), after which host
   3 joins again.

    sudo python benchmarks/runtime_hosts.py          # needs root and iproute2; ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]

PREFIX, SUBNET = "rxb", "10.78.0"
ARRAY_FIELDS = ("token_ids", "loss_mask", "rollout_logprobs", "media", "routed_experts", "routes_mask")


class CountingBus:
    """The driver's bus, counting what its reads carried: bytes of the array fields, and the pickled
    size of the trajectory field (and the token ids inside it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.array_bytes = 0
        self.trajectory_bytes = 0
        self.trajectory_tokens = 0

    def get(self, partition: str, fields: Any, consumer: str, batch_size: int, **kw: Any) -> Any:
        batch = self.inner.get(partition, fields, consumer, batch_size, **kw)
        for name, values in batch.fields.items():
            if name in ARRAY_FIELDS:
                self.array_bytes += sum(len(pickle.dumps(v, protocol=5)) for v in values)
            elif name == "trajectory":
                self.trajectory_bytes += sum(len(pickle.dumps(t, protocol=5)) for t in values)
                self.trajectory_tokens += sum(len(t.token_ids) for t in values)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def ray_runtime(args: argparse.Namespace, replicas: int, autoscale: bool = False) -> dict[str, Any]:
    rt = {"kind": "ray", "rollout_replicas": replicas, "trainer_num_cpus": 0.25,
          "max_groups_per_replica": args.groups_per_replica, "rollout_resources": {"rollout_host": 1},
          "rollout_spread": True, "trainer_resources": {"head_host": 0.01}, "heartbeat_interval_s": 0.5,
          "heartbeat_timeout_s": 10.0}
    if autoscale:
        rt["autoscale"] = {"enabled": True, "max_replicas": 2, "window_steps": 2, "cooldown_steps": 1}
    return rt


def build(args: argparse.Namespace, model: str, out: Path, name: str, replicas: int, steps: int | None = None,
          autoscale: bool = False) -> Any:
    import runtime as single_host  # benchmarks/runtime.py: the same workload and config

    from relax_agent.control import build_controller
    from relax_agent.roles import build_run_roles

    cfg = single_host.config(args, model, out, ray_runtime(args, replicas, autoscale), steps)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={
        "ray_address": args.address, "ray_actor_name": f"{PREFIX}-{name}"})})
    ctrl = build_controller(cfg, build_run_roles(cfg))
    ctrl.bus = CountingBus(ctrl.bus)
    return ctrl


def train(ctrl: Any, out: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Run ``ctrl`` to the end; its step rows and the Ray nodes its rollout replicas ran on."""
    from relax_agent.metrics import read_metrics

    try:
        ctrl.train()
        nodes = sorted({r.node_id for r in ctrl.runtime.rollout.pool.replicas if r.node_id})
    finally:
        ctrl.close()
    return [r for r in read_metrics(out / "metrics.jsonl") if "rollout/reward" in r], nodes


def throughput(args: argparse.Namespace, model: str, out: Path, name: str, replicas: int) -> dict[str, Any]:
    ctrl = build(args, model, out, name, replicas)
    rows, nodes = train(ctrl, out)
    wall_s = sum(r["timing/step_s"] for r in rows)
    bus = ctrl.bus
    return {"run": name, "hosts": len(nodes), "steps": len(rows),
            "samples_per_s": len(rows) * args.tasks_per_step * args.group_size / wall_s,
            "array_bytes_per_step": bus.array_bytes / len(rows), "trajectory_bytes_per_step": bus.trajectory_bytes / len(rows),
            "trajectory_tokens_per_step": bus.trajectory_tokens / len(rows)}


def autoscaled(args: argparse.Namespace, model: str, out: Path) -> dict[str, Any]:
    """Start with 1 replica and ``runtime.autoscale`` on (at most 2, window 2 steps, cooldown 1): per step
    the replicas serving, the target, the trainer's idle fraction; samples/s over the steps after the
    target reached 2 (the second replica's start excluded)."""
    rows, nodes = train(build(args, model, out, "autoscaled", 1, steps=args.autoscale_steps, autoscale=True), out)
    full = [r for r in rows if r["runtime/rollout_replicas"] >= 2]
    per_step = args.tasks_per_step * args.group_size
    return {"run": "autoscaled", "hosts": len(nodes), "steps": len(rows),
            "replicas": [r["runtime/rollout_replicas"] for r in rows],
            "target": [r["runtime/rollout_target"] for r in rows],
            "idle": [r.get("runtime/trainer_idle_frac") for r in rows],
            "scaled_up_after_step": next((r["step"] for r in rows if r["runtime/autoscale"] > 0), None),
            "samples_per_s_at_2": len(full) * per_step / sum(r["timing/step_s"] for r in full) if full else None}


def failover(args: argparse.Namespace, model: str, out: Path) -> dict[str, Any]:
    """Kill worker host 3 ``args.kills`` times while training (it joins again after each)."""
    from relax_agent.runtime.ray_rollout import READY
    from tests.e2e.netns_cluster import NetnsCluster

    cluster = NetnsCluster(prefix=PREFIX, subnet=SUBNET, hosts=3, num_cpus=1, worker_resources={"rollout_host": 2},
                           env={"PYTHONPATH": os.pathsep.join([str(REPO), str(BENCH)]), "OMP_NUM_THREADS": "1"},
                           token=os.environ["RAY_AUTH_TOKEN"])
    ctrl = build(args, model, out, "failover", 2, steps=100_000)
    pool = ctrl.runtime.rollout.pool
    ready_s: list[float] = []
    errors: list[BaseException] = []

    def wait(cond: Any, what: str, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"failover benchmark: no {what} within {timeout_s:.0f} s")
            time.sleep(0.05)

    def on_host3() -> list[Any]:
        return [r for r in pool.in_state(READY) if r.node_id == host3_node()]

    def host3_node() -> str | None:
        import ray

        return next((n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == f"{SUBNET}.3"), None)

    def move_to_host3() -> None:
        """SIGKILL a replica that is not on host 3 until its replacement lands there (spread is a preference)."""
        for _ in range(5):
            if on_host3():
                return
            victim = next((r for r in pool.in_state(READY) if r.pid and r.node_id != host3_node()), None)
            if victim is not None:
                os.kill(victim.pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (on_host3() and len(pool.in_state(READY)) == 2):
                time.sleep(0.5)
        raise TimeoutError("failover benchmark: no replica would start on host 3 again")

    def kill_loop() -> None:
        try:
            for k in range(args.kills):
                wait(lambda: len(pool.in_state(READY)) == 2 and ctrl.step >= 1 and on_host3(), "replica on host 3")
                before = {r.name for r in pool.replicas}
                cluster.kill_host(3)
                t0 = time.monotonic()
                wait(lambda before=before: any(r.name not in before and r.state == READY for r in pool.replicas), "replacement")
                ready_s.append(time.monotonic() - t0)
                print(f"kill {k + 1}: replacement ready {ready_s[-1]:.1f} s after host 3 died", flush=True)
                if k + 1 < args.kills:
                    cluster.start_ray(3)  # host 3 comes back; move a replica there for the next kill
                    wait(lambda: host3_node() is not None, "host 3 back in Ray")
                    move_to_host3()
        except BaseException as exc:  # reported after the run stops
            errors.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # the controller's Ctrl-C: a clean stop

    thread = threading.Thread(target=kill_loop, daemon=True)
    thread.start()
    try:
        ctrl.train()
    finally:
        thread.join(60)
        ctrl.close()
    if errors:
        raise errors[0]
    return {"kills": len(ready_s), "ready_s": ready_s, "ready_p50_s": statistics.median(ready_s),
            "ready_max_s": max(ready_s)}


def inner(args: argparse.Namespace) -> None:
    """In the head's namespace: the runs, against the cluster at ``args.address``."""
    import ray

    ray.init(address=args.address, log_to_driver=False)
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            from relax_agent.models import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny", arch="llama", seed=0))
            results["runs"] = [throughput(args, model, Path(tmp) / "one", "one-host", 1),
                               throughput(args, model, Path(tmp) / "two", "two-hosts", 2)]
            if args.autoscale_steps:
                results["autoscaled"] = autoscaled(args, model, Path(tmp) / "autoscaled")
            if args.kills:
                results["failover"] = failover(args, model, Path(tmp) / "failover")
    finally:
        ray.shutdown()
    Path(args.json).write_text(json.dumps(results))


def outer(args: argparse.Namespace) -> None:
    """Build the cluster, run :func:`inner` in the head's namespace, print the results, remove it all."""
    from tests.e2e.netns_cluster import NetnsCluster, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"cannot build the hosts: {why}")
    cluster = NetnsCluster(prefix=PREFIX, subnet=SUBNET, hosts=3, num_cpus=1, worker_resources={"rollout_host": 2},
                           env={"PYTHONPATH": os.pathsep.join([str(REPO), str(BENCH)]), "OMP_NUM_THREADS": "1"},
                           ray_system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3})
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        try:
            cluster.up()
            flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                     if k not in ("inner", "address", "json", "json_out")]
            done = cluster.exec(1, [sys.executable, __file__, "--inner", "--address", cluster.head_address,
                                    "--json", out.name, *flags], cwd=str(REPO))
            if done.returncode != 0:
                raise SystemExit(f"the runs in the head's namespace failed ({done.returncode})")
        finally:
            cluster.down()
        results = json.loads(Path(out.name).read_text())
    one, two = results["runs"]
    print(f"{args.steps} steps x {args.tasks_per_step} groups x {args.group_size} samples, max_staleness "
          f"{args.staleness}, tool latency median {args.latency_median_s} s, {args.groups_per_replica} groups per "
          f"replica; load average {os.getloadavg()[0]:.1f} at the end")
    for r in (one, two):
        print(f"{r['run']:<10} on {r['hosts']} host(s): {r['samples_per_s']:.2f} samples/s; through the driver per step: "
              f"{r['array_bytes_per_step']:.0f} B of token/media/route arrays, {r['trajectory_bytes_per_step'] / 1024:.1f} "
              f"KiB of trajectories ({r['trajectory_tokens_per_step']:.0f} token ids inside)")
    print(f"two worker hosts / one: {two['samples_per_s'] / one['samples_per_s']:.2f}x (target >= 1.7x)")
    if "autoscaled" in results:
        a = results["autoscaled"]
        at2 = "n/a" if a["samples_per_s_at_2"] is None else f"{a['samples_per_s_at_2']:.2f}"
        print(f"autoscaled from 1 replica: target raised after step {a['scaled_up_after_step']}; replicas serving per "
              f"step {[int(x) for x in a['replicas']]}; trainer idle (window mean) "
              f"{[None if x is None else round(x, 2) for x in a['idle']]}; {at2} samples/s once 2 served "
              f"(on {a['hosts']} host(s))")
    if "failover" in results:
        f = results["failover"]
        print(f"host killed -> replacement ready: p50 {f['ready_p50_s']:.1f} s, max {f['ready_max_s']:.1f} s over "
              f"{f['kills']} kills (target p50 <= 15 s): " + ", ".join(f"{s:.1f}" for s in f["ready_s"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--groups-per-replica", type=int, default=2, help="runtime.max_groups_per_replica")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--latency-median-s", type=float, default=2.0)
    p.add_argument("--latency-sigma", type=float, default=0.5)
    p.add_argument("--latency-cap-s", type=float, default=6.0)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--autoscale-steps", type=int, default=10,
                   help="steps of the run that starts with 1 replica under runtime.autoscale (0: skip it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the results here")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner:
        inner(args)
    else:
        outer(args)


if __name__ == "__main__":
    main()
