"""Sandbox latency and throughput: a warm SandboxPool vs a cold container per episode, same run.

Measures, for the Docker backend (and the daemon-less backends for comparison):

1. acquire latency: ``pool.acquire()`` from a warm pool vs a cold start (``backend.create()``:
   ``docker create`` + ``start`` with all limits) and vs ``docker run --rm IMAGE true`` (CLI);
2. exec round trip p50 / p99 of a trivial command (``true``) on one sandbox;
3. throughput of ``--episodes`` concurrent episodes, each running ``--execs`` short commands:
   warm pool (sandboxes reset and reused) vs cold (each episode starts and removes its own).

Ratios are against the cold path measured in the same run. Every container is removed at the end.

    python benchmarks/sandbox.py                       # ~1-2 min on a 2-core machine
    python benchmarks/sandbox.py --episodes 32 --execs 10 --rounds 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import time

from relax_agent.sandboxes import PoolConfig, SandboxConfig, SandboxPool


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``xs`` by nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


async def acquire_latency(cfg: SandboxConfig, n: int) -> dict[str, float]:
    backend = cfg.build()
    cold = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await backend.create()
        cold.append(time.perf_counter() - t0)
        await sb.close()
    warm = []
    async with SandboxPool(backend, PoolConfig(size=2, max_size=2)) as pool:
        for _ in range(n):
            t0 = time.perf_counter()
            sb = await pool.acquire()
            warm.append(time.perf_counter() - t0)
            await pool.release(sb)
    cli = []
    if shutil.which("docker") and cfg.backend == "docker":
        for _ in range(max(3, n // 3)):
            t0 = time.perf_counter()
            subprocess.run(["docker", "run", "--rm", "--network", "none", cfg.image, "true"], check=True,
                           capture_output=True)
            cli.append(time.perf_counter() - t0)
    return {"cold_p50_s": statistics.median(cold), "warm_p50_s": statistics.median(warm),
            "warm_p99_s": pct(warm, 0.99), "docker_run_p50_s": statistics.median(cli) if cli else float("nan")}


async def exec_round_trip(cfg: SandboxConfig, rounds: int) -> dict[str, float]:
    async with await cfg.build().create() as sb:
        for _ in range(5):
            await sb.exec(["true"])
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            r = await sb.exec(["true"])
            times.append(time.perf_counter() - t0)
            assert r.ok, r
    return {"p50_s": pct(times, 0.5), "p99_s": pct(times, 0.99)}


async def episode(sb, execs: int, i: int) -> None:
    for k in range(execs):
        r = await sb.exec(["echo", f"{i}-{k}"])
        assert r.stdout == f"{i}-{k}\n", r


async def throughput(cfg: SandboxConfig, episodes: int, execs: int) -> dict[str, float]:
    backend = cfg.build()

    async def cold_one(i: int) -> None:
        async with await backend.create() as sb:
            await episode(sb, execs, i)

    t0 = time.perf_counter()
    await asyncio.gather(*[cold_one(i) for i in range(episodes)])
    cold_s = time.perf_counter() - t0

    pool = SandboxPool(backend, PoolConfig(size=episodes, max_size=episodes))
    t0 = time.perf_counter()
    await pool.start()
    start_s = time.perf_counter() - t0

    async def warm_one(i: int) -> None:
        async with pool.sandbox() as sb:
            await episode(sb, execs, i)

    try:
        await asyncio.gather(*[warm_one(i) for i in range(episodes)])  # round 1 also pays the first resets
        t0 = time.perf_counter()
        await asyncio.gather(*[warm_one(i) for i in range(episodes)])
        warm_s = time.perf_counter() - t0
    finally:
        await pool.close()
    return {"cold_s": cold_s, "warm_s": warm_s, "pool_start_s": start_s,
            "cold_episodes_per_s": episodes / cold_s, "warm_episodes_per_s": episodes / warm_s,
            "warm_execs_per_s": episodes * execs / warm_s}


async def main(args: argparse.Namespace) -> dict[str, object]:
    cfg = SandboxConfig(backend="docker", memory_mb=256, pids_limit=64, ttl_s=600, max_workers=64)
    out: dict[str, object] = {}
    acq = await acquire_latency(cfg, args.acquires)
    out["acquire"] = acq
    print(f"acquire  cold create+start p50 {ms(acq['cold_p50_s'])} | `docker run --rm true` p50 "
          f"{ms(acq['docker_run_p50_s'])} | warm pool p50 {ms(acq['warm_p50_s'])} (p99 {ms(acq['warm_p99_s'])}) "
          f"-> {acq['cold_p50_s'] / acq['warm_p50_s']:.0f}x faster than cold")
    for backend in ("docker", "bubblewrap", "subprocess"):
        if backend == "bubblewrap" and not shutil.which("bwrap"):
            continue
        c = cfg.model_copy(update={"backend": backend, "unsafe": backend == "subprocess"})
        rt = await exec_round_trip(c, args.rounds)
        out[f"exec_{backend}"] = rt
        print(f"exec     {backend:<10} `true` round trip p50 {ms(rt['p50_s'])}  p99 {ms(rt['p99_s'])}  "
              f"({args.rounds} execs)")
    tp = await throughput(cfg, args.episodes, args.execs)
    out["throughput"] = tp
    print(f"episodes {args.episodes} concurrent x {args.execs} execs: cold {tp['cold_s']:.2f} s "
          f"({tp['cold_episodes_per_s']:.1f} ep/s) | warm pool {tp['warm_s']:.2f} s "
          f"({tp['warm_episodes_per_s']:.1f} ep/s, {tp['warm_execs_per_s']:.0f} execs/s) "
          f"-> {tp['cold_s'] / tp['warm_s']:.1f}x; pool start {tp['pool_start_s']:.2f} s")
    return out


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message="sandbox backend 'subprocess'")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--execs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=200, help="execs timed for the round trip")
    parser.add_argument("--acquires", type=int, default=15, help="acquisitions timed per path")
    parser.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
    ns = parser.parse_args()
    result = asyncio.run(main(ns))
    if ns.json:
        print(json.dumps(result))
