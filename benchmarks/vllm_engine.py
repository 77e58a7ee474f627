"""The vLLM engine (``engine.kind: vllm``) against our HF engine, and its weight update against a raw
loopback copy of the same bytes, all in one run on the same model.

Cases (stop tokens disabled on both engines, so both sample exactly the same number of tokens):

- **single-turn:** ``--episodes`` (16 and 64) concurrent chat prompts of ~100-300 tokens, each
  sampling ``--max-new-tokens`` tokens; tokens/s = sampled tokens / wall time.
- **multi-turn:** ``--mt-episodes`` (8) concurrent episodes of ``--turns`` (4) turns; after each
  reply the episode appends a tool result of ``--obs-tokens`` tokens (token-in/token-out: each
  prompt extends the previous one's ids), so each engine's prefix cache serves the earlier turns.
  The vLLM side also reports the share of prompt tokens its prefix cache served, and the same
  episodes run on the HF engine with ``prefix_cache=False`` (every turn re-prefills the whole
  conversation, as the HF engine did before it gained prefix reuse).
- **weight update:** the full fp32 state dict through ``VLLMEngine.load_weights`` (write the
  version file to /dev/shm, the server reloads it between steps, resets the prefix cache)
  against a raw 127.0.0.1 socket copy of the same bytes (``benchmarks/weight_sync.py``'s
  ``raw_loopback``), and the HF engine's in-place copy, ``--rounds`` times each (medians).

Both engines run with ``--threads`` CPU threads (the HF engine in this process, vLLM in its
server). Needs the vLLM venv (``bash scripts/setup_vllm.sh``).

    python benchmarks/vllm_engine.py                    # embedded SmolLM2-135M-Instruct, every case
    python benchmarks/vllm_engine.py --case weights     # only the weight update
    python benchmarks/vllm_engine.py --tiny             # tiny random llama (seconds)
    python benchmarks/vllm_engine.py --repeats 3 --record docs/results/vllm-hf/   # every case 3 times, a record
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from relax_agent.config import EngineConfig, ModelConfig
from relax_agent.models import load_policy, make_tiny_model
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.config import VLLMConfig
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.rollout.engines.vllm_engine import VLLMEngine

sys.path.insert(0, str(Path(__file__).parent))
from run_record import Recorder, add_record_args  # noqa: E402
from weight_sync import raw_loopback  # noqa: E402

QUESTIONS = ["What is the weather in Paris in celsius?", "Find flights from Oslo to Rome on 2025-03-02.",
             "Convert 125.5 euros to yen.", "What is 17 * 23 + 4?", "Is it raining in Lima right now?",
             "Book me something from Boston to Denver next Friday.", "How many dollars is 900 pesos?"]


def chat_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` rendered chat prompts of varied length (a system prompt of 0-40 filler lines + a question)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        system = "You are a careful assistant with tools.\n" + "\n".join(
            f"Rule {j}: answer precisely and cite the tool you used." for j in range(rng.randint(0, 20)))
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        prompts.append(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"])
    return prompts


async def single_turn(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """(seconds, sampled tokens) for all ``prompts`` in flight together."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    start = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return time.perf_counter() - start, sum(len(g.token_ids) for g in gens)


