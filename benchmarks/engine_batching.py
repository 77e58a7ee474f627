"""Batched HFEngine vs one ``model.generate`` per episode, measured in the same run.

16 concurrent episodes with chat prompts of ~100-300 tokens each sample ``--max-new-tokens``
tokens. Baseline: Hugging Face ``generate`` called once per episode, sequentially (what a
naive rollout loop does). Stop tokens are disabled on both sides, so both produce exactly
``episodes x max_new_tokens`` tokens and the ratio compares equal work.

    python benchmarks/engine_batching.py                 # embedded SmolLM2-135M-Instruct
    python benchmarks/engine_batching.py --tiny          # tiny random llama (seconds)
    python benchmarks/engine_batching.py --model PATH --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

import torch

from relax_agent.config import EngineConfig, ModelConfig
from relax_agent.models import load_policy, make_tiny_model
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.hf import HFEngine

TOOLS = """You can call these tools. Answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
- get_weather(city: string, unit: "celsius"|"fahrenheit"): current weather in a city.
- search_flights(origin: string, destination: string, date: string): flights on a date (YYYY-MM-DD).
- convert_currency(amount: number, from: string, to: string): convert an amount between currencies.
- calculate(expression: string): evaluate an arithmetic expression exactly."""

QUESTIONS = [
    "What's the weather like in Lisbon right now? I am packing for a trip and want to know whether to bring a coat.",
    "Find me flights from Boston to Denver on 2025-03-14; I prefer morning departures but anything works.",
    "How much is 250 euros in Japanese yen today?",
    "Compute (17 * 23) + 4^5 - 111 and explain each step briefly.",
    "I'm flying from Paris to Rome next Friday (2025-06-06). What are my options, and what is the weather in Rome?",
    "Convert 1,000 US dollars to British pounds and then to euros.",
    "Is it colder in Oslo or in Helsinki at the moment? Use celsius.",
    "My budget is 800 Swiss francs. How many US dollars is that, and can I afford a flight from Zurich "
    "to New York on 2025-09-01?",
]


def chat_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` rendered chat prompts (system prompt with tools + 1-3 user/assistant turns), ~100-300 tokens."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        msgs = [{"role": "system", "content": TOOLS}]
        for _ in range(rng.randint(0, 2)):
            msgs += [{"role": "user", "content": rng.choice(QUESTIONS)},
                     {"role": "assistant", "content": "Let me check that for you."}]
        msgs.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        prompts.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"])
    return prompts


def run_engine(engine: HFEngine, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    """(tokens, seconds) for all prompts as concurrent asyncio episodes."""
    async def episodes():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=max_new_tokens, seed=i))
                                      for i, p in enumerate(prompts)))

    start = time.perf_counter()
    gens = asyncio.run(episodes())
    return sum(len(g.token_ids) for g in gens), time.perf_counter() - start


def run_sequential_generate(model, prompts: list[list[int]], max_new_tokens: int, device: str) -> tuple[int, float]:
    """(tokens, seconds) for one ``model.generate`` per prompt, one after the other."""
    tokens = 0
    start = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=model.config.pad_token_id)
        tokens += out.shape[1] - len(p)
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--tiny", action="store_true", help="use a tiny random llama instead")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tiny-") as tmp:
        path = "tiny random llama" if args.tiny else args.model
        cfg = ModelConfig(path=str(make_tiny_model(tmp)) if args.tiny else args.model)
        model, tokenizer = load_policy(cfg, dtype=args.dtype, device=args.device)
    load_s = time.perf_counter() - t0
    prompts = chat_prompts(tokenizer, args.episodes)
    lens = sorted(len(p) for p in prompts)
    engine = HFEngine(model, tokenizer, EngineConfig(max_batch_size=args.episodes), device=args.device,
                      stop_token_ids=())
    try:
        run_engine(engine, prompts[:2], 2)  # warm-up
        run_sequential_generate(model, prompts[:1], 2, args.device)
        base_tokens, base_s = run_sequential_generate(model, prompts, args.max_new_tokens, args.device)
        eng_tokens, eng_s = run_engine(engine, prompts, args.max_new_tokens)
    finally:
        engine.close()
    base_tps, eng_tps = base_tokens / base_s, eng_tokens / eng_s
    print(f"model {path} ({args.dtype}, {args.device}, {torch.get_num_threads()} threads), loaded in {load_s:.1f} s")
    print(f"{args.episodes} episodes, prompt tokens min/median/max {lens[0]}/{lens[len(lens) // 2]}/{lens[-1]}, "
          f"{args.max_new_tokens} new tokens each")
    print(f"sequential model.generate: {base_tokens} tokens in {base_s:.1f} s = {base_tps:.1f} tokens/s")
    print(f"batched HFEngine:          {eng_tokens} tokens in {eng_s:.1f} s = {eng_tps:.1f} tokens/s "
          f"({engine.stats.batches} batch, {engine.stats.forward_passes} forward passes incl. warm-up)")
    print(f"ratio (batched / sequential): {eng_tps / base_tps:.2f}x")


if __name__ == "__main__":
    main()
