"""The complete groups the trainer side takes off the bus, and what a step reads of them: whether a
group carries a signal (dynamic sampling), their episode fields (the step's metrics), REINFORCE++'s
step-level normalisation of their advantages, and why a step whose episodes sampled nothing fails."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from relax_agent import records as R
from relax_agent.records import Trajectory


@dataclass
class Group:
    """A complete group taken from the bus by the trainer side."""

    seq: int
    version: int
    fields: dict[str, Any]
    trajs: list[Trajectory]
    lease_id: str
    sample_ids: list[str]
    played_s: tuple[float, float] = (math.nan, math.nan)
    """(start, end) of the group's play in perf_counter seconds, set when it is retired; nan: unknown
    (a group started before a resume)."""


def episode_fields(groups: list[Group]) -> dict[str, list[Any]]:
    """The episode fields (:data:`relax_agent.records.EPISODE_FIELDS`) of ``groups``' rows, concatenated in order."""
    return {name: [v for grp in groups for v in grp.fields[name]] for name in R.EPISODE_FIELDS}


def nothing_sampled(trajs: list[Trajectory], step: int, max_total_tokens: int) -> str:
    """Why step ``step``'s episodes ``trajs`` (none of which sampled a policy token) gave nothing:
    the message of the :class:`~relax_agent.errors.RolloutError` that ends the run, naming the most
    common cause (a prompt that fills ``rollout.max_total_tokens``, or the episodes' error) and its fix."""
    from collections import Counter

    full = [t for t in trajs if t.error is None and t.prompt_len >= max_total_tokens]
    head = f"step {step}: none of its {len(trajs)} episodes sampled a token, so there is nothing to train"
    if full:
        longest = max(full, key=lambda t: t.prompt_len)
        return (f"{head}; {len(full)} of them have a prompt that alone fills rollout.max_total_tokens="
                f"{max_total_tokens} (task {longest.task_id!r}: {longest.prompt_len} tokens); set "
                f"rollout.max_total_tokens above {longest.prompt_len} or shorten the prompts")
    causes = Counter(t.error if t.error is not None else f"stop reason {t.stop_reason.value}" for t in trajs)
    cause, n = causes.most_common(1)[0]
    return f"{head}; {n} of them ended with: {cause}"


def informative(group: Group, estimator: str = "grpo") -> bool:
    """A group carries a signal: some trainable sample has a non-zero advantage (its valid
    rewards differ; DAPO's ``0 < #correct < G`` for a binary reward). For ``reinforce_pp``, whose
    group-level value is the reward itself, the same test reads: the trainable samples' values differ."""
    adv, ok = group.fields[R.ADVANTAGE], group.fields[R.TRAINABLE]
    if estimator == "reinforce_pp":
        return len({float(adv[i]) for i in range(len(adv)) if bool(ok[i])}) > 1
    return any(bool(ok[i]) and float(adv[i]) != 0.0 for i in range(len(adv)))


ADV_BATCH_MEAN = "advantage/batch_mean"
ADV_BATCH_STD = "advantage/batch_std"


def batch_normalized(groups: list[Group]) -> tuple[dict[tuple[int, int], float], dict[str, float]]:
    """REINFORCE++'s step-level normalisation of the groups' advantage fields over their trainable
    rows' policy tokens (:func:`~relax_agent.train.algorithms.batch_normalized_advantages`).

    Returns ``({(group seq, row): advantage}, metrics)``; the metrics are the token-weighted mean and
    std of the values before normalisation (:data:`ADV_BATCH_MEAN`, :data:`ADV_BATCH_STD`)."""
    import torch

    from relax_agent.train.algorithms import batch_normalized_advantages

    keys = [(grp.seq, i) for grp in groups for i in range(len(grp.trajs))]
    pre = torch.tensor([float(grp.fields[R.ADVANTAGE][i]) for grp in groups for i in range(len(grp.trajs))],
                       dtype=torch.float64)
    counts = torch.tensor([grp.trajs[i].num_policy_tokens for grp in groups for i in range(len(grp.trajs))],
                          dtype=torch.float64)
    valid = torch.tensor([bool(grp.fields[R.TRAINABLE][i]) for grp in groups for i in range(len(grp.trajs))])
    final = batch_normalized_advantages(pre, counts, valid)
    n = counts * valid.double()
    total = float(n.sum())
    mean = float((n * pre).sum()) / max(total, 1.0)
    std = (float((n * (pre - mean) ** 2).sum()) / max(total - 1.0, 1.0)) ** 0.5
    return dict(zip(keys, final.tolist(), strict=True)), {ADV_BATCH_MEAN: mean, ADV_BATCH_STD: std}
