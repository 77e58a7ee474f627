"""Cost of ``weights.verify`` per sync, for the main job's model with the HF engine or vLLM.

SmolLM2-135M-Instruct (``embedded:smollm2-135m-instruct``, fp32, 273 tensors: the tied lm_head is
the embedding's second name, so 162.8M elements for 135M parameters)
published in-process (colocate, ``weights.transport: inproc``, as the main job runs) into an
``HFEngine``, ``--rounds`` times with ``weights.verify`` on and off in turns (so load from other
processes hits both alike). Prints medians of: the sync with verify off, the sync with verify
on, ``weights/verify_s`` (the wall time verification adds to the engine's load), and
``verify_s / sync_s`` — the target is <= 5 % — and the same for the least disturbed rounds
(on a shared machine the sync, which is memory-bound, stretches several-fold with the other
processes' load). For comparison it also
times a full-pass digest (float64 sum and sum of squares of every tensor) of the same weights,
the alternative :mod:`relax_agent.weights.digest` explains it does not use.

With ``--engine vllm`` the policy is published over ``weights.transport: tcp`` (the path a vLLM
engine takes) into a ``VLLMEngine`` (CPU build), and the verified sync also includes the server's
check of what the engine serves after the reload (each linear layer read back through its kernel);
that part is printed on its own (``served_verify_s``).

Run: ``python benchmarks/weight_verify.py [--rounds 7] [--samples 2048] [--engine hf|vllm]`` (about
90 s; vLLM: about 3 min).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from relax_agent.config import EngineConfig, ModelConfig
from relax_agent.models import load_policy
from relax_agent.rollout.engines.config import VLLMConfig
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.weights import WeightSyncConfig, build_weight_sync


def full_pass_s(state: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    for t in state.values():
        t.sum(dtype=torch.float64).item()
        torch.linalg.vector_norm(t, dtype=torch.float64).item()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    args = parser.parse_args()
    torch.manual_seed(0)
    trainer, _ = load_policy(ModelConfig())
    model, tokenizer = load_policy(ModelConfig())
    if args.engine == "vllm":
        engine = EngineConfig(kind="vllm", vllm=VLLMConfig(kv_cache_gib=1, max_model_len=2048)).build(
            model=model, tokenizer=tokenizer, seed=0)
        transport = "tcp"
    else:
        engine, transport = HFEngine(model, tokenizer, EngineConfig(), seed=0), "inproc"
    state = trainer.state_dict()
    n_params = sum(t.numel() for t in state.values())
    syncs = {True: build_weight_sync(WeightSyncConfig(transport=transport, verify=True, verify_samples=args.samples)),
             False: build_weight_sync(WeightSyncConfig(transport=transport, verify=False))}
    for on, sync in syncs.items():  # each WeightSync keeps its subscriber until close()
        sync.attach(engine, name=f"verify-{on}")
    seconds: dict[bool, list[float]] = {True: [], False: []}
    verify, full, served = [], [], []
    try:
        for version in range(1, args.rounds + 1):
            with torch.no_grad():
                for t in state.values():  # a train step moves every weight
                    t.add_(1e-4)
            for on in (version % 2 == 0, version % 2 == 1):
                stats = syncs[on].publish(state, version)
                seconds[on].append(stats.seconds)
                if on:
                    verify.append(stats.verify_s)
                    if args.engine == "vllm":
                        served.append(engine.server_stats()["last_load"]["served_verify_s"])
            full.append(full_pass_s(state))
    finally:
        for sync in syncs.values():
            sync.close()
        engine.close()
    off_s, on_s, verify_s = (statistics.median(seconds[False]), statistics.median(seconds[True]),
                             statistics.median(verify))
    print(f"SmolLM2-135M-Instruct: {len(state)} tensors, {n_params / 1e6:.1f}M parameters, fp32 {type(engine).__name__}, "
          f"{transport}, {args.rounds} rounds, verify_samples={args.samples}; load average {os.getloadavg()[0]:.2f}")
    print(f"sync, verify off (median)        {off_s * 1e3:8.1f} ms")
    print(f"sync, verify on  (median)        {on_s * 1e3:8.1f} ms")
    print(f"weights/verify_s (median)        {verify_s * 1e3:8.1f} ms   = {verify_s / on_s:6.1%} of the verified sync")
    print(f"fastest rounds: sync off {min(seconds[False]) * 1e3:.1f} ms, sync on {min(seconds[True]) * 1e3:.1f} ms, "
          f"verify {min(verify) * 1e3:.1f} ms = {min(verify) / min(seconds[True]):.1%} (least disturbed by other load)")
    if served:
        print(f"of which the served-weights check {statistics.median(served) * 1e3:8.1f} ms   = "
              f"{statistics.median(served) / on_s:6.1%} of the verified sync (vLLM server, after the reload)")
    print(f"full-pass fp64 sum + sumsq       {statistics.median(full) * 1e3:8.1f} ms   = "
          f"{statistics.median(full) / off_s:6.1%} of the unverified sync (one side only)")


if __name__ == "__main__":
    main()
