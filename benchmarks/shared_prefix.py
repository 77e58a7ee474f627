"""Shared-prefix training against the plain forward: one GRPO update's time and its gradient.

The same :class:`~relax_agent.train.backends.torch_backend.TorchTrainer` (default policy: the
embedded SmolLM2-135M-Instruct, fp32) takes :meth:`compute_gradients` on the same batch twice per
repeat, ``trainer.shared_prefix`` off (the baseline) and on: ``--groups`` groups of ``--group-size``
rows, each group one ``--prompt-tokens`` prompt (random token ids) and per row a
``--response-tokens`` response, with the main job's micro-batch caps (8 rows, 4096 tokens).
Printed: the median time of each, the ratio baseline / shared, and the largest gradient
difference relative to the gradient's largest entry (float summation order only).

    python benchmarks/shared_prefix.py                     # ~3 minutes on 2 CPU cores
    python benchmarks/shared_prefix.py --groups 6 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_batch(vocab: int, groups: int, group_size: int, prompt_tokens: int, response_tokens: int, seed: int):
    """A collated batch of ``groups`` x ``group_size`` rows; responses vary in length (1/2 to all
    of ``response_tokens``) so rows are padded as in a real step; advantages alternate +-1."""
    import torch

    from relax_agent.records import Trajectory, Turn
    from relax_agent.train.batch import collate

    g = torch.Generator().manual_seed(seed)
    trajs, advantages = [], []
    for k in range(groups):
        prompt = torch.randint(10, vocab, (prompt_tokens,), generator=g).tolist()
        for i in range(group_size):
            n = int(torch.randint(response_tokens // 2, response_tokens + 1, (1,), generator=g))
            completion = torch.randint(10, vocab, (n,), generator=g).tolist()
            turn = Turn(prompt_tokens, tuple(completion), tuple([-2.0] * n), 0, "stop")
            trajs.append(Trajectory(sample_id=f"g{k}/{i}", group_id=f"g{k}", task_id=f"g{k}",
                                    token_ids=tuple(prompt + completion),
                                    loss_mask=tuple([0] * prompt_tokens + [1] * n),
                                    rollout_logprobs=tuple([0.0] * prompt_tokens + [-2.0] * n),
                                    prompt_len=prompt_tokens, turns=(turn,), reward=float(i % 2), reward_status="ok"))
            advantages.append(1.0 if i % 2 else -1.0)
    return collate(trajs, advantages, 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model.path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--response-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch

    from relax_agent.config import ModelConfig, TrainerConfig
    from relax_agent.models import load_policy
    from relax_agent.train.backends.torch_backend import TorchTrainer

    torch.set_num_threads(args.threads)
    model, tok = load_policy(ModelConfig(path=args.model) if args.model else ModelConfig())
    trainer = TorchTrainer(model, TrainerConfig(lr=1e-5, micro_batch_size=8, micro_batch_tokens=4096))
    batch = make_batch(len(tok), args.groups, args.group_size, args.prompt_tokens, args.response_tokens, seed=0)
    times: dict[bool, list[float]] = {False: [], True: []}
    grads: dict[bool, list[torch.Tensor]] = {}
    for _ in range(args.repeats):
        for shared in (False, True):
            trainer.cfg = trainer.cfg.model_copy(update={"shared_prefix": shared})
            t0 = time.perf_counter()
            trainer.compute_gradients(batch)
            times[shared].append(time.perf_counter() - t0)
            grads[shared] = [q.grad.detach().clone() for q in trainer.params]
    scale = max(float(g.abs().max()) for g in grads[False])
    diff = max(float((a - b).abs().max()) for a, b in zip(grads[False], grads[True], strict=True))
    plain, shared = statistics.median(times[False]), statistics.median(times[True])
    print(f"batch: {batch.size} rows ({args.groups} groups x {args.group_size}), prompt {args.prompt_tokens} tokens, "
          f"responses <= {args.response_tokens} tokens; {args.threads} threads, {args.repeats} repeats")
    print(f"{'path':<14}{'median s':>10}")
    print(f"{'plain':<14}{plain:>10.2f}")
    print(f"{'shared prefix':<14}{shared:>10.2f}")
    print(f"speed-up (plain / shared): {plain / shared:.2f}x; "
          f"gradient max |diff| / max |grad|: {diff / scale:.2e}")


if __name__ == "__main__":
    main()
