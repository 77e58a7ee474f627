"""Reward-service throughput and latency: RewardClient vs a naive one-request-per-sample loop.

Serves a trivial reward with ``relax-agent serve-reward`` on 127.0.0.1 (one uvicorn worker),
then for 1, 16 and 64 concurrent callers -- each scoring one sample at a time, as rollout
workers do -- measures samples/s and p50/p99 latency per sample for

- naive:     one shared ``httpx.AsyncClient``, one POST per sample, no retries;
- client:    :class:`RewardClient` without micro-batching (one request per call);
- client+mb: :class:`RewardClient` with micro-batching (concurrent calls share requests).

``requests`` counts the HTTP requests sent, warm-up included.

Run: ``python benchmarks/reward_service.py [--seconds 1] [--rounds 3] [--callers 1 16 64]``.
The three modes take turns for ``--rounds`` rounds of ``--seconds`` each per caller count (so
load from other processes hits them alike); rates and percentiles pool the rounds. Ratios
are against the naive loop measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable

import httpx

from relax_agent.reward_services import RewardClient, RewardItem
from relax_agent.reward_services.testing import ServiceProcess

THIS = os.path.abspath(__file__)


def trivial_reward(id: str) -> float:
    """The served reward: constant, so the numbers measure the service path alone."""
    return 1.0


Score = Callable[[RewardItem], Awaitable[float | None]]


async def run_cell(score: Score, callers: int, seconds: float, warmup_s: float) -> list[float]:
    """Per-sample latencies (s) of ``callers`` loops calling ``score`` for ``seconds`` after warm-up."""
    latencies: list[float] = []
    measure_from = time.perf_counter() + warmup_s
    end = measure_from + seconds

    async def caller(c: int) -> None:
        k = 0
        while (now := time.perf_counter()) < end:
            item = RewardItem(id=f"c{c}-{k}", response="x")
            k += 1
            reward = await score(item)
            assert reward == 1.0, reward
            if now >= measure_from:
                latencies.append(time.perf_counter() - now)

    await asyncio.gather(*(caller(c) for c in range(callers)))
    return latencies


async def naive(url: str, callers: int, seconds: float, warmup_s: float) -> tuple[list[float], int]:
    requests = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async def score(item: RewardItem) -> float | None:
            nonlocal requests
            requests += 1
            resp = await http.post("/v1/reward", json={"items": [item.model_dump(mode="json")]})
            return resp.json()["results"][0]["reward"]

        return await run_cell(score, callers, seconds, warmup_s), requests


async def with_client(url: str, callers: int, seconds: float, warmup_s: float,
                      micro_batching: bool) -> tuple[list[float], int]:
    client = RewardClient(url, micro_batching=micro_batching)

    async def score(item: RewardItem) -> float | None:
        return (await client.score([item]))[0].reward

    try:
        latencies = await run_cell(score, callers, seconds, warmup_s)
        return latencies, int(client.metrics()["reward_client/requests"])
    finally:
        await client.aclose()


MODES = {
    "naive": naive,
    "client": lambda *a: with_client(*a, micro_batching=False),
    "client+mb": lambda *a: with_client(*a, micro_batching=True),
}


def summary(latencies: list[float], seconds: float) -> tuple[float, float, float]:
    """(samples/s, p50 ms, p99 ms)."""
    latencies = sorted(latencies)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return len(latencies) / seconds, statistics.median(latencies) * 1e3, p99 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="measured seconds per mode per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds in which the modes take turns")
    parser.add_argument("--warmup-s", type=float, default=0.3, help="unmeasured seconds at the start of each run")
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    with ServiceProcess(f"{THIS}:trivial_reward") as svc:
        print(f"reward service: {svc.url} (1 uvicorn worker, sync trivial reward); {args.rounds} rounds x "
              f"{args.seconds:g} s per mode; {os.cpu_count()} CPUs shared by client and server")
        print(f"{'callers':>7} {'mode':<10} {'samples/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'requests':>9} {'x naive':>8}")
        for callers in args.callers:
            pooled: dict[str, tuple[list[float], int]] = {m: ([], 0) for m in MODES}
            for _ in range(args.rounds):
                for mode, run in MODES.items():
                    latencies, requests = asyncio.run(run(svc.url, callers, args.seconds, args.warmup_s))
                    pooled[mode] = (pooled[mode][0] + latencies, pooled[mode][1] + requests)
            base_rate = summary(pooled["naive"][0], args.seconds * args.rounds)[0]
            for mode, (latencies, requests) in pooled.items():
                rate, p50, p99 = summary(latencies, args.seconds * args.rounds)
                print(f"{callers:>7} {mode:<10} {rate:>10.0f} {p50:>8.2f} {p99:>8.2f} {requests:>9} {rate / base_rate:>8.2f}")


if __name__ == "__main__":
    main()
