"""TransferQueue: the field-level data bus between rollout, reward and trainer.

Example::

    tq = build_transfer_queue(DataConfig())
    tq.create_partition("step-3", capacity_rows=queue_capacity(8, 1, 4), group_size=4)
    tq.put("step-3", ["s0"], {"response_ids": [np.array([5, 6, 7])]}, group_ids=["g0"], versions=[3])
    tq.put("step-3", ["s0"], {"reward": [1.0]})          # a field written later
    batch = tq.get("step-3", ["response_ids", "reward"], consumer="trainer", batch_size=1)
    tq.ack(batch.lease_id)
"""

from relax_agent.data.config import DataConfig, build_transfer_queue, queue_capacity
from relax_agent.data.protocol import Batch, TransferQueue
from relax_agent.data.samplers import FifoSampler, GroupSampler, IdsSampler, RowMeta, Sampler, TokenBudgetSampler
from relax_agent.data.schema import FieldSpec

__all__ = [
    "Batch",
    "DataConfig",
    "FieldSpec",
    "FifoSampler",
    "GroupSampler",
    "IdsSampler",
    "RowMeta",
    "Sampler",
    "TokenBudgetSampler",
    "TransferQueue",
    "build_transfer_queue",
    "queue_capacity",
]