async def multi_turn(engine, prompts: list[list[int]], turns: int, obs_ids: list[int],
                     new_tokens: int) -> tuple[float, int, int]:
    """(seconds, sampled tokens, final conversation tokens summed) for concurrent growing episodes."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)

    async def episode(ids: list[int]) -> tuple[int, int]:
        sampled = 0
        for _ in range(turns):
            gen = await engine.generate(ids, params)
            sampled += len(gen.token_ids)
            ids = ids + list(gen.token_ids) + obs_ids
        return sampled, len(ids)

    start = time.perf_counter()
    results = await asyncio.gather(*(episode(list(p)) for p in prompts))
    return time.perf_counter() - start, sum(r[0] for r in results), sum(r[1] for r in results)


def ratio_line(name: str, vllm_value: float, hf_value: float, unit: str, target: float | None = None,
               figures: dict[str, float] | None = None, key: str = "") -> str:
    """One printed comparison; with ``figures``, also stores ``<key>_vllm``, ``<key>_hf`` and ``<key>_ratio`` there."""
    if figures is not None:
        figures |= {f"{key}_vllm": vllm_value, f"{key}_hf": hf_value, f"{key}_ratio": vllm_value / hf_value}
    ratio = vllm_value / hf_value if hf_value else float("inf")
    goal = f"  (target >= {target:.1f}x)" if target is not None else ""
    return f"{name:<28} vLLM {vllm_value:8.1f} {unit}   HF {hf_value:8.1f} {unit}   ratio {ratio:5.2f}x{goal}"


def run_generation(args, model, tok, vllm_engine: VLLMEngine, hf_engine: HFEngine,
                   hf_reprefill: HFEngine | None = None, figures: dict[str, float] | None = None) -> list[str]:
    """The single- and multi-turn comparisons as printed lines; tokens/s and ratios also go into ``figures``."""
    lines = []
    for n in args.episodes:
        prompts = chat_prompts(tok, n, seed=n)
        asyncio.run(single_turn(vllm_engine, prompts[:2], 4))  # warm both paths outside the timing
        asyncio.run(single_turn(hf_engine, prompts[:2], 4))
        v_s, v_tok = asyncio.run(single_turn(vllm_engine, prompts, args.max_new_tokens))
        h_s, h_tok = asyncio.run(single_turn(hf_engine, prompts, args.max_new_tokens))
        assert v_tok == h_tok == n * args.max_new_tokens, (v_tok, h_tok)
        lines.append(ratio_line(f"single-turn {n} episodes", v_tok / v_s, h_tok / h_s, "tok/s", 1.5, figures,
                                f"single_{n}_tok_s"))
    if args.case in ("all", "multi"):
        prompts = chat_prompts(tok, args.mt_episodes, seed=99)
        obs = tok("<tool_response>" + " result row: ok;" * 200, add_special_tokens=False)["input_ids"]
        obs = obs[:args.obs_tokens]
        before = (vllm_engine.stats.prompt_tokens, vllm_engine.stats.cached_prompt_tokens)
        v_s, v_tok, v_len = asyncio.run(multi_turn(vllm_engine, prompts, args.turns, obs, args.max_new_tokens))
        prompt_d = vllm_engine.stats.prompt_tokens - before[0]
        cached_d = vllm_engine.stats.cached_prompt_tokens - before[1]
        h_s, h_tok, _ = asyncio.run(multi_turn(hf_engine, prompts, args.turns, obs, args.max_new_tokens))
        assert v_tok == h_tok
        lines.append(ratio_line(f"multi-turn {args.mt_episodes}x{args.turns} (~{v_len // args.mt_episodes} tok)",
                                v_tok / v_s, h_tok / h_s, "tok/s", 2.0, figures, "multi_tok_s"))
        lines.append(f"{'':<28} vLLM prefix cache served {cached_d}/{prompt_d} prompt tokens "
                     f"({cached_d / max(prompt_d, 1):.0%})")
        if hf_reprefill is not None:  # the engine the issue measured: every turn re-prefills the conversation
            r_s, r_tok, _ = asyncio.run(multi_turn(hf_reprefill, prompts, args.turns, obs, args.max_new_tokens))
            assert r_tok == v_tok
            lines.append(ratio_line("  vs HF, prefix cache off", v_tok / v_s, r_tok / r_s, "tok/s", 2.0, figures,
                                    "multi_vs_reprefill_tok_s"))
    return lines


def run_weights(args, model, vllm_engine: VLLMEngine, hf_engine: HFEngine) -> list[str]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for k, t in state.items() if k in vllm_engine._file_names)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(flat)
    v_times, raw_times, hf_times, pauses, reloads = [], [], [], [], []
    for r in range(args.rounds):
        start = time.perf_counter()
        vllm_engine.load_weights(state, version=vllm_engine.policy_version + 1)
        v_times.append(time.perf_counter() - start)
        last = vllm_engine.server_stats()["last_load"]
        pauses.append(last["pause_s"])
        reloads.append(last["reload_s"])
        raw_times.append(raw_loopback(flat, dst))
        start = time.perf_counter()
        hf_engine.load_weights(state, version=r + 1)
        hf_times.append(time.perf_counter() - start)
    v, raw, hf = (statistics.median(x) for x in (v_times, raw_times, hf_times))
    return [f"weight update ({nbytes / 1e6:.0f} MB)     vLLM {v:6.2f} s (server pause {statistics.median(pauses):.2f} s, "
            f"of it reload_weights {statistics.median(reloads):.2f} s)",
            f"{'':<28} raw loopback copy {raw:6.3f} s   ratio vLLM/raw {v / raw:6.1f}x   "
            f"HF engine copy {hf:6.3f} s (target: vLLM <= 2 s)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=("all", "single", "multi", "weights"), default="all")
    parser.add_argument("--episodes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mt-episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--obs-tokens", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama instead of SmolLM2-135M")
    add_record_args(parser, repeats=1)
    args = parser.parse_args()
    recorder = Recorder.start(args.record, "vLLM engine against the HF engine", {
        "multi_tok_s_ratio": f"multi-turn ({args.mt_episodes} episodes x {args.turns} turns, {args.obs_tokens}-token "
                             "tool outputs): sampled tokens/s of vLLM / of the HF engine (prefix cache on)",
        **{f"single_{n}_tok_s_ratio": f"single turn, {n} episodes at once: vLLM tokens/s / HF's" for n in args.episodes},
    } if args.case == "all" else {}, args.repeats)
    torch.set_num_threads(args.threads)
    if args.tiny:
        path = make_tiny_model(tempfile.mkdtemp(prefix="bench-tiny-"), arch="llama", seed=0, head_dim=32)
        model, tok = load_policy(ModelConfig(path=str(path)))
    else:
        model, tok = load_policy(ModelConfig())
    model.eval()
    print(f"model {'tiny llama' if args.tiny else 'SmolLM2-135M-Instruct'} fp32, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    start = time.perf_counter()
    vllm_engine = VLLMEngine(model, tok, EngineConfig(kind="vllm", max_batch_size=64,
                                                      vllm=VLLMConfig(num_threads=args.threads, kv_cache_gib=4)),
                             stop_token_ids=())
    print(f"vLLM server started in {time.perf_counter() - start:.1f} s", flush=True)
    hf_engine = HFEngine(model, tok, EngineConfig(max_batch_size=64), stop_token_ids=())
    hf_reprefill = HFEngine(model, tok, EngineConfig(max_batch_size=64, prefix_cache=False), stop_token_ids=())
    lines = []
    try:
        for _ in range(args.repeats):
            figures: dict[str, float] = {}
            if args.case in ("all", "single", "multi"):
                if args.case == "multi":
                    args.episodes = []
                lines += run_generation(args, model, tok, vllm_engine, hf_engine, hf_reprefill, figures)
            if args.case in ("all", "weights"):
                lines += run_weights(args, model, vllm_engine, hf_engine)
            recorder.add_repeat(figures)
    finally:
        vllm_engine.close()
        hf_engine.close()
        hf_reprefill.close()
    print("\n".join(lines))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    recorder.finish()


if __name__ == "__main__":
    main()
