"""Weight sync: our TCP transport vs a raw loopback socket copy, torch.save/load via a file, and ray.put/get.

Two payloads: the embedded SmolLM2-135M-Instruct state dict (fp32; its tied lm_head is sent
once) and a synthetic 1 GiB one (16 fp32 tensors of 64 MiB). For each, every method moves
the same bytes (our flat layout's size) and takes turns for ``--rounds`` rounds, so load
from other processes hits them alike; the table shows medians.

- raw loopback:  one thread ``sendall``\\ s a contiguous buffer, another ``recv_into``\\ s a
                 pre-allocated one over 127.0.0.1 (the practical limit of any socket transport);
- relax tcp:     ``WeightSync.publish`` over the tcp transport to one engine in this process
                 (subscriber thread, real socket). "transfer" is the subscriber's receive time
                 (bytes on the wire + per-bucket xxh3 checks); "publish" is the whole call:
                 snapshot + checksums, transfer, and the engine's load;
- file:          ``torch.save`` then ``torch.load`` of the state dict through a temporary file;
- ray:           ``ray.put`` then ``ray.get`` (``ray.init(num_cpus=2)``), same process.

Engine pause (time the engine cannot decode while it copies the new weights in) is reported
separately, for tcp and for the in-process transport (colocate).

Run: ``python benchmarks/weight_sync.py [--rounds 3] [--bucket-mb 64] [--skip-smollm] [--synthetic-gb 1]
[--repeats 3 --record docs/results/weight-sync/]``
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch
from run_record import Recorder, add_record_args

from relax_agent.weights import TensorEngine, WeightSyncConfig, build_weight_sync
from relax_agent.weights.meta import FlatSource, bucket_checksums, plan_layout, snapshot_into


def raw_loopback(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Seconds to copy ``src`` into ``dst`` (both [n] uint8) through one 127.0.0.1 TCP connection."""
    server = socket.create_server(("127.0.0.1", 0))

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(memoryview(src.numpy()))

    sender = threading.Thread(target=send)
    start = time.perf_counter()
    sender.start()
    view, pos = memoryview(dst.numpy()), 0
    with socket.create_connection(server.getsockname()) as conn:
        while pos < len(view):
            n = conn.recv_into(view[pos:], len(view) - pos)
            if n == 0:
                raise EOFError("raw loopback: connection closed early")
            pos += n
    elapsed = time.perf_counter() - start
    sender.join()
    server.close()
    return elapsed


def file_round_trip(state: dict[str, torch.Tensor], folder: str) -> float:
    """Seconds for ``torch.save`` + ``torch.load`` of ``state`` through a file in ``folder``."""
    path = os.path.join(folder, "state.pt")
    start = time.perf_counter()
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    elapsed = time.perf_counter() - start
    assert loaded.keys() == state.keys()
    os.remove(path)
    return elapsed


def ray_round_trip(state: dict[str, torch.Tensor]) -> float:
    import ray

    start = time.perf_counter()
    ref = ray.put(state)
    got = ray.get(ref)
    elapsed = time.perf_counter() - start
    assert got.keys() == state.keys()
    del got, ref
    return elapsed


