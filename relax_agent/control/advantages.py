"""The advantage consumer: reads each complete group's rewards from the bus, writes its advantages.

Advantages are a field like the others: the rollout writes ``reward`` and ``trainable``, this
consumer adds ``advantage`` once a whole group is on the bus, and the trainer reads it. With
``rollout.overlong`` the consumer first shapes the rewards (soft punishment) or takes truncated
samples out of training (mask: their ``trainable`` is rewritten False).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from relax_agent import records as R
from relax_agent.errors import QueueTimeoutError
from relax_agent.records import Trajectory

CONSUMER = "advantage"
FIELDS = (R.REWARD, R.TRAINABLE, R.POLICY_TOKENS)
OVERLONG_FIELDS = (R.LONGEST_REPLY, R.TRUNCATED)
"""What overlong shaping reads of each row besides :data:`FIELDS`."""

OVERLONG_TRUNCATED_FRAC = "overlong/truncated_frac"
OVERLONG_PENALTY_MEAN = "overlong/penalty_mean"
OVERLONG_MASKED = "overlong/masked"


def overlong_shaping(trajs: Sequence[Trajectory], rewards: np.ndarray, trainable: np.ndarray, overlong: Any,
                     max_new_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`shape_overlong` of ``trajs`` ([B] samples; their ``longest_reply`` and ``truncated``
    fields, :func:`relax_agent.records.episode_fields`)."""
    fields = R.episode_fields(trajs)
    return shape_overlong(fields[R.LONGEST_REPLY], fields[R.TRUNCATED], rewards, trainable, overlong, max_new_tokens)


def shape_overlong(lengths: np.ndarray, truncated: np.ndarray, rewards: np.ndarray, trainable: np.ndarray,
                   overlong: Any, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rewards and trainable flags the advantages are computed from, under ``rollout.overlong``.

    Args:
        lengths: [B] int, each sample's longest assistant reply in tokens (the ``longest_reply`` field).
        truncated: [B] bool, cut by a length limit (the ``truncated`` field).
        rewards: [B] float rewards (the env's).
        trainable: [B] bool.
        overlong: the :class:`~relax_agent.config.OverlongConfig`.
        max_new_tokens: the reply limit (``rollout.max_new_tokens``).

    Returns:
        ``(rewards [B] float32, trainable [B] bool, penalties [B] float32)``: "soft" adds
        :func:`~relax_agent.train.algorithms.overlong_penalty` of ``lengths`` to the
        trainable samples' rewards; "mask" clears ``trainable`` of the truncated samples; "none"
        returns the inputs. ``penalties`` are the soft penalties (0 elsewhere).
    """
    import torch

    from relax_agent.train.algorithms import overlong_penalty

    rewards = np.asarray(rewards, dtype=np.float32).copy()
    trainable = np.asarray(trainable, dtype=bool).copy()
    penalties = np.zeros(len(rewards), dtype=np.float32)
    if overlong.mode == "soft":
        lengths_t = torch.as_tensor(np.asarray(lengths, dtype=np.int64))
        pen = overlong_penalty(lengths_t, max_new_tokens, overlong.ramp_tokens(max_new_tokens), overlong.penalty).numpy()
        penalties = np.where(trainable, pen, 0.0).astype(np.float32)
        rewards = rewards + penalties
    elif overlong.mode == "mask":
        trainable &= ~np.asarray(truncated, dtype=bool)
    return rewards, trainable, penalties


def overlong_metrics(trajs: Sequence[Trajectory], overlong: Any, max_new_tokens: int) -> dict[str, float]:
    """:func:`overlong_field_metrics` of ``trajs``' fields (:func:`relax_agent.records.episode_fields`)."""
    return overlong_field_metrics(R.episode_fields(trajs), overlong, max_new_tokens)


def overlong_field_metrics(fields: Mapping[str, Any], overlong: Any, max_new_tokens: int) -> dict[str, float]:
    """The step row's overlong metrics for the step's samples, from their fields (``reward``,
    ``failed``, ``longest_reply``, ``truncated``, [B] each): :data:`OVERLONG_TRUNCATED_FRAC`, and
    :data:`OVERLONG_PENALTY_MEAN` (soft: mean penalty over trainable samples) or
    :data:`OVERLONG_MASKED` (mask: samples taken out). Empty when ``overlong.mode`` is "none"."""
    truncated = np.asarray(fields[R.TRUNCATED], dtype=bool)
    if overlong.mode == "none" or not len(truncated):
        return {}
    out = {OVERLONG_TRUNCATED_FRAC: float(truncated.mean())}
    ok = ~np.asarray(fields[R.FAILED], dtype=bool)
    rewards = np.asarray(fields[R.REWARD], dtype=np.float32)
    _, shaped_ok, pen = shape_overlong(np.asarray(fields[R.LONGEST_REPLY]), truncated, rewards, ok, overlong,
                                       max_new_tokens)
    if overlong.mode == "soft":
        out[OVERLONG_PENALTY_MEAN] = float(pen[ok].mean()) if ok.any() else 0.0
    else:
        out[OVERLONG_MASKED] = float(np.count_nonzero(ok & ~shaped_ok))
    return out


class AdvantageConsumer:
    """Writes the group-level advantages of ``trainer.advantage``
    (:func:`relax_agent.train.collate.field_advantages`) group by group.

    Args:
        bus: the data bus.
        partition: where the groups are.
        group_size: G, rows per group.
        estimator: ``trainer.advantage`` in effect (``TrainerConfig.advantage_estimator``); the
            ``reinforce_pp`` estimators write pre-normalisation values, normalised per step by the loop.
        overlong: ``rollout.overlong`` (None: no shaping).
        max_new_tokens: ``rollout.max_new_tokens`` (the limit of overlong shaping).
    """

    def __init__(self, bus: Any, partition: str, group_size: int, estimator: str = "grpo", overlong: Any = None,
                 max_new_tokens: int = 0) -> None:
        self.bus = bus
        self.partition = partition
        self.group_size = group_size
        self.estimator = estimator
        self.overlong = overlong if overlong is not None and overlong.mode != "none" else None
        self.max_new_tokens = max_new_tokens
        self.fields = FIELDS if self.overlong is None else (*FIELDS, *OVERLONG_FIELDS)
        self.groups_done = 0

    def process_one(self, timeout_s: float | None = None) -> bool:
        """Take one complete group, write its ``advantage`` field (and, with overlong masking, its
        ``trainable`` field), ack; False when none came within ``timeout_s``."""
        from relax_agent.train.collate import field_advantages

        try:
            batch = self.bus.get(self.partition, list(self.fields), CONSUMER, self.group_size, timeout_s=timeout_s,
                                 sampler="group")
        except QueueTimeoutError:
            return False
        fields, out = dict(batch.fields), {}
        if self.overlong is not None:
            rewards, trainable, _ = shape_overlong(fields[R.LONGEST_REPLY], fields[R.TRUNCATED], fields[R.REWARD],
                                                   fields[R.TRAINABLE], self.overlong, self.max_new_tokens)
            if not np.array_equal(trainable, np.asarray(fields[R.TRAINABLE], dtype=bool)):
                out[R.TRAINABLE] = trainable
            fields[R.REWARD], fields[R.TRAINABLE] = rewards, trainable
        adv = field_advantages(fields, batch.group_ids, estimator=self.estimator)
        out[R.ADVANTAGE] = np.asarray(adv, dtype=np.float32)
        self.bus.put(self.partition, batch.sample_ids, out, overwrite=True)
        self.bus.ack(batch.lease_id)
        self.groups_done += 1
        return True
