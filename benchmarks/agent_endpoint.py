"""The agent endpoint against calling the engine directly, in the same run, on the same engine.

``--agents`` (32) concurrent agents each send ``--requests`` (4) chat completions, one at a time
(a fresh single-turn conversation each, so both sides run exactly the same prompts). Endpoint
side: each agent is an ``openai.AsyncOpenAI`` client (the real SDK) on this process's event loop
calling the endpoint on 127.0.0.1 (its own thread, as in a run), one episode session per
request: SDK request building, HTTP, JSON, validation, the session's chat rendering and
token-in/token-out recording, tool-call parsing and the response are all inside the measured
latency. Direct side: the same prompts rendered once, then ``engine.generate`` from the same
number of concurrent tasks. Stop tokens are disabled on both sides, so every request samples
exactly ``--max-new-tokens`` tokens and both sides do equal engine work.

``--large-agents`` (2) of the ``--agents`` are hostile on the endpoint side: each sends, again and again
for the whole round, a conversation of ``--large-history-bytes`` (4,000,000: under the endpoint's 4 MiB
body limit, far over any token budget), which the endpoint parses and renders on its own bounded pool
for large bodies and refuses with a 400 at the token budget. Only the other agents are measured, on
both sides: the direct side runs those alone, so the ratios say what the large histories and the
endpoint cost the ordinary agents together.

Prints requests/s and p50/p90 latency per request on each side and their ratios; "added p50" is
``endpoint p50 / direct p50 - 1`` (the issue's bound: <= 10%). Each side runs ``--rounds`` times,
alternating, after one warm-up round each; the median round of each side is reported.

    python benchmarks/agent_endpoint.py                       # tiny random llama (built in a temp dir)
    python benchmarks/agent_endpoint.py --model embedded:smollm2-135m-instruct --max-new-tokens 64
    python benchmarks/agent_endpoint.py --agents 16 --rounds 3 --record docs/results/agent-endpoint/  # a round pair per repeat
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import statistics
import tempfile
import time

import torch
from run_record import Recorder, add_record_args

from relax_agent.config import ModelConfig
from relax_agent.models import load_policy, make_tiny_model
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.rollout.parsers import build_parser
from relax_agent.rollout.proxy.server import EndpointServer
from relax_agent.rollout.proxy.session import AgentSession

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


def conversation(agent: int, request: int) -> list[dict]:
    return [{"role": "user", "content": f"Agent {agent}, question {request}: what is {agent * 7 + request} plus 12? "
                                        "Use the add tool, then answer."}]


async def run_direct(engine, renderer, args) -> list[float]:
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    async def agent(i: int) -> list[float]:
        out = []
        for r in range(args.requests):
            t0 = time.perf_counter()
            prompt = list(renderer.render_prompt(conversation(i, r), TOOLS).token_ids)
            await engine.generate(prompt, SamplingParams(max_new_tokens=params.max_new_tokens, seed=i * 1009 + r))
            out.append(time.perf_counter() - t0)
        return out

    return [x for xs in await asyncio.gather(*(agent(i) for i in range(measured(args)))) for x in xs]


def measured(args) -> int:
    """Agents whose requests are measured: all but the large-history ones."""
    return args.agents - args.large_agents


def large_history(agent: int, size_bytes: int) -> list[dict]:
    """A conversation of about ``size_bytes`` of JSON: alternating 8 KB user and assistant turns."""
    turn = "history " * 1000
    n = max(size_bytes // (len(turn) + 40), 1)
    return [{"role": "user" if k % 2 == 0 else "assistant", "content": f"{agent}:{k} {turn}"} for k in range(n)] + [
        {"role": "user", "content": "What is 2 plus 2?"}]


def large_client(base_url: str, key: str, agent: int, size_bytes: int, ready, stop, results) -> None:
    """An agent process of its own (as agents are): posts its large conversation until ``stop`` is set, then
    puts ``{HTTP status: [latency_s, ...]}`` on ``results``. The body is serialised once, outside the timing."""
    import json

    import httpx

    body = json.dumps({"model": "policy", "messages": large_history(agent, size_bytes), "tools": TOOLS}).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    stats: dict[int, list[float]] = {}
    with httpx.Client(base_url=base_url, timeout=600) as client:
        ready.set()
        while not stop.is_set():
            t0 = time.perf_counter()
            status = client.post("/chat/completions", content=body, headers=headers).status_code
            stats.setdefault(status, []).append(time.perf_counter() - t0)
    results.put(stats)


class LargeAgents:
    """``n`` large-history agent processes, one open session each, sending while the measured agents run."""

    def __init__(self, server, engine, renderer, parser, params, keys, args, first: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.server, self.stop, self.results = server, ctx.Event(), ctx.Queue()
        self.keys, self.ready, self.procs = [], [], []
        for i in range(first, args.agents):
            key = f"bench-large-{next(keys)}"
            server.open(AgentSession(EpisodeSpec(key, "g", "t", {}, seed=0, max_total_tokens=4096), key, engine,
                                     renderer, parser, params))
            ready = ctx.Event()
            self.keys.append(key)
            self.ready.append(ready)
            self.procs.append(ctx.Process(target=large_client, daemon=True, args=(
                server.base_url, key, i, args.large_history_bytes, ready, self.stop, self.results)))

    async def __aenter__(self) -> LargeAgents:
        for proc in self.procs:
            proc.start()
        for ready in self.ready:  # every one connected and sending before the measured agents start
            if not await asyncio.to_thread(ready.wait, 300):
                raise RuntimeError("a large-history agent process did not start within 300 s")
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop.set()
        self.stats: dict[int, list[float]] = {}
        for _ in self.procs:
            for status, ts in (await asyncio.to_thread(self.results.get, True, 600)).items():
                self.stats.setdefault(status, []).extend(ts)
        for proc in self.procs:
            proc.join(60)
        for key in self.keys:
            self.server.sessions.pop(key, None)


async def run_endpoint(server, engine, renderer, args, keys, large_stats: dict) -> tuple[list[float], float]:
    """The measured agents' latencies and their wall time, the large-history agents sending meanwhile (their
    processes start, and send, before the clock does)."""
    import openai

    parser = build_parser("hermes")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    sessions = {}
    for i in range(measured(args)):
        for r in range(args.requests):
            key = f"bench-{next(keys)}"
            spec = EpisodeSpec(key, "g", "t", {}, seed=0, max_total_tokens=4096)
            sessions[i, r] = AgentSession(spec, key, engine, renderer, parser, params)
            server.open(sessions[i, r])

    async def agent(i: int) -> list[float]:
        out = []
        base = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
        for r in range(args.requests):
            client = base.with_options(api_key=sessions[i, r].key)  # one HTTP connection pool per agent
            t0 = time.perf_counter()
            await client.chat.completions.create(model="policy", messages=conversation(i, r), tools=TOOLS,
                                                 seed=i * 1009 + r)
            out.append(time.perf_counter() - t0)
        await base.close()
        return out

    try:
        async with LargeAgents(server, engine, renderer, parser, params, keys, args, measured(args)) as large:
            t0 = time.perf_counter()
            latencies = [x for xs in await asyncio.gather(*(agent(i) for i in range(measured(args)))) for x in xs]
            wall_s = time.perf_counter() - t0
        large_stats.update(large.stats)
        return latencies, wall_s
    finally:
        for s in sessions.values():
            server.sessions.pop(s.key, None)


def summary(latencies: list[float], wall_s: float) -> dict[str, float]:
    q = statistics.quantiles(latencies, n=10)
    return {"req_per_s": len(latencies) / wall_s, "p50_s": statistics.median(latencies), "p90_s": q[8], "wall_s": wall_s}


async def timed(coro) -> tuple[list[float], float]:
    t0 = time.perf_counter()
    out = await coro
    return out if isinstance(out, tuple) else (out, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: a tiny random llama)")
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--large-agents", type=int, default=2, help="agents sending a large history throughout")
    ap.add_argument("--large-history-bytes", type=int, default=4_000_000)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--max-batch-size", type=int, default=32)
    add_record_args(ap, repeats=None)
    args = ap.parse_args()
    if not 0 <= args.large_agents < args.agents:
        ap.error(f"--large-agents must be in 0..{args.agents - 1} (some agents must be measured), "
                 f"got {args.large_agents}")
    recorder = Recorder.start(args.record, "Agent endpoint against calling the engine directly", {
        "endpoint_vs_direct_req_per_s": "requests/s through the endpoint / direct engine calls, the same round",
        "endpoint_vs_direct_p50": "p50 request latency through the endpoint / direct, the same round",
        "large_requests": "large-history requests the endpoint answered during the round",
    }, args.rounds)
    torch.set_num_threads(args.threads)
    path = args.model or str(make_tiny_model(tempfile.mkdtemp(prefix="tiny-"), arch="llama", seed=0))
    model, tok = load_policy(ModelConfig(path=path))
    engine = HFEngine(model, tok, EngineConfig(max_batch_size=args.max_batch_size, batch_wait_s=0.005),
                      stop_token_ids=[])
    renderer = ChatRenderer(tok)
    server = EndpointServer().start()
    keys = itertools.count()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {measured(args)} measured agents x "
          f"{args.requests} requests x {args.max_new_tokens} new tokens, {args.large_agents} more sending "
          f"{args.large_history_bytes:,}-byte histories to the endpoint throughout; torch threads {args.threads}",
          flush=True)
    large_stats: list[dict[int, list[float]]] = []

    async def run() -> dict[str, list[dict[str, float]]]:
        for side, warm in (("direct", run_direct(engine, renderer, args)),
                           ("endpoint", run_endpoint(server, engine, renderer, args, keys, {}))):
            print(f"warm-up round {side:>9}: {(await timed(warm))[1]:6.1f} s", flush=True)
        rounds: dict[str, list[dict[str, float]]] = {"direct": [], "endpoint": []}
        for k in range(args.rounds):
            rounds["direct"].append(summary(*await timed(run_direct(engine, renderer, args))))
            large_stats.append({})
            rounds["endpoint"].append(summary(*await timed(run_endpoint(server, engine, renderer, args, keys,
                                                                        large_stats[-1]))))
            for side in ("direct", "endpoint"):  # each round as it ends: a long run shows progress
                m = rounds[side][-1]
                print(f"round {k + 1}/{args.rounds} {side:>9}: {m['req_per_s']:7.2f} req/s   p50 {m['p50_s'] * 1000:7.1f} ms"
                      f"   wall {m['wall_s']:6.1f} s", flush=True)
            if args.large_agents:
                print(f"round {k + 1}/{args.rounds}     large: " + ", ".join(
                    f"{len(ts)} x HTTP {status} (p50 {statistics.median(ts) * 1000:.0f} ms)"
                    for status, ts in sorted(large_stats[-1].items())), flush=True)
        return rounds

    try:
        rounds = asyncio.run(run())
    finally:
        server.close()
        engine.close()
    for d_round, e_round, big in zip(rounds["direct"], rounds["endpoint"], large_stats, strict=True):  # a repeat
        recorder.add_repeat({"endpoint_vs_direct_req_per_s": e_round["req_per_s"] / d_round["req_per_s"],
                             "endpoint_vs_direct_p50": e_round["p50_s"] / d_round["p50_s"],
                             "large_requests": sum(len(ts) for ts in big.values()),
                             "large_statuses": {str(status): len(ts) for status, ts in sorted(big.items())},
                             "direct_req_per_s": d_round["req_per_s"], "endpoint_req_per_s": e_round["req_per_s"]})
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in rounds.items()}
    for side in ("direct", "endpoint"):
        m = med[side]
        print(f"{side:>9}: {m['req_per_s']:7.2f} req/s   p50 {m['p50_s'] * 1000:7.1f} ms   p90 {m['p90_s'] * 1000:7.1f} ms")
    d, e = med["direct"], med["endpoint"]
    print(f"endpoint / direct: throughput {e['req_per_s'] / d['req_per_s']:.3f}x, p50 {e['p50_s'] / d['p50_s']:.3f}x "
          f"(added p50 {100 * (e['p50_s'] / d['p50_s'] - 1):+.1f}%, bound +10%), "
          f"p90 {e['p90_s'] / d['p90_s']:.3f}x")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    recorder.finish()


if __name__ == "__main__":
    main()
