"""GRPO in one readable file (cleanrl style): the yardstick the engine is tested against.

Plain Python loops, one sequence at a time, no padding, no micro-batching, no fused
kernels. Each step:

1. sample G completions per prompt with the current policy, keeping each token's log-prob
   (the *rollout* log-probs);
2. score them; advantage = (reward - group mean) / (group std + eps)   (GRPO, arXiv
   2402.03300; the std is the unbiased one, as torch.std / verl / TRL; without the
   division it is Dr. GRPO, arXiv 2503.20783);
3. loss per policy token = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A),
   ratio = pi(token) / pi_rollout(token)   (PPO-clip with DAPO's clip-higher,
   arXiv 2503.14476), plus kl_coef * k3(pi || pi_ref) (exp(d) - 1 - d, d = log pi_ref - log pi);
4. average over all policy tokens of the batch ("token_mean", DAPO) or per sequence then
   over sequences ("seq_mean", GRPO); backward; clip the grad norm; AdamW step.

Invalid samples (the reward could not be computed) take no part in group statistics and
no part in the loss.

Run ``python -m relax_agent.train.reference_grpo`` to watch a tiny random Llama learn to
emit one token.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One sequence: prompt + completion tokens and what the rollout knew about them."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 on tokens the policy sampled
    rollout_logprobs: list[float]  # log-prob of each sampled token at rollout time, 0.0 elsewhere
    reward: float
    group: int  # samples of one prompt share a group
    valid: bool = True  # False: the reward service failed; the sample is ignored


def compute_advantages(samples: list[Sample], std_normalize: bool = True, eps: float = 1e-6) -> list[float]:
    """One advantage per sample, relative to the other valid samples of its group."""
    members = defaultdict(list)
    for i, s in enumerate(samples):
        if s.valid:
            members[s.group].append(i)
    advantages = [0.0] * len(samples)
    for idx in members.values():
        rewards = [samples[i].reward for i in idx]
        if len(rewards) < 2 or max(rewards) == min(rewards):
            continue  # no contrast inside the group: no learning signal
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
        for i, r in zip(idx, rewards, strict=True):
            advantages[i] = (r - mean) / (std + eps) if std_normalize else r - mean
    return advantages


def sequence_logprobs(model, token_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[T] log p(token t | tokens < t) for one unpadded sequence; position 0 is 0."""
    logits = model(input_ids=torch.tensor([token_ids])).logits[0]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # at least fp32
    logp_all = torch.log_softmax(logits, dim=-1)  # [T, V]; row t predicts token t + 1
    out = [torch.zeros(())]
    for t in range(1, len(token_ids)):
        out.append(logp_all[t - 1, token_ids[t]])
    return torch.stack(out)


def grpo_loss(
    model,
    samples: list[Sample],
    advantages: list[float],
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    agg: str = "token_mean",
    temperature: float = 1.0,
    ref_model=None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """The scalar GRPO loss of a batch, computed token by token."""
    per_sequence = []  # one list of per-token loss terms per valid sample
    for s, adv in zip(samples, advantages, strict=True):
        if not s.valid:
            continue
        logp = sequence_logprobs(model, s.token_ids, temperature)
        if kl_coef > 0:
            with torch.no_grad():
                ref_logp = sequence_logprobs(ref_model, s.token_ids, temperature)
        terms = []
        for t, on_policy in enumerate(s.loss_mask):
            if not on_policy:
                continue
            ratio = torch.exp(logp[t] - s.rollout_logprobs[t])
            clipped = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high)
            term = -torch.minimum(ratio * adv, clipped * adv)
            if kl_coef > 0:
                d = ref_logp[t] - logp[t]
                term = term + kl_coef * (torch.exp(d) - 1 - d)
            terms.append(term)
        if terms:
            per_sequence.append(terms)
    if agg == "token_mean":
        all_terms = [term for terms in per_sequence for term in terms]
        return torch.stack(all_terms).sum() / len(all_terms)
    return torch.stack([torch.stack(terms).mean() for terms in per_sequence]).sum() / len(per_sequence)


def train_step(model, optimizer, samples: list[Sample], grad_clip: float = 1.0,
               advantages: list[float] | None = None, **loss_kwargs) -> float:
    """Advantages (unless given), loss, backward, grad-norm clip, one optimizer step. Returns the loss."""
    std_normalize = loss_kwargs.pop("std_normalize", True)
    if advantages is None:
        advantages = compute_advantages(samples, std_normalize=std_normalize)
    optimizer.zero_grad()
    loss = grpo_loss(model, samples, advantages, **loss_kwargs)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


@torch.no_grad()
def sample(model, prompt: list[int], new_tokens: int, temperature: float = 1.0) -> tuple[list[int], list[float]]:
    """Ancestral sampling without a KV cache; returns (completion ids, their log-probs)."""
    ids, logprobs = list(prompt), []
    for _ in range(new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.multinomial(logp.exp(), 1))
        ids.append(token)
        logprobs.append(float(logp[token]))
    return ids[len(prompt):], logprobs


def main(steps: int = 30, group_size: int = 8, target: int = 3, seed: int = 0) -> None:
    """Teach a tiny random Llama to fill its completions with ``target``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    prompts = [[1, 5, 9], [1, 7, 2]]
    for step in range(steps):
        samples = []
        for group, prompt in enumerate(prompts):
            for _ in range(group_size):
                completion, logprobs = sample(model, prompt, new_tokens=6)
                reward = sum(tok == target for tok in completion) / len(completion)
                samples.append(Sample(prompt + completion, [0] * len(prompt) + [1] * len(completion),
                                      [0.0] * len(prompt) + logprobs, reward, group))
        loss = train_step(model, optimizer, samples)
        mean_reward = sum(s.reward for s in samples) / len(samples)
        print(f"step {step:3d}  loss {loss:+.4f}  mean reward {mean_reward:.3f}")


if __name__ == "__main__":
    main()
