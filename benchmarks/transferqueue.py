"""Data bus: relax-agent's TransferQueue (local and Ray backends) vs the ``transferqueue`` package.

One run, one Ray instance (``num_cpus=4``: the package's ``init`` hangs with fewer than 3),
the systems taking turns for ``--rounds`` rounds (``ours-ray-adopt`` is the Ray backend with
``ray_adopt_values``: the actor owns the values, so rows outlive their producer, at one more
copy per put):

- batch put / get MB/s: ``--rows`` rows x ``--width`` int64 (default 1024 x 4096 = 32 MiB)
  written in one call, then read back by a consumer in one call (ours: ``put`` and
  ``get`` + ``ack``; the package: ``kv_batch_put`` and ``get_meta`` + ``get_data``);
- single-row puts/s: one row (``--width`` int64) per call for ``--single-s`` seconds;
- put -> consume latency p50 / p99: a producer puts one row every ``--gap-ms``, a consumer
  thread waits for it (ours: a blocking ``get``; the package: polling ``get_meta``, its
  blocking mode re-checks every 5 s);
- rows lost after a consumer dies: a consumer takes 64 of 256 rows and dies without
  acknowledging them (ours on Ray and the package: a Ray actor process killed with SIGKILL;
  ours in-process: a thread that exits); another consumer with the same name then drains
  the partition (ours after the 1 s lease expires) and the rows it never sees are counted.

Ours hands out read-only numpy views (no copy in-process, shared memory on Ray); the
package returns torch tensors copied out of its storage units over ZeroMQ.

Run: ``python benchmarks/transferqueue.py [--rounds 3] [--repeats 3 --record docs/results/data-bus/]``. Install the baseline with
``pip install -e .[bench]``; without it the baseline is skipped with a message.
Ratios are against the package measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from run_record import Recorder, add_record_args

from relax_agent.data import DataConfig, FieldSpec, build_transfer_queue
from relax_agent.errors import QueueTimeoutError

LEASE_S = 1.0
LOSS_ROWS, LOSS_TAKEN = 256, 64


class Ours:
    """Adapter for our bus (either backend)."""

    def __init__(self, name: str, backend: str, width: int, adopt: bool = False) -> None:
        self.name, self.width = name, width
        self.tq = build_transfer_queue(DataConfig(backend=backend, lease_timeout_s=LEASE_S, ray_adopt_values=adopt,
                                                  ray_actor_name=f"bench_{name}"))
        self.backend = backend
        self._n = 0

    def partition(self, capacity: int = 1 << 20) -> str:
        self._n += 1
        name = f"p{self._n}"
        self.tq.create_partition(name, capacity, {"x": FieldSpec("int64", (self.width,))})
        return name

    def batch_put(self, part: str, keys: list[str], data: np.ndarray) -> None:
        self.tq.put(part, keys, {"x": data}, group_ids=keys, versions=[0] * len(keys))

    def batch_get(self, part: str, n: int, consumer: str = "bench") -> Any:
        batch = self.tq.get(part, ["x"], consumer, n, timeout_s=60)
        self.tq.ack(batch.lease_id)
        return batch.fields["x"]

    def single_put(self, part: str, key: str, row: np.ndarray) -> None:
        self.tq.put(part, [key], {"x": row[None]}, group_ids=[key], versions=[0])

    def consume_one(self, part: str) -> int:
        batch = self.tq.get(part, ["x"], "latency", 1, timeout_s=60)
        self.tq.ack(batch.lease_id)
        return int(batch.fields["x"][0, 0])

    def clear(self, part: str) -> None:
        self.tq.clear(part)

    def lost_after_consumer_dies(self) -> int:
        part = self.partition()
        keys = [f"{part}-k{i}" for i in range(LOSS_ROWS)]
        self.batch_put(part, keys, np.zeros((LOSS_ROWS, self.width), np.int64))
        if self.backend == "ray":
            victim = OursVictim.remote(self.tq)
            assert ray.get(victim.take.remote(part, LOSS_TAKEN)) == LOSS_TAKEN
            os.kill(ray.get(victim.pid.remote()), signal.SIGKILL)
        else:
            thread = threading.Thread(target=lambda: self.tq.get(part, ["x"], "trainer", LOSS_TAKEN))
            thread.start()
            thread.join()
        seen: set[str] = set()
        while True:
            try:
                batch = self.tq.get(part, ["x"], "trainer", 1, timeout_s=LEASE_S + 2)
            except QueueTimeoutError:
                break
            seen.update(batch.sample_ids)
            self.tq.ack(batch.lease_id)
        self.clear(part)
        return LOSS_ROWS - len(seen)


@ray.remote(num_cpus=0)
class OursVictim:
    """A consumer process of our Ray bus that takes rows and is then killed."""

    def __init__(self, tq: Any) -> None:
        self.tq = tq

    def pid(self) -> int:
        return os.getpid()

    def take(self, part: str, n: int) -> int:
        return len(self.tq.get(part, ["x"], "trainer", n, timeout_s=60))


class Package:
    """Adapter for the ``transferqueue`` package (SimpleStorage, 2 storage units, polling mode)."""

    name = "transferqueue"

    def __init__(self, width: int) -> None:
        import torch
        import transfer_queue
        from omegaconf import OmegaConf
        from tensordict import TensorDict

        self.torch, self.tqp, self.TensorDict, self.width = torch, transfer_queue, TensorDict, width
        transfer_queue.init(OmegaConf.create({"controller": {"polling_mode": True}}))
        self.client = transfer_queue.get_client()
        self._n = 0

    def partition(self, capacity: int = 0) -> str:
        self._n += 1
        return f"p{self._n}"

    def batch_put(self, part: str, keys: list[str], data: np.ndarray) -> None:
        fields = self.TensorDict({"x": self.torch.from_numpy(data)}, batch_size=len(keys))
        self.tqp.kv_batch_put(keys=keys, partition_id=part, fields=fields)

    def _fetch(self, part: str, n: int, task: str) -> Any:
        while True:
            meta = self.client.get_meta(data_fields=["x"], batch_size=n, partition_id=part, mode="fetch",
                                        task_name=task)
            if meta.size:
                return self.client.get_data(meta)["x"]

    def batch_get(self, part: str, n: int) -> Any:
        return self._fetch(part, n, "bench")

    def single_put(self, part: str, key: str, row: np.ndarray) -> None:
        self.tqp.kv_put(key=key, partition_id=part, fields={"x": self.torch.from_numpy(row)})

    def consume_one(self, part: str) -> int:
        return int(self._fetch(part, 1, "latency")[0, 0])

    def clear(self, part: str) -> None:
        self.client.clear_partition(part)

    def lost_after_consumer_dies(self) -> int:
        part = self.partition()
        keys = [f"{part}-k{i}" for i in range(LOSS_ROWS)]
        self.batch_put(part, keys, np.zeros((LOSS_ROWS, self.width), np.int64))
        victim = PackageVictim.remote()
        assert ray.get(victim.take.remote(part, LOSS_TAKEN)) == LOSS_TAKEN
        os.kill(ray.get(victim.pid.remote()), signal.SIGKILL)
        seen = 0
        deadline = time.monotonic() + LEASE_S + 2
        while time.monotonic() < deadline:  # as long as ours waits for re-delivery
            meta = self.client.get_meta(data_fields=["x"], batch_size=1, partition_id=part, mode="fetch",
                                        task_name="trainer")
            if meta.size:
                self.client.get_data(meta)
                seen += meta.size
            else:
                time.sleep(0.01)
        self.clear(part)
        return LOSS_ROWS - seen


@ray.remote(num_cpus=0)
class PackageVictim:
    """A consumer process of the package that fetches rows and is then killed."""

    def __init__(self) -> None:
        import transfer_queue

        transfer_queue.init()
        self.client = transfer_queue.get_client()

    def pid(self) -> int:
        return os.getpid()

    def take(self, part: str, n: int) -> int:
        meta = self.client.get_meta(data_fields=["x"], batch_size=n, partition_id=part, mode="fetch",
                                    task_name="trainer")
        self.client.get_data(meta)
        return meta.size


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def batch_round(bus: Any, rows: int, width: int) -> tuple[float, float]:
    """(put s, get s) for one batch of ``rows`` x ``width`` int64."""
    part = bus.partition()
    data = np.random.default_rng(time.perf_counter_ns()).integers(0, 1 << 30, (rows, width), dtype=np.int64)
    keys = [f"{part}-b{i}" for i in range(rows)]
    put_s = timed(lambda: bus.batch_put(part, keys, data))
    got = []
    get_s = timed(lambda: got.append(bus.batch_get(part, rows)))
    rows_got = [np.asarray(r) for r in (got[0].unbind() if getattr(got[0], "is_nested", False) else got[0])]
    # the package may hand rows out in another order than they were put (it reuses freed indexes)
    assert sorted(int(r[0]) for r in rows_got) == sorted(data[:, 0].tolist()), bus.name
    assert all(len(r) == width for r in rows_got) and sum(int(r[-1]) for r in rows_got) == int(data[:, -1].sum())
    bus.clear(part)
    return put_s, get_s


def single_round(bus: Any, width: int, seconds: float) -> float:
    """Single-row puts per second."""
    pool = [np.full(width, i, np.int64) for i in range(64)]
    part = bus.partition()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        bus.single_put(part, f"{part}-r{n}", pool[n % 64])
        n += 1
    rate = n / (time.perf_counter() - start)
    bus.clear(part)
    return rate


def latency_round(bus: Any, width: int, n: int, gap_s: float) -> list[float]:
    """Seconds from the start of each put to the consumer holding the row."""
    part = bus.partition()
    sent: dict[int, float] = {}
    latencies: list[float] = []

    def consumer() -> None:
        for _ in range(n):
            i = bus.consume_one(part)
            latencies.append(time.perf_counter() - sent[i])

    thread = threading.Thread(target=consumer)
    thread.start()
    for i in range(n):
        row = np.full(width, i, np.int64)
        sent[i] = time.perf_counter()
        bus.single_put(part, f"{part}-l{i}", row)
        time.sleep(gap_s)
    thread.join()
    bus.clear(part)
    return latencies


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds in which the systems take turns")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--width", type=int, default=4096, help="int64 values per row")
    parser.add_argument("--single-s", type=float, default=1.0, help="seconds of single-row puts per round")
    parser.add_argument("--latency-n", type=int, default=100, help="rows per latency round")
    parser.add_argument("--gap-ms", type=float, default=10.0, help="pause between latency puts")
    add_record_args(parser, repeats=1)
    args = parser.parse_args()
    os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")  # the package warns on every get on a 2-core machine
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    systems: list[Any] = [Ours("ours-local", "local", args.width), Ours("ours-ray", "ray", args.width),
                          Ours("ours-ray-adopt", "ray", args.width, adopt=True)]
    try:
        systems.append(Package(args.width))
    except ImportError as exc:
        print(f"baseline skipped: the transferqueue package is not installed ({exc}); "
              "pip install -e .[bench] to compare")
    mb = args.rows * args.width * 8 / 1e6
    for bus in systems:  # warm-up: connections, actor start, first allocation
        batch_round(bus, 16, args.width)
        single_round(bus, args.width, 0.1)
    baseline = any(bus.name == "transferqueue" for bus in systems)
    recorder = Recorder.start(args.record, "Data bus (local and Ray backends) against the transferqueue package",
                              COUNTS if baseline else {}, args.repeats)
    for _ in range(args.repeats):
        res = measure(systems, args, mb)
        lost = {bus.name: bus.lost_after_consumer_dies() for bus in systems}
        recorder.add_repeat(report(res, lost, args, mb))
    for bus in systems:
        if hasattr(bus, "tq"):
            bus.tq.close()
    ray.shutdown()
    recorder.finish()


COUNTS = {
    "ray_put_x": "Ray bus (shared memory) batch put MB/s / the package's",
    "ray_get_x": "Ray bus batch get MB/s / the package's",
    "ray_single_x": "Ray bus single-row puts/s / the package's",
    "local_put_x": "in-process bus (returns read-only views) batch put MB/s / the package's",
    "local_get_x": "in-process bus batch get MB/s / the package's",
    "local_single_x": "in-process bus single-row puts/s / the package's",
    "ray_lost": "rows lost by the Ray bus after a consumer holding 64 of 256 rows is killed",
}


def measure(systems: list[Any], args: argparse.Namespace, mb: float) -> dict[str, dict[str, list[float]]]:
    """``--rounds`` rounds in which the systems take turns: per system, put/get MB/s, 1-row puts/s, latencies (s)."""
    res: dict[str, dict[str, list[float]]] = {s.name: {"put": [], "get": [], "single": [], "lat": []} for s in systems}
    for _ in range(args.rounds):
        for bus in systems:
            put_s, get_s = batch_round(bus, args.rows, args.width)
            res[bus.name]["put"].append(mb / put_s)
            res[bus.name]["get"].append(mb / get_s)
            res[bus.name]["single"].append(single_round(bus, args.width, args.single_s))
            res[bus.name]["lat"].extend(latency_round(bus, args.width, args.latency_n, args.gap_ms / 1e3))
    return res


def report(res: dict[str, dict[str, list[float]]], lost: dict[str, int], args: argparse.Namespace,
           mb: float) -> dict[str, float]:
    """Prints the table of one repeat; returns each system's medians and, with the baseline, the ratios to it."""
    print(f"{args.rows} x {args.width} int64 = {mb:.1f} MB per batch; {args.rounds} rounds; "
          f"{os.cpu_count()} CPUs; Ray num_cpus=4; lease {LEASE_S:g} s; medians over rounds")
    print(f"{'system':<15} {'put MB/s':>9} {'get MB/s':>9} {'1-row puts/s':>13} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'lost':>5} {'x put':>6} {'x get':>7} {'x 1-row':>8} {'x p50':>6}")
    med = {name: {k: statistics.median(v) if k != "lat" else pct(v, 0.5) for k, v in r.items()} for name, r in res.items()}
    base = med.get("transferqueue")
    figures: dict[str, float] = {}
    for name, m in med.items():
        ratios = (f"{m['put'] / base['put']:>6.1f} {m['get'] / base['get']:>7.1f} {m['single'] / base['single']:>8.1f} "
                  f"{base['lat'] / m['lat']:>6.1f}") if base else ""
        print(f"{name:<15} {m['put']:>9.0f} {m['get']:>9.0f} {m['single']:>13.0f} {m['lat'] * 1e3:>7.2f} "
              f"{pct(res[name]['lat'], 0.99) * 1e3:>7.2f} {lost[name]:>5} {ratios}")
        key = name.removeprefix("ours-").replace("-", "_")
        figures |= {f"{key}_put_mbps": m["put"], f"{key}_get_mbps": m["get"], f"{key}_single_per_s": m["single"],
                    f"{key}_p50_ms": m["lat"] * 1e3, f"{key}_lost": float(lost[name])}
        if base:
            figures |= {f"{key}_put_x": m["put"] / base["put"], f"{key}_get_x": m["get"] / base["get"],
                        f"{key}_single_x": m["single"] / base["single"], f"{key}_p50_x": base["lat"] / m["lat"]}
    print(f"lost: of {LOSS_ROWS} rows, {LOSS_TAKEN} taken by a consumer that died; x p50 = baseline p50 / ours")
    return figures


if __name__ == "__main__":
    main()
