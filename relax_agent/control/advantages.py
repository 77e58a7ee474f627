"""The advantage consumer: reads each complete group's rewards from the bus, writes its advantages.

Advantages are a field like the others: the rollout writes ``reward`` and ``trainable``, this
consumer adds ``advantage`` once a whole group is on the bus, and the trainer reads it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from relax_agent import records as R
from relax_agent.errors import QueueTimeoutError

CONSUMER = "advantage"
FIELDS = (R.REWARD, R.TRAINABLE, R.LOSS_MASK)


class AdvantageConsumer:
    """Writes GRPO advantages (:func:`relax_agent.train.collate.field_advantages`) group by group.

    Args:
        bus: the data bus.
        partition: where the groups are.
        group_size: G, rows per group.
        std_normalize: divide by the group std (GRPO) or not (Dr. GRPO); ``trainer.adv_std_normalize``.
    """

    def __init__(self, bus: Any, partition: str, group_size: int, std_normalize: bool = True) -> None:
        self.bus = bus
        self.partition = partition
        self.group_size = group_size
        self.std_normalize = std_normalize
        self.groups_done = 0

    def process_one(self, timeout_s: float | None = None) -> bool:
        """Take one complete group, write its ``advantage`` field, ack; False when none came
        within ``timeout_s``."""
        from relax_agent.train.collate import field_advantages

        try:
            batch = self.bus.get(self.partition, list(FIELDS), CONSUMER, self.group_size, timeout_s=timeout_s,
                                 sampler="group")
        except QueueTimeoutError:
            return False
        adv = field_advantages(batch.fields, batch.group_ids, self.std_normalize)
        self.bus.put(self.partition, batch.sample_ids, {R.ADVANTAGE: np.asarray(adv, dtype=np.float32)},
                     overwrite=True)
        self.bus.ack(batch.lease_id)
        self.groups_done += 1
        return True
