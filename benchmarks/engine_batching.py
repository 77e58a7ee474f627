"""HFEngine against one ``model.generate`` per episode and against the previous engine, in the same run.

Single-turn case: 16 concurrent episodes with chat prompts of ~100-300 tokens each sample
``--max-new-tokens`` tokens. Baseline: Hugging Face ``generate`` called once per episode,
sequentially (what a naive rollout loop does).

Multi-turn case: ``--mt-episodes`` (8) concurrent episodes of ``--turns`` (4) turns; after each
reply the episode appends a tool result of ``--obs-tokens`` tokens, so the conversation grows to
~3k tokens (token-in/token-out: each prompt extends the last one's ids). Reply lengths vary per
turn (drawn in [16, 64] per episode and turn, seeded), as stop tokens make them. Compared: this
engine (prefix reuse + continuous batching) against the engine of git revision
``--baseline-rev`` (a request re-prefills the whole conversation and waits for the running batch
to finish), loaded from that revision's source into this process and driven by the same
episodes on the same model.

Stop tokens are disabled everywhere, so every side samples exactly the same number of tokens
and the tokens/s ratios compare equal work.

    python benchmarks/engine_batching.py                 # embedded SmolLM2-135M-Instruct, both cases
    python benchmarks/engine_batching.py --case multi    # only the multi-turn case
    python benchmarks/engine_batching.py --tiny          # tiny random llama (seconds)
    python benchmarks/engine_batching.py --model PATH --device cuda --dtype bf16

The vLLM engine (``engine.kind: vllm``) against this engine, on cases of the same shape (its
multi-turn tool results default to 600 tokens, not 850) plus its weight update against a raw
loopback copy: ``benchmarks/vllm_engine.py`` (it needs the vLLM venv, which
this benchmark does not).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


BASELINE_REV = "c1cc8be"
"""The last revision whose engine re-prefilled every turn and served batches to completion."""

TOOL_RESULT = ('{"flight": "%s%d", "from": "BOS", "to": "DEN", "departs": "2025-03-14T%02d:%02d", '
               '"seats_left": %d, "price_usd": %d.%02d, "aircraft": "A320neo", "on_time_rate": 0.%02d}')


def load_baseline_engine(rev: str) -> type:
    """``HFEngine`` from ``relax_agent/rollout/engines/hf.py`` at git revision ``rev``, as a class of this process."""
    repo = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{rev}:relax_agent/rollout/engines/hf.py"], cwd=repo, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="engine-baseline-")) / "hf_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("hf_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_baseline"] = module
    spec.loader.exec_module(module)
    return module.HFEngine


def tool_result_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """A tool-result turn of exactly ``n_tokens`` ids: end of the reply, a user turn holding JSON
    records, the generation prompt (what a multi-turn env appends after each reply)."""
    rng = random.Random(seed)
    head = tokenizer.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\n[", add_special_tokens=False)
    tail = tokenizer.encode("]\n</tool_response><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    body: list[int] = []
    while len(body) < n_tokens - len(head) - len(tail):
        record = TOOL_RESULT % (rng.choice("UADB"), rng.randint(100, 9999), rng.randint(0, 23), rng.randint(0, 59),
                                rng.randint(0, 200), rng.randint(80, 900), rng.randint(0, 99), rng.randint(50, 99))
        body += tokenizer.encode(record + ", ", add_special_tokens=False)
    return head + body[:n_tokens - len(head) - len(tail)] + tail


def run_multi_turn(engine, prompts: list[list[int]], observations: list[list[list[int]]],
                   reply_tokens: list[list[int]]) -> tuple[int, float, int]:
    """(sampled tokens, seconds, longest final conversation) for concurrent multi-turn episodes.

    Episode ``e``, turn ``k`` samples ``reply_tokens[e][k]`` tokens; then (but after the last turn)
    ``observations[e][k]`` is appended to prompt + reply to make the next prompt.
    """
    async def episode(e: int) -> tuple[int, int]:
        prompt, sampled = list(prompts[e]), 0
        for k, n in enumerate(reply_tokens[e]):
            gen = await engine.generate(prompt, SamplingParams(max_new_tokens=n, seed=100 * e + k))
            sampled += len(gen.token_ids)
            prompt = prompt + list(gen.token_ids) + (observations[e][k] if k < len(observations[e]) else [])
        return sampled, len(prompt)

    async def episodes():
        return await asyncio.gather(*(episode(e) for e in range(len(prompts))))

    start = time.perf_counter()
    results = asyncio.run(episodes())
    return sum(s for s, _ in results), time.perf_counter() - start, max(n for _, n in results)


def single_turn_case(args, model, tokenizer, baseline_cls) -> None:
    """16 single-turn episodes: this engine vs sequential ``generate`` vs the baseline engine."""
    prompts = chat_prompts(tokenizer, args.episodes)
    lens = sorted(len(p) for p in prompts)
    cfg = EngineConfig(max_batch_size=args.episodes)
    engine = HFEngine(model, tokenizer, cfg, device=args.device, stop_token_ids=())
    old = baseline_cls(model, tokenizer, cfg, device=args.device, stop_token_ids=())
    try:
        run_engine(engine, prompts[-2:], 2)  # warm-up (the last prompts: nothing the runs reuse)
        run_engine(old, prompts[-2:], 2)
        run_sequential_generate(model, prompts[:1], 2, args.device)
        base_tokens, base_s = run_sequential_generate(model, prompts, args.max_new_tokens, args.device)
        old_tokens, old_s = run_engine(old, prompts, args.max_new_tokens)
        engine.load_weights({}, version=1)  # clears the prefix cache: the run starts cold
        warm = engine.stats.prefill_tokens, engine.stats.prefix_hit_tokens
        eng_tokens, eng_s = run_engine(engine, prompts, args.max_new_tokens)
    finally:
        engine.close()
        old.close()
    base_tps, old_tps, eng_tps = base_tokens / base_s, old_tokens / old_s, eng_tokens / eng_s
    prefilled, reused = engine.stats.prefill_tokens - warm[0], engine.stats.prefix_hit_tokens - warm[1]
    print(f"\n[single turn] {args.episodes} episodes, prompt tokens min/median/max "
          f"{lens[0]}/{lens[len(lens) // 2]}/{lens[-1]}, {args.max_new_tokens} new tokens each")
    print(f"sequential model.generate: {base_tokens} tokens in {base_s:.1f} s = {base_tps:.1f} tokens/s")
    print(f"HFEngine @{args.baseline_rev}:         {old_tokens} tokens in {old_s:.1f} s = {old_tps:.1f} tokens/s "
          f"({old_tps / base_tps:.2f}x sequential)")
    print(f"HFEngine (this tree):      {eng_tokens} tokens in {eng_s:.1f} s = {eng_tps:.1f} tokens/s "
          f"(prompt tokens prefilled {prefilled}, reused {reused})")
    print(f"ratio (this engine / sequential): {eng_tps / base_tps:.2f}x   (/ @{args.baseline_rev}: "
          f"{eng_tps / old_tps:.2f}x)")


def multi_turn_case(args, model, tokenizer, baseline_cls) -> None:
    """Multi-turn episodes with growing conversations: this engine vs the baseline engine."""
    rng = random.Random(1)
    n = args.mt_episodes
    prompts = chat_prompts(tokenizer, n, seed=1)
    observations = [[tool_result_ids(tokenizer, args.obs_tokens, seed=100 * e + k) for k in range(args.turns - 1)]
                    for e in range(n)]
    replies = [[rng.randint(16, 64) for _ in range(args.turns)] for _ in range(n)]
    cfg = EngineConfig(max_batch_size=n)
    engine = HFEngine(model, tokenizer, cfg, device=args.device, stop_token_ids=())
    old = baseline_cls(model, tokenizer, cfg, device=args.device, stop_token_ids=())
    try:
        warm_up = [[1] + observations[0][0]]  # unrelated to the episodes' prompts: nothing to reuse
        run_engine(engine, warm_up, 2)
        run_engine(old, warm_up, 2)
        old_tokens, old_s, longest = run_multi_turn(old, prompts, observations, replies)
        warm = engine.stats.prefill_tokens, engine.stats.prefix_hit_tokens, engine.stats.admitted_mid_batch
        eng_tokens, eng_s, _ = run_multi_turn(engine, prompts, observations, replies)
    finally:
        engine.close()
        old.close()
    assert old_tokens == eng_tokens == sum(map(sum, replies))
    prefilled, reused, joined = (engine.stats.prefill_tokens - warm[0], engine.stats.prefix_hit_tokens - warm[1],
                                 engine.stats.admitted_mid_batch - warm[2])
    print(f"\n[multi turn] {n} episodes x {args.turns} turns, tool results of {args.obs_tokens} tokens, "
          f"replies of 16-64 tokens, conversations up to {longest} tokens")
    print(f"HFEngine @{args.baseline_rev}:    {old_tokens} tokens in {old_s:.1f} s = {old_tokens / old_s:.2f} tokens/s "
          f"(re-prefills every turn; {old.stats.batches} batches)")
    print(f"HFEngine (this tree): {eng_tokens} tokens in {eng_s:.1f} s = {eng_tokens / eng_s:.2f} tokens/s "
          f"(prompt tokens prefilled {prefilled}, reused {reused}; {joined} requests joined a running batch)")
    print(f"ratio (prefix reuse + continuous batching / @{args.baseline_rev}): {old_s / eng_s:.2f}x tokens/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--tiny", action="store_true", help="use a tiny random llama instead")
    ap.add_argument("--case", default="both", choices=["single", "multi", "both"])
    ap.add_argument("--episodes", type=int, default=16, help="single-turn episodes")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="single-turn tokens per episode")
    ap.add_argument("--mt-episodes", type=int, default=8, help="multi-turn episodes")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--obs-tokens", type=int, default=850, help="tokens of each tool result (multi-turn)")
    ap.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision of the engine to compare against")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    baseline_cls = load_baseline_engine(args.baseline_rev)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tiny-") as tmp:
        path = "tiny random llama" if args.tiny else args.model
        cfg = ModelConfig(path=str(make_tiny_model(tmp)) if args.tiny else args.model)
        model, tokenizer = load_policy(cfg, dtype=args.dtype, device=args.device)
    print(f"model {path} ({args.dtype}, {args.device}, {torch.get_num_threads()} threads), loaded in "
          f"{time.perf_counter() - t0:.1f} s; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.case in ("single", "both"):
        single_turn_case(args, model, tokenizer, baseline_cls)
    if args.case in ("multi", "both"):
        multi_turn_case(args, model, tokenizer, baseline_cls)
    print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
