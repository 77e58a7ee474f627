"""The RL algorithms of :mod:`relax_agent.train.algorithms`, written again as plain loops from the papers.

The yardstick the vectorised functions are tested against (like :mod:`relax_agent.train.reference_grpo`):
one sample, one token at a time, Python floats for everything without a gradient and 0-dim torch
tensors only where a gradient must flow. Nothing here is used for training.

Formulas and sources:

- GRPO (arXiv 2402.03300): ``A_i = (r_i - mean(r_G)) / (std(r_G) + eps)``, std with Bessel's n-1.
- Dr. GRPO (arXiv 2503.20783): ``A_i = r_i - mean(r_G)``.
- RLOO (arXiv 2402.14740, eq. 9): ``A_i = r_i - 1/(k-1) sum_{j != i} r_j``.
- REINFORCE++ (arXiv 2501.03262): every policy token of sample i carries ``r_i``; the advantages
  are whitened over all policy tokens of the batch, ``(a - mean) / sqrt(var + eps)``, var with n-1.
  REINFORCE++-baseline: ``r_i - mean(r_G)`` first.
- PPO-clip (arXiv 1707.06347) with clip-higher (DAPO, arXiv 2503.14476), per token:
  ``-min(r A, clip(r, 1 - e_low, 1 + e_high) A)``, ``r = pi / pi_old``.
- GSPO (arXiv 2507.18071, eqs. 5-7), per sequence: ``s = (pi(y) / pi_old(y)) ** (1/|y|)``,
  ``-min(s A, clip(s, 1 - e_low, 1 + e_high) A)``.
- CISPO (arXiv 2506.13585, eq. 4), per token: ``-sg(clip(r, 1 - e_low, 1 + e_high)) A log pi``.
- Aggregation: "token_mean" (DAPO) sums every token's term over all policy tokens; "seq_mean"
  (GRPO) averages each sequence's terms, then the sequences.
- Mismatch corrections, with ``r_t = pi_old / pi_rollout``: TIS ``min(r_t, C)``; sequence TIS
  ``min(prod r_t, C)``; IcePop (arXiv 2510.18855) ``r_t`` if ``low <= r_t <= high`` else 0;
  geometric mask: the sequence is kept iff ``low <= (prod r_t) ** (1/n) <= high``; sequence
  rejection: kept iff every ``r_t`` is in [low, high].
- DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import cast

import torch

# -- advantages ---------------------------------------------------------------------------------------

def advantages(estimator: str, rewards: list[float], groups: list, valid: list[bool],
               token_counts: list[int] | None = None, eps_std: float = 1e-6, eps_batch: float = 1e-8) -> list[float]:
    """The final advantage of every sample (for ``reinforce_pp*`` after the batch whitening,
    which needs ``token_counts``, the policy tokens of each sample). Invalid samples get 0."""
    members = defaultdict(list)
    for i, ok in enumerate(valid):
        if ok:
            members[groups[i]].append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        rs = [rewards[i] for i in idx]
        k = len(rs)
        mean = sum(rs) / k
        for i in idx:
            r = rewards[i]
            if estimator == "grpo":
                if k < 2 or max(rs) == min(rs):
                    continue
                std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (k - 1))
                out[i] = (r - mean) / (std + eps_std)
            elif estimator in ("dr_grpo", "reinforce_pp_baseline"):
                out[i] = r - mean
            elif estimator == "rloo":
                if k < 2:
                    continue
                others = [rewards[j] for j in idx if j != i]
                out[i] = r - sum(others) / len(others)
            elif estimator == "reinforce_pp":
                out[i] = r
            else:
                raise ValueError(estimator)
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        if token_counts is None:
            raise ValueError(f"estimator {estimator!r} needs token_counts")
        out = batch_whiten(out, token_counts, valid, eps_batch)
    return out


def batch_whiten(values: list[float], token_counts: list[int], valid: list[bool], eps: float = 1e-8) -> list[float]:
    """Whiten over the batch's policy tokens: each valid sample's value repeated once per token."""
    tokens = []
    for v, n, ok in zip(values, token_counts, valid, strict=True):
        if ok:
            tokens.extend([v] * n)
    if len(tokens) < 2:
        return [0.0] * len(values)
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1)
    return [(v - mean) / math.sqrt(var + eps) if ok and n > 0 else 0.0
            for v, n, ok in zip(values, token_counts, valid, strict=True)]


def overlong_penalty(length: int, max_tokens: int, buffer_tokens: int, factor: float = 1.0) -> float:
    """DAPO eq. 13, times ``factor``."""
    if length <= max_tokens - buffer_tokens:
        return 0.0
    if length <= max_tokens:
        return factor * ((max_tokens - buffer_tokens) - length) / buffer_tokens
    return -factor


# -- policy losses ----------------------------------------------------------------------------------

def _clip(x, lo: float, hi: float):
    return max(lo, min(x, hi))


def policy_loss(name: str, logprobs: torch.Tensor, old_logprobs: list[list[float]], adv: list[float],
                mask: list[list[int]], eps_low: float, eps_high: float, agg: str = "token_mean",
                weights: list[list[float]] | None = None) -> torch.Tensor:
    """The batch loss of ``name`` ("ppo_clip", "gspo", "cispo"); ``logprobs`` [B, T] carries the gradient."""
    per_sequence = []
    for b, row in enumerate(mask):
        tokens = [t for t, m in enumerate(row) if m]
        if not tokens:
            continue
        a = adv[b]
        if name == "ppo_clip":
            terms = []
            for t in tokens:
                ratio = torch.exp(logprobs[b, t] - old_logprobs[b][t])
                terms.append(-min(ratio * a, _clip(ratio, 1 - eps_low, 1 + eps_high) * a))
        elif name == "gspo":
            log_seq = cast(torch.Tensor, sum(logprobs[b, t] - old_logprobs[b][t] for t in tokens)) / len(tokens)
            s = torch.exp(log_seq)
            seq_loss = -min(s * a, _clip(s, 1 - eps_low, 1 + eps_high) * a)
            terms = [seq_loss for _ in tokens]
        elif name == "cispo":
            terms = []
            for t in tokens:
                ratio_val = math.exp(float(logprobs[b, t].detach()) - old_logprobs[b][t])  # a number: no gradient
                terms.append(-_clip(ratio_val, 1 - eps_low, 1 + eps_high) * a * logprobs[b, t])
        else:
            raise ValueError(name)
        if weights is not None:
            terms = [term * weights[b][t] for term, t in zip(terms, tokens, strict=True)]
        per_sequence.append(terms)
    zero = 0.0 * logprobs.sum()  # starts every sum: the result stays in the graph when all terms are constants
    if not per_sequence:
        return zero
    if agg == "token_mean":
        flat = [term for terms in per_sequence for term in terms]
        return sum(flat, zero) / len(flat)
    return sum((sum(terms, zero) / len(terms) for terms in per_sequence), zero) / len(per_sequence)


# -- train / rollout mismatch -------------------------------------------------------------------------

def mismatch_weights(old_logprobs: list[list[float]], rollout_logprobs: list[list[float]], mask: list[list[int]],
                     mode: str, low: float, high: float) -> tuple[list[list[float]], dict[str, float]]:
    """Per-token correction weights (0 off the mask) and the metrics of
    :func:`relax_agent.train.algorithms.mismatch_correction`."""
    weights, masked_tokens, clipped_tokens, n_tokens = [], 0, 0, 0
    masked_seqs, seq_log_means, n_seqs, weight_sum = 0, 0.0, 0, 0.0
    for b, row in enumerate(mask):
        tokens = [t for t, m in enumerate(row) if m]
        ratios = {t: math.exp(old_logprobs[b][t] - rollout_logprobs[b][t]) for t in tokens}
        w = [0.0] * len(row)
        clipped = set()
        if mode == "tis":
            for t in tokens:
                w[t] = min(ratios[t], high)
                if ratios[t] > high:
                    clipped.add(t)
        elif mode == "seq_tis":
            prod = math.prod(ratios.values())
            for t in tokens:
                w[t] = min(prod, high)
                if prod > high:
                    clipped.add(t)
        elif mode == "icepop":
            for t in tokens:
                w[t] = ratios[t] if low <= ratios[t] <= high else 0.0
        elif mode == "geo_mask":
            geo = math.prod(ratios.values()) ** (1.0 / len(tokens)) if tokens else 1.0
            for t in tokens:
                w[t] = 1.0 if low <= geo <= high else 0.0
        elif mode == "seq_reject":
            keep = all(low <= ratios[t] <= high for t in tokens)
            for t in tokens:
                w[t] = 1.0 if keep else 0.0
        else:
            raise ValueError(mode)
        weights.append(w)
        n_tokens += len(tokens)
        weight_sum += sum(w[t] for t in tokens)
        masked_tokens += sum(1 for t in tokens if w[t] == 0.0)
        clipped_tokens += len(clipped)
        if tokens:
            n_seqs += 1
            masked_seqs += all(w[t] == 0.0 for t in tokens)
            seq_log_means += sum(math.log(ratios[t]) for t in tokens) / len(tokens)
    metrics = {
        "mismatch/weight_mean": weight_sum / max(n_tokens, 1),
        "mismatch/masked_token_frac": masked_tokens / max(n_tokens, 1),
        "mismatch/clipped_token_frac": clipped_tokens / max(n_tokens, 1),
        "mismatch/masked_seq_frac": masked_seqs / max(n_seqs, 1),
        "mismatch/seq_log_ratio_mean": seq_log_means / max(n_seqs, 1),
    }
    return weights, metrics
