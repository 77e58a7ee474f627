"""R3 routing replay and rollout precision on a tiny MoE: train/rollout mismatch and step time, one run.

A tiny random Qwen3-MoE (default: 4 layers, hidden 128, 16 experts, top-2) samples
``--samples`` sequences of ``--max-new-tokens`` tokens in bf16, fp16 and fp32 (the HF engine,
recording routes); an fp32 trainer then scores the same tokens with routing replay off
(the baseline) and on. Reported per rollout dtype: the mismatch metrics the trainer logs
every step (k3 KL, mean/max |Δlogp|, fraction of tokens with |Δlogp| > ln 2 and > ln 5),
the fraction of (position, layer) routes where the trainer would have chosen other
experts, then the reductions replay gives, fp16 against bf16, and the trainer step time
with and without replay (median of interleaved repeats).

A freshly initialised model routes almost uniformly and predicts an almost uniform next
token, so bf16 noise barely matters. To get decisive routing whose near-ties bf16 still
flips, and a peaked next-token distribution (entropy ~3.5 nats), the router weights are
scaled by ``--router-scale``, the expert weights by ``--expert-scale`` and the output head
by ``--logit-scale`` before anything runs.

    python benchmarks/r3.py                          # ~2 min on one CPU core
    python benchmarks/r3.py --arch mixtral --samples 16
    python benchmarks/r3.py --repeats 3 --record docs/results/r3-tiny-moe/   # seeds 0, 1, 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
from run_record import Recorder, add_record_args

from relax_agent.config import EngineConfig, ModelConfig, TrainerConfig
from relax_agent.models import load_policy, make_tiny_model
from relax_agent.moe import ROUTE_FLIP_FRAC
from relax_agent.records import Trajectory, Turn
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.train.algorithms import (
    MISMATCH_ABS_DIFF_MAX,
    MISMATCH_ABS_DIFF_MEAN,
    MISMATCH_FRAC_GT_LN2,
    MISMATCH_FRAC_GT_LN5,
    MISMATCH_K3_KL,
)
from relax_agent.train.backends.torch_backend import TorchTrainer
from relax_agent.train.batch import TrainBatch, collate

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COLUMNS = [(MISMATCH_K3_KL, "k3 KL"), (MISMATCH_ABS_DIFF_MEAN, "mean|d|"), (MISMATCH_ABS_DIFF_MAX, "max|d|"),
           (MISMATCH_FRAC_GT_LN2, ">ln2"), (MISMATCH_FRAC_GT_LN5, ">ln5"), (ROUTE_FLIP_FRAC, "flips")]
VOCAB = 4096
"""Vocabulary of the tiny model (the first SmolLM2 ids): keeps the output head from dominating step time."""


def build_model(args: argparse.Namespace, folder: str) -> tuple[Any, Any]:
    """The tiny MoE with sharpened routers, experts and output head (see the module docstring)."""
    path = make_tiny_model(folder, arch=args.arch, seed=args.seed, hidden_size=128, num_hidden_layers=args.layers,
                           intermediate_size=64, tie_word_embeddings=False, vocab_size=VOCAB, **_expert_count(args.arch, args.experts))
    model, tokenizer = load_policy(ModelConfig(path=str(path)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(args.router_scale)
            elif ".experts." in name:
                param.mul_(args.expert_scale)
            elif name == "lm_head.weight":
                param.mul_(args.logit_scale)
    return model, tokenizer


def _expert_count(arch: str, experts: int) -> dict[str, int]:
    sizes = {"num_local_experts": experts} if arch == "mixtral" else {"num_experts": experts}
    return {**sizes, "moe_intermediate_size": 64} if arch == "qwen3_moe" else sizes


def prompts_for(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 32-48 random token ids (the policy is random too: text would mean nothing to it)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(32, 49, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def rollout(model: Any, tokenizer: Any, dtype: str, prompts: list[list[int]], max_new_tokens: int,
            record: bool) -> tuple[list[Trajectory], float]:
    """(trajectories, CPU seconds of this process): every prompt sampled to exactly ``max_new_tokens`` (no stop tokens)."""
    engine_model = copy.deepcopy(model).to(DTYPES[dtype]).eval()
    with HFEngine(engine_model, tokenizer, EngineConfig(max_batch_size=len(prompts)), stop_token_ids=(),
                  record_routes=record) as engine:
        params = [SamplingParams(max_new_tokens=max_new_tokens, seed=i) for i in range(len(prompts))]
        start = time.process_time()
        gens = engine.generate_many(prompts, params)
        seconds = time.process_time() - start
    trajs = []
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        turn = Turn(len(p), g.token_ids, g.logprobs, g.policy_version, g.finish_reason, g.routed_experts)
        trajs.append(Trajectory(f"s{i}", f"g{i}", "t", (*p, *g.token_ids), (0,) * len(p) + (1,) * len(g.token_ids),
                                (0.0,) * len(p) + g.logprobs, len(p), (turn,), 1.0))
    return trajs, seconds


def trainer(model: Any, replay: bool, micro_batch_size: int) -> TorchTrainer:
    return TorchTrainer(copy.deepcopy(model), TrainerConfig(micro_batch_size=micro_batch_size, lr=1e-5),
                        routing_replay=replay)


def step_times(model: Any, batch: TrainBatch, repeats: int, micro_batch_size: int) -> dict[bool, list[float]]:
    """Trainer step CPU seconds without and with replay, interleaved so load drifts hit both alike.

    CPU time of this process, not wall time: other processes on a shared machine inflate
    wall time at random, while this process's own work stays what it is.
    """
    trainers = {replay: trainer(model, replay, micro_batch_size) for replay in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(repeats + 1):
        for replay in ((False, True) if i % 2 == 0 else (True, False)):
            start = time.process_time()
            trainers[replay].train_step(batch)
            seconds = time.process_time() - start
            if i:  # the first round warms up
                times[replay].append(seconds)
    return times


def reduction(before: float, after: float) -> str:
    return f"{100 * (1 - after / before):.1f}%" if before > 0 else "n/a (baseline is 0)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "mixtral", "olmoe"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--router-scale", type=float, default=4.0)
    ap.add_argument("--expert-scale", type=float, default=4.0)
    ap.add_argument("--logit-scale", type=float, default=20.0)
    ap.add_argument("--repeats-steps", type=int, default=10, help="timed trainer steps per side")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch default)")
    add_record_args(ap, repeats=1)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    recorder = Recorder.start(args.record, f"MoE routing replay (R3) on a tiny {args.arch}: mismatch and step time", {
        "bf16_k3_kl_cut_pct": "bf16 rollout, fp32 trainer: k3 KL lower with replay on than off, %",
        "bf16_mean_abs_diff_cut_pct": "bf16 rollout: mean |logp train - logp rollout| lower with replay, %",
        "step_on_vs_off": f"trainer step CPU s with replay / without, median of {args.repeats_steps} interleaved steps",
        "fp16_vs_bf16_mean_abs_diff": "mean |d logp| of a bf16 rollout / of an fp16 rollout, replay on (x lower)",
    }, args.repeats)
    base_seed = args.seed
    for i in range(args.repeats):
        args.seed = base_seed + i  # each repeat: another random model and other prompts
        recorder.add_repeat(measure(args))
    recorder.finish()


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One whole measurement (model, rollouts, trainer scores, step times); prints it and returns its figures."""
    with tempfile.TemporaryDirectory(prefix="r3-") as tmp:
        model, tokenizer = build_model(args, tmp)
    prompts = prompts_for(args.samples, args.seed)
    mbs = args.samples
    rows, batches, rollout_s = {}, {}, {}
    for dtype in DTYPES:
        trajs, rollout_s[(dtype, True)] = rollout(model, tokenizer, dtype, prompts, args.max_new_tokens, record=True)
        batches[dtype] = collate(trajs, [1.0] * len(trajs), pad_token_id=tokenizer.pad_token_id)
        for replay in (False, True):
            rows[(dtype, replay)] = trainer(model, replay, mbs).compute_gradients(batches[dtype])
    _, rollout_s[("bf16", False)] = rollout(model, tokenizer, "bf16", prompts, args.max_new_tokens, record=False)
    times = step_times(model, batches["bf16"], args.repeats_steps, mbs)

    tokens = batches["bf16"].num_policy_tokens
    print(f"tiny {args.arch}: {args.layers} layers, hidden 128, {args.experts} experts top-2, scales router x"
          f"{args.router_scale} experts x{args.expert_scale} head x{args.logit_scale}; {args.samples} samples x "
          f"{args.max_new_tokens} new tokens ({tokens} policy tokens, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens), vocab {VOCAB}; trainer fp32; {torch.get_num_threads()} threads")
    print(f"trainer entropy (bf16 rollout tokens): {rows[('bf16', False)]['train/entropy']:.2f} nats/token")
    print(f"{'rollout':8}{'replay':8}" + "".join(f"{label:>11}" for _, label in COLUMNS))
    for (dtype, replay), m in rows.items():
        cells = "".join(f"{m[key]:>11.4g}" if key in m else f"{'-':>11}" for key, _ in COLUMNS)
        print(f"{dtype:8}{'on' if replay else 'off':8}{cells}")
    for dtype in ("bf16", "fp16"):
        off, on = rows[(dtype, False)], rows[(dtype, True)]
        print(f"{dtype} rollout, replay on vs off: k3 KL {reduction(off[MISMATCH_K3_KL], on[MISMATCH_K3_KL])} lower, "
              f">ln2 fraction {reduction(off[MISMATCH_FRAC_GT_LN2], on[MISMATCH_FRAC_GT_LN2])} lower, "
              f"mean|d| {reduction(off[MISMATCH_ABS_DIFF_MEAN], on[MISMATCH_ABS_DIFF_MEAN])} lower (target >= 38%)")
    for replay in (False, True):
        bf, fp = rows[("bf16", replay)], rows[("fp16", replay)]
        print(f"fp16 vs bf16 rollout, replay {'on' if replay else 'off'}: mean|d| "
              f"{bf[MISMATCH_ABS_DIFF_MEAN] / fp[MISMATCH_ABS_DIFF_MEAN]:.1f}x lower, k3 KL "
              f"{bf[MISMATCH_K3_KL] / max(fp[MISMATCH_K3_KL], 1e-12):.1f}x lower, max|d| "
              f"{bf[MISMATCH_ABS_DIFF_MAX] / fp[MISMATCH_ABS_DIFF_MAX]:.1f}x lower")
    for name, stat in (("median", statistics.median), ("min", min)):
        off_s, on_s = stat(times[False]), stat(times[True])
        print(f"trainer step (bf16 batch, CPU s, {name} of {args.repeats_steps}): replay off {off_s * 1e3:.1f} ms, on "
              f"{on_s * 1e3:.1f} ms, ratio {on_s / off_s:.3f} (overhead {100 * (on_s / off_s - 1):+.1f}%, "
              "target <= +3%)")
    rec, plain = rollout_s[("bf16", True)], rollout_s[("bf16", False)]
    print(f"bf16 rollout: recording routes {rec:.2f} s vs not {plain:.2f} s (CPU s; ratio {rec / plain:.3f}, one run each)")
    off, on = rows[("bf16", False)], rows[("bf16", True)]
    return {"bf16_k3_kl_cut_pct": 100 * (1 - on[MISMATCH_K3_KL] / off[MISMATCH_K3_KL]),
            "bf16_mean_abs_diff_cut_pct": 100 * (1 - on[MISMATCH_ABS_DIFF_MEAN] / off[MISMATCH_ABS_DIFF_MEAN]),
            "step_on_vs_off": statistics.median(times[True]) / statistics.median(times[False]),
            "fp16_vs_bf16_mean_abs_diff": on[MISMATCH_ABS_DIFF_MEAN] / rows[("fp16", True)][MISMATCH_ABS_DIFF_MEAN],
            "bf16_route_flip_frac_off": off.get(ROUTE_FLIP_FRAC, float("nan")),
            "seed": float(args.seed)}


if __name__ == "__main__":
    main()
