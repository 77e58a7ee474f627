"""Full fine-tuning against LoRA on the same policy and batch: trainable weights, optimizer memory, step time.

Both trainers are :class:`~relax_agent.train.backends.torch_backend.TorchTrainer` over the same policy
(default: the embedded SmolLM2-135M-Instruct, fp32) and the same synthetic GRPO batch (``--batch``
sequences of ``--tokens`` tokens, half of them policy tokens, advantages +-1). Reported per trainer:
trainable parameters, AdamW state after one step (MB), median step time over ``--steps`` steps, peak
resident memory of a fresh process (each trainer runs in its own subprocess), and for LoRA the time to
build the merged weights the weight sync publishes. The last line is LoRA / full.

    python benchmarks/lora.py                    # ~2 minutes on 2 CPU cores
    python benchmarks/lora.py --rank 16 --steps 5
    python benchmarks/lora.py --repeats 3 --record docs/results/lora-smollm2/
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from run_record import Recorder, add_record_args  # noqa: E402


def _batch(tokenizer_vocab: int, batch: int, tokens: int, seed: int):
    import torch

    from relax_agent.records import Trajectory, Turn
    from relax_agent.train.batch import collate

    g = torch.Generator().manual_seed(seed)
    trajs = []
    prompt_len = tokens // 2
    for i in range(batch):
        ids = torch.randint(10, tokenizer_vocab, (tokens,), generator=g).tolist()
        completion = ids[prompt_len:]
        turn = Turn(prompt_len, tuple(completion), tuple([-2.0] * len(completion)), 0, "stop")
        trajs.append(Trajectory(sample_id=f"g/{i}", group_id="g", task_id="g", token_ids=tuple(ids),
                                loss_mask=tuple([0] * prompt_len + [1] * len(completion)),
                                rollout_logprobs=tuple([0.0] * prompt_len + [-2.0] * len(completion)),
                                prompt_len=prompt_len, turns=(turn,), reward=float(i % 2), reward_status="ok"))
    return collate(trajs, [1.0 if i % 2 else -1.0 for i in range(batch)], 0)


def run_one(args: argparse.Namespace) -> dict:
    """One trainer in this process; returns its measurements."""
    import torch

    from relax_agent.config import ModelConfig, TrainerConfig
    from relax_agent.models import load_policy
    from relax_agent.train.backends.torch_backend import TorchTrainer

    torch.set_num_threads(args.threads)
    model, tok = load_policy(ModelConfig(path=args.model) if args.model else ModelConfig())
    lora = {"rank": args.rank} if args.which == "lora" else {"rank": 0}
    cfg = TrainerConfig(lr=1e-5, micro_batch_size=args.batch, lora=lora)
    trainer = TorchTrainer(model, cfg)
    batch = _batch(len(tok), args.batch, args.tokens, seed=0)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - t0)
    state = trainer.optimizer.state_dict()["state"]
    adam_mb = sum(t.numel() * t.element_size() for s in state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0) / 2**20
    t0 = time.perf_counter()
    published = trainer.policy_state_dict()
    publish_s = time.perf_counter() - t0
    return {"which": args.which, "trainable": sum(p.numel() for p in trainer.params),
            "adam_mb": adam_mb, "step_s": statistics.median(times), "publish_s": publish_s,
            "published_tensors": len(published),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--which", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    add_record_args(p, repeats=1)
    args = p.parse_args()
    if args.which:
        print(json.dumps(run_one(args)))
        return
    recorder = Recorder.start(args.record, f"LoRA rank {args.rank} against full fine-tuning (SmolLM2-135M fp32)", {
        "full_adam_mb": "AdamW state after one step, full fine-tuning: MB",
        "lora_adam_mb": f"AdamW state after one step, LoRA rank {args.rank}: MB",
        "full_step_s": f"trainer step, full fine-tuning, median of {args.steps} steps: s",
        "lora_step_s": f"trainer step, LoRA, median of {args.steps} steps: s",
        "lora_vs_full_step": "LoRA step time / full step time",
        "lora_vs_full_trainable": "LoRA trainable parameters / full trainable parameters",
    }, args.repeats)
    for _ in range(args.repeats):
        recorder.add_repeat(compare(args))
    recorder.finish()


def compare(args: argparse.Namespace) -> dict[str, float]:
    """Both trainers, each in a fresh subprocess; prints their table and returns the figures."""
    rows = {}
    forwarded = strip_record_args(sys.argv[1:])
    for which in ("full", "lora"):
        cmd = [sys.executable, __file__, "--which", which, *forwarded]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[which] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'trainer':<6} {'trainable':>12} {'AdamW MB':>9} {'step s':>7} {'publish s':>9} {'peak RSS GB':>11}")
    for r in rows.values():
        print(f"{r['which']:<6} {r['trainable']:>12,} {r['adam_mb']:>9.1f} {r['step_s']:>7.2f} "
              f"{r['publish_s']:>9.2f} {r['peak_rss_gb']:>11.2f}")
    f, lo = rows["full"], rows["lora"]
    print(f"lora / full: trainable {lo['trainable'] / f['trainable']:.3f}x, AdamW state {lo['adam_mb'] / f['adam_mb']:.3f}x, "
          f"step time {lo['step_s'] / f['step_s']:.2f}x, peak RSS {lo['peak_rss_gb'] / f['peak_rss_gb']:.2f}x")
    return {"full_adam_mb": f["adam_mb"], "lora_adam_mb": lo["adam_mb"], "full_step_s": f["step_s"],
            "lora_step_s": lo["step_s"], "lora_vs_full_step": lo["step_s"] / f["step_s"],
            "lora_vs_full_trainable": lo["trainable"] / f["trainable"], "full_peak_rss_gb": f["peak_rss_gb"],
            "lora_peak_rss_gb": lo["peak_rss_gb"], "lora_publish_s": lo["publish_s"]}


def strip_record_args(argv: list[str]) -> list[str]:
    """``argv`` without ``--record DIR`` and ``--repeats N`` (the subprocess measures one trainer once)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--record", "--repeats"):
            skip = True
        elif not arg.startswith(("--record=", "--repeats=")):
            out.append(arg)
    return out


if __name__ == "__main__":
    main()