def tied_clone(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A perturbed copy of ``state`` that keeps tensors sharing storage shared (as a trainer's state dict has them)."""
    g = torch.Generator().manual_seed(seed)
    out, seen = {}, {}
    for name, value in state.items():
        key = value.untyped_storage().data_ptr()
        if key not in seen:
            seen[key] = value + torch.rand(value.shape, generator=g) * 1e-3
        out[name] = seen[key]
    return out


def synthetic_state(gb: float) -> dict[str, torch.Tensor]:
    n = int(gb * 2**30) // 4 // 16
    return {f"layers.{i}.weight": torch.empty(n).uniform_(-1, 1) for i in range(16)}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def measure(label: str, state: dict[str, torch.Tensor], engine, rounds: int, bucket_mb: float) -> dict[str, float]:
    """Runs every method ``rounds`` times in turn, prints the table; returns its figures (see ``report``)."""
    tensors, total = plan_layout(state)
    flat = torch.empty(total, dtype=torch.uint8)
    snapshot_into(flat, state, tensors)
    dst = torch.empty_like(flat)
    tcp = build_weight_sync(WeightSyncConfig(transport="tcp", bucket_mb=bucket_mb), [engine])
    inproc = build_weight_sync(WeightSyncConfig(transport="inproc"), [])
    times: dict[str, list[float]] = {k: [] for k in ("raw", "transfer", "publish", "stage", "pause", "file", "ray",
                                                       "inproc_pause")}
    version = 0
    with tempfile.TemporaryDirectory(prefix="wsync-") as folder:
        runs: list[tuple[str, Callable[[], None]]] = []

        def run_tcp() -> None:
            nonlocal version
            version += 1
            stats = tcp.publish(state, version)
            times["transfer"].append(stats.transfer_s)
            times["publish"].append(stats.seconds)
            times["stage"].append(stats.stage_s)
            times["pause"].append(stats.pause_s)

        def run_inproc() -> None:
            nonlocal version
            version += 1
            if not inproc.subscribers:
                inproc.attach(engine)
            times["inproc_pause"].append(inproc.publish(state, version).pause_s)

        runs = [("raw", lambda: times["raw"].append(raw_loopback(flat, dst))), ("tcp", run_tcp),
                ("file", lambda: times["file"].append(file_round_trip(state, folder))),
                ("ray", lambda: times["ray"].append(ray_round_trip(state))), ("inproc", run_inproc)]
        run_tcp()  # warm-up: allocates the snapshot and receive buffers
        raw_loopback(flat, dst)
        for key in ("transfer", "publish", "stage", "pause"):
            times[key].clear()
        for _ in range(rounds):
            for _, fn in runs:
                fn()
    tcp.close()
    inproc.close()
    assert torch.equal(flat, dst)
    return report(label, state, total, times, rounds)


def report(label: str, state: dict[str, torch.Tensor], total: int, times: dict[str, list[float]],
           rounds: int) -> dict[str, float]:
    """Prints the medians; returns GB/s per method and the tcp ratios (``publish``: end to end, ``transfer``:
    the subscriber's receive alone)."""
    gb = total / 1e9
    raw, file_s = median(times["raw"]), median(times["file"])
    rows = [("raw loopback socket copy", raw), ("relax tcp: transfer", median(times["transfer"])),
            ("relax tcp: publish (end to end)", median(times["publish"])), ("torch.save + torch.load (file)", file_s),
            ("ray.put + ray.get", median(times["ray"]))]
    print(f"\n{label}: {len(state)} tensors, {total / 2**20:.1f} MiB moved per sync; medians of {rounds} rounds")
    print(f"{'method':34s} {'seconds':>8s} {'GB/s':>7s} {'vs raw':>7s} {'vs file':>8s}")
    for name, seconds in rows:
        print(f"{name:34s} {seconds:8.3f} {gb / seconds:7.2f} {raw / seconds:6.2f}x {file_s / seconds:7.2f}x")
    print(f"relax tcp publish = stage (snapshot + xxh3) {median(times['stage']):.3f} s + transfer + engine load")
    print(f"engine pause per sync: tcp {median(times['pause']) * 1e3:.1f} ms, "
          f"inproc (colocate) {median(times['inproc_pause']) * 1e3:.1f} ms (separate from transfer time)")
    transfer = median(times["transfer"])
    print(f"targets: tcp transfer >= 0.70x raw loopback: {raw / transfer:.2f}x "
          f"{'PASS' if raw / transfer >= 0.7 else 'FAIL'}; >= 3x file: {file_s / transfer:.2f}x "
          f"{'PASS' if file_s / transfer >= 3 else 'FAIL'}")
    publish = median(times["publish"])
    return {"raw_gbps": gb / raw, "transfer_gbps": gb / transfer, "publish_gbps": gb / publish, "file_gbps": gb / file_s,
            "ray_gbps": gb / median(times["ray"]), "publish_vs_raw": raw / publish, "publish_vs_file": file_s / publish,
            "transfer_vs_raw": raw / transfer, "transfer_vs_file": file_s / transfer}


def checksum_cost(state: dict[str, torch.Tensor]) -> None:
    tensors, total = plan_layout(state)
    flat = torch.empty(total, dtype=torch.uint8)
    snapshot_into(flat, state, tensors)
    source = FlatSource(tensors, total, buffer=flat)
    parts = []
    for algo in ("xxh3", "crc32"):
        start = time.perf_counter()
        bucket_checksums(source, 64 * 2**20, algo)
        parts.append(f"{algo} {total / 1e9 / (time.perf_counter() - start):.2f} GB/s")
    print(f"checksum cost (one core, per side): {', '.join(parts)}")


COUNTS = {
    "smollm_publish_gbps": "SmolLM2-135M fp32 over tcp, end to end (snapshot + checksums, transfer, engine load): GB/s",
    "smollm_transfer_gbps": "the same, the subscriber's receive alone: GB/s",
    "smollm_raw_gbps": "raw loopback socket copy of the same bytes: GB/s",
    "smollm_publish_vs_raw": "tcp end to end / raw loopback copy (speed ratio)",
    "smollm_publish_vs_file": "tcp end to end / torch.save + torch.load through a file (speed ratio)",
    "smollm_transfer_vs_raw": "tcp receive alone / raw loopback copy (speed ratio)",
    "smollm_transfer_vs_file": "tcp receive alone / torch.save + torch.load (speed ratio)",
    "synthetic_publish_gbps": "synthetic 1 GiB fp32 state dict over tcp, end to end: GB/s",
    "synthetic_publish_vs_raw": "synthetic: tcp end to end / raw loopback copy (speed ratio)",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--synthetic-gb", type=float, default=1.0)
    ap.add_argument("--skip-smollm", action="store_true", help="only the synthetic payload")
    add_record_args(ap, repeats=1)
    args = ap.parse_args()
    import ray

    counts = {k: v for k, v in COUNTS.items() if not (args.skip_smollm and k.startswith("smollm_"))}
    if args.synthetic_gb != 1.0:
        counts = {k: v.replace("1 GiB", f"{args.synthetic_gb:g} GiB") for k, v in counts.items()}
    recorder = Recorder.start(args.record, "Weight sync: tcp transport vs raw loopback copy and torch.save/load", counts,
                              args.repeats)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs (shared with other processes: numbers are noisy), "
          f"bucket {args.bucket_mb:g} MiB")
    try:
        smollm = None if args.skip_smollm else load_smollm()
        synthetic = synthetic_state(args.synthetic_gb)
        for _ in range(args.repeats):
            figures: dict[str, float] = {}
            if smollm is not None:
                engine, state = smollm
                one = measure("SmolLM2-135M-Instruct fp32 state dict -> HFEngine", state, engine, args.rounds,
                              args.bucket_mb)
                figures |= {f"smollm_{k}": v for k, v in one.items()}
            one = measure(f"synthetic {args.synthetic_gb:g} GiB fp32 state dict -> TensorEngine", synthetic,
                          TensorEngine(synthetic), args.rounds, args.bucket_mb)
            figures |= {f"synthetic_{k}": v for k, v in one.items()}
            recorder.add_repeat(figures)
        if smollm is not None:
            smollm[0].close()
    finally:
        ray.shutdown()
    recorder.finish()


def load_smollm():
    """The embedded SmolLM2-135M-Instruct in an ``HFEngine`` and a perturbed copy of its state dict to publish."""
    from relax_agent.config import EngineConfig, ModelConfig
    from relax_agent.models import load_policy
    from relax_agent.rollout.engines.hf import HFEngine

    model, tok = load_policy(ModelConfig())
    engine = HFEngine(model, tok, EngineConfig())
    state = tied_clone(model.state_dict(), seed=1)
    checksum_cost(state)
    return engine, state


if __name__ == "__main__":
    main()
