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

Prints requests/s and p50/p90 latency per request on each side and their ratios; "added p50" is
``endpoint p50 / direct p50 - 1`` (the issue's bound: <= 10%). Each side runs ``--rounds`` times,
alternating, after one warm-up round each; the median round of each side is reported.

    python benchmarks/agent_endpoint.py                       # tiny random llama (built in a temp dir)
    python benchmarks/agent_endpoint.py --model embedded:smollm2-135m-instruct --max-new-tokens 64
    python benchmarks/agent_endpoint.py --rounds 3 --record docs/results/agent-endpoint/   # a round pair per repeat
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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

    return [x for xs in await asyncio.gather(*(agent(i) for i in range(args.agents))) for x in xs]


async def run_endpoint(server, engine, renderer, args, keys) -> list[float]:
    import openai

    parser = build_parser("hermes")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    sessions = {}
    for i in range(args.agents):
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
        return [x for xs in await asyncio.gather(*(agent(i) for i in range(args.agents))) for x in xs]
    finally:
        for s in sessions.values():
            server.sessions.pop(s.key, None)


def summary(latencies: list[float], wall_s: float) -> dict[str, float]:
    q = statistics.quantiles(latencies, n=10)
    return {"req_per_s": len(latencies) / wall_s, "p50_s": statistics.median(latencies), "p90_s": q[8], "wall_s": wall_s}


async def timed(coro) -> tuple[list[float], float]:
    t0 = time.perf_counter()
    lat = await coro
    return lat, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: a tiny random llama)")
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--max-batch-size", type=int, default=32)
    add_record_args(ap, repeats=None)
    args = ap.parse_args()
    recorder = Recorder.start(args.record, "Agent endpoint against calling the engine directly", {
        "endpoint_vs_direct_req_per_s": "requests/s through the endpoint / direct engine calls, the same round",
        "endpoint_vs_direct_p50": "p50 request latency through the endpoint / direct, the same round",
    }, args.rounds)
    torch.set_num_threads(args.threads)
    path = args.model or str(make_tiny_model(tempfile.mkdtemp(prefix="tiny-"), arch="llama", seed=0))
    model, tok = load_policy(ModelConfig(path=path))
    engine = HFEngine(model, tok, EngineConfig(max_batch_size=args.max_batch_size, batch_wait_s=0.005),
                      stop_token_ids=[])
    renderer = ChatRenderer(tok)
    server = EndpointServer().start()
    keys = itertools.count()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.agents} agents x "
          f"{args.requests} requests x {args.max_new_tokens} new tokens; torch threads {args.threads}", flush=True)

    async def run() -> dict[str, list[dict[str, float]]]:
        for side, warm in (("direct", run_direct(engine, renderer, args)),
                           ("endpoint", run_endpoint(server, engine, renderer, args, keys))):
            print(f"warm-up round {side:>9}: {(await timed(warm))[1]:6.1f} s", flush=True)
        rounds: dict[str, list[dict[str, float]]] = {"direct": [], "endpoint": []}
        for k in range(args.rounds):
            rounds["direct"].append(summary(*await timed(run_direct(engine, renderer, args))))
            rounds["endpoint"].append(summary(*await timed(run_endpoint(server, engine, renderer, args, keys))))
            for side in ("direct", "endpoint"):  # each round as it ends: a long run shows progress
                m = rounds[side][-1]
                print(f"round {k + 1}/{args.rounds} {side:>9}: {m['req_per_s']:7.2f} req/s   p50 {m['p50_s'] * 1000:7.1f} ms"
                      f"   wall {m['wall_s']:6.1f} s", flush=True)
        return rounds

    try:
        rounds = asyncio.run(run())
    finally:
        server.close()
        engine.close()
    for d_round, e_round in zip(rounds["direct"], rounds["endpoint"], strict=True):  # a round pair is a repeat
        recorder.add_repeat({"endpoint_vs_direct_req_per_s": e_round["req_per_s"] / d_round["req_per_s"],
                             "endpoint_vs_direct_p50": e_round["p50_s"] / d_round["p50_s"],
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
