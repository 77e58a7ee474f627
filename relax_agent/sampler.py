"""Deterministic task order with a resumable position."""

from __future__ import annotations

import numpy as np


class TaskSampler:
    """Yields task indices epoch by epoch, each epoch a fresh seeded permutation.

    The position (epoch, offset) is part of every checkpoint, so a resumed run draws exactly
    the tasks the uninterrupted run would have drawn.

    Args:
        num_tasks: dataset size (> 0).
        seed: base seed; epoch ``e`` uses permutation ``default_rng([seed, e])``.

    Raises:
        DataError: ``num_tasks`` is 0.
    """

    def __init__(self, num_tasks: int, seed: int):
        from relax_agent.errors import DataError

        if num_tasks <= 0:
            raise DataError("the training split holds no tasks; check env.id and its split")
        self.num_tasks = num_tasks
        self.seed = seed
        self.epoch = 0
        self.offset = 0

    def _perm(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_tasks)

    def next(self, k: int) -> list[int]:
        """The next ``k`` task indices (wrapping into the next epoch as needed)."""
        out: list[int] = []
        while len(out) < k:
            perm = self._perm()
            take = perm[self.offset : self.offset + k - len(out)]
            out.extend(int(i) for i in take)
            self.offset += len(take)
            if self.offset >= self.num_tasks:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        """Position (epoch, offset) and identity (num_tasks, seed) of the sampler, for a checkpoint."""
        return {"epoch": self.epoch, "offset": self.offset, "num_tasks": self.num_tasks, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at the position of :meth:`state_dict`'s ``state``.

        Raises:
            CheckpointError: the state was taken on a dataset with another number of tasks.
        """
        from relax_agent.errors import CheckpointError

        if state["num_tasks"] != self.num_tasks:
            raise CheckpointError(
                f"checkpoint was taken on a dataset of {state['num_tasks']} tasks, this run has {self.num_tasks}"
            )
        self.epoch, self.offset = state["epoch"], state["offset"]
