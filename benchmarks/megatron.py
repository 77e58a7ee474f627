"""Step time of ``trainer.backend: megatron`` at TP=1 and TP>1 against the torch backend, same batches, one run.

Every backend trains the same random policy on the same batches (``--batch`` sequences of
``--seq-len`` tokens, half of them policy tokens, micro-batch ``--micro-batch``); the first
step warms up and is not counted; the median of the next ``--steps`` is printed with its ratio
to the torch backend. Two step times per Megatron layout: ``rank0`` (``timing/train_step_s``
measured inside rank 0: forward, backward, all-reduces, optimizer) and ``proxy`` (what the
control loop waits for: the batch pickled to every rank plus the step).

Sizes: ``tiny`` (the tests' llama: hidden 64, 2 layers) and ``smollm2`` (SmolLM2-135M's shape:
hidden 576, 30 layers, 9 heads, 3 KV heads, random weights). SmolLM2's 9 heads / 3 KV heads
admit no TP=2, so its parallel layout is TP=3, the smallest that divides them.

    python benchmarks/megatron.py                       # both sizes, CPU
    python benchmarks/megatron.py --sizes tiny --steps 5
    python benchmarks/megatron.py --device cuda --dtype bf16 --tp 1   # one GPU (scripts/gpu_check_megatron.sh)

On CPU the ranks share the machine's cores (torch threads are split between them), so TP>1
runs the same FLOPs on fewer threads per rank plus gloo all-reduces over loopback: it is
slower than TP=1 by design; what it measures is the overhead of the split. On GPUs each rank
has its own device and NCCL moves the activations, which is where tensor parallelism pays.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# This file is named megatron.py: keep its folder off sys.path so `import megatron` finds megatron-core.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from relax_agent.models import make_tiny_model  # noqa: E402
from relax_agent.train.backends.torch_backend import TorchTrainer  # noqa: E402
from relax_agent.train.batch import TrainBatch  # noqa: E402
from relax_agent.train.config import TrainerConfig  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
"""SmolLM2-135M's shape (its config.json), with random weights."""
PARALLEL = {"tiny": 2, "smollm2": 3}
"""The TP>1 layout measured per size (the smallest that divides its heads and KV heads)."""


def make_policy(size: str, folder: Path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(folder / size, arch="llama", seed=0, **(SMOLLM2 if size == "smollm2" else {}))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def make_batches(n: int, batch: int, seq_len: int, vocab: int) -> list[TrainBatch]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (batch, seq_len), generator=g)
        mask = torch.ones_like(ids)
        loss_mask = torch.zeros_like(ids, dtype=torch.bool)
        loss_mask[:, seq_len // 2:] = True
        old = -torch.rand(batch, seq_len, generator=g) * 8 * loss_mask
        out.append(TrainBatch(ids, mask, loss_mask, old, torch.randn(batch, generator=g)))
    return out


def time_steps(trainer, batches: list[TrainBatch]) -> tuple[float, float]:
    """(median wall s per step, median ``timing/train_step_s``) over every batch but the first."""
    wall, inner = [], []
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        metrics = trainer.train_step(b)
        if i:
            wall.append(time.perf_counter() - t0)
            inner.append(metrics["timing/train_step_s"])
    return statistics.median(wall), statistics.median(inner)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--tp", default=None, help="comma-separated TP sizes (default: 1 and the size's TP>1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    args = parser.parse_args(argv)
    print(f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, load average {os.getloadavg()}, "
          f"device {args.device}, dtype {args.dtype}, batch {args.batch}x{args.seq_len}, micro-batch {args.micro_batch}")
    common = dict(lr=1e-5, micro_batch_size=args.micro_batch, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            model = make_policy(size, Path(tmp))
            batches = make_batches(args.steps + 1, args.batch, args.seq_len, model.config.vocab_size)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            import copy

            torch_s, _ = time_steps(TorchTrainer(copy.deepcopy(model), TrainerConfig(**common), device=args.device),
                                    batches)
            print(f"\n{size} ({params:.1f} M parameters)")
            print(f"  {'backend':<16}{'step s (proxy)':>16}{'step s (rank0)':>16}{'ratio vs torch':>16}")
            print(f"  {'torch':<16}{torch_s:>16.4f}{torch_s:>16.4f}{1.0:>16.2f}")
            sizes = [int(t) for t in args.tp.split(",")] if args.tp else [1, PARALLEL[size]]
            for tp in sizes:
                cfg = TrainerConfig(backend="megatron", megatron={"tensor_parallel": tp}, **common)
                with cfg.build(model=model, device=args.device) as trainer:
                    wall, inner = time_steps(trainer, batches)
                print(f"  {f'megatron TP={tp}':<16}{wall:>16.4f}{inner:>16.4f}{wall / torch_s:>16.2f}")
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
