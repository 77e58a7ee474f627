"""From trajectories to padded training tensors: advantages, collation, micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch

from relax_agent.errors import DataError
from relax_agent.records import Trajectory
from relax_agent.train.algorithms import group_advantages


@dataclass(frozen=True)
class TrainBatch:
    """One training step's sequences, right-padded to a common length T.

    Position ``t`` of ``loss_mask`` and ``rollout_logprobs`` refers to token ``t`` of
    ``input_ids`` (the log-prob of token ``t`` given tokens ``< t``), as in
    :class:`~relax_agent.records.Trajectory`.

    Attributes:
        input_ids: [B, T] int64 token ids; padding holds the pad token id.
        attention_mask: [B, T] int64, 1 on real tokens, 0 on padding (a prefix of ones).
        loss_mask: [B, T] bool, True on policy-sampled tokens that enter the loss.
        rollout_logprobs: [B, T] float32 log-probs from the rollout policy (0 off-policy tokens).
        advantages: [B] float32, one advantage per sequence.
        routed_experts: MoE routing replay only: [B, T, layers, top_k] uint8/int16 experts of
            the rollout forward that scored token ``t`` (see :mod:`relax_agent.moe.record`); else None.
        routes_mask: [B, T] bool, True where ``routed_experts`` holds recorded routes; None with it.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    routed_experts: torch.Tensor | None = None
    routes_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise DataError(f"input_ids must be [B, T]; got shape {shape}")
        for name in ("attention_mask", "loss_mask", "rollout_logprobs"):
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise DataError(f"{name} must have the shape of input_ids {shape}; got {got}")
        if tuple(self.advantages.shape) != shape[:1]:
            raise DataError(f"advantages must be [B]={shape[0]}; got shape {tuple(self.advantages.shape)}")
        if (self.routed_experts is None) != (self.routes_mask is None):
            raise DataError("routed_experts and routes_mask come together (both set or both None)")
        if self.routed_experts is not None and (tuple(self.routed_experts.shape[:2]) != shape
                                                or self.routed_experts.dim() != 4
                                                or tuple(self.routes_mask.shape) != shape):
            raise DataError(f"routed_experts must be [B, T, layers, top_k] and routes_mask [B, T] with "
                            f"[B, T]={shape}; got {tuple(self.routed_experts.shape)} and {tuple(self.routes_mask.shape)}")

    @property
    def size(self) -> int:
        """B, the number of sequences."""
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the batch."""
        return int(self.attention_mask.sum())

    @property
    def num_policy_tokens(self) -> int:
        """Tokens that enter the loss."""
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The same batch with every tensor on ``device``."""
        return TrainBatch(**{f.name: _to(getattr(self, f.name), device) for f in fields(self)})

    def split(self, micro_batch_size: int) -> list["TrainBatch"]:
        """Consecutive micro-batches of at most ``micro_batch_size`` sequences.

        Each micro-batch is trimmed to its own longest sequence, so short sequences batched
        together cost no padding compute.

        Raises:
            DataError: ``micro_batch_size`` < 1.
        """
        if micro_batch_size < 1:
            raise DataError(f"micro_batch_size must be >= 1; got {micro_batch_size}")
        out = []
        for start in range(0, self.size, micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            length = max(int(self.attention_mask[rows].sum(dim=1).max()), 1)
            out.append(
                TrainBatch(
                    input_ids=self.input_ids[rows, :length],
                    attention_mask=self.attention_mask[rows, :length],
                    loss_mask=self.loss_mask[rows, :length],
                    rollout_logprobs=self.rollout_logprobs[rows, :length],
                    advantages=self.advantages[rows],
                    routed_experts=None if self.routed_experts is None else self.routed_experts[rows, :length],
                    routes_mask=None if self.routes_mask is None else self.routes_mask[rows, :length],
                )
            )
        return out


def _to(value: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    return None if value is None else value.to(device)


def trajectory_advantages(trajectories: Sequence[Trajectory], std_normalize: bool = True) -> torch.Tensor:
    """GRPO advantages [B] for trajectories, grouped by ``group_id``.

    Samples that are not :attr:`Trajectory.trainable` (reward error or timeout, episode
    error, non-finite reward) or have no policy tokens (the prompt alone filled
    ``max_total_tokens``) are left out of their group's statistics and get 0 (see
    :func:`~relax_agent.train.algorithms.group_advantages`).
    """
    ids: dict[str, int] = {}
    group_index = torch.tensor([ids.setdefault(t.group_id, len(ids)) for t in trajectories], dtype=torch.long)
    valid = torch.tensor([t.trainable and t.num_policy_tokens > 0 for t in trajectories], dtype=torch.bool)
    rewards = torch.tensor([t.reward if ok else 0.0 for t, ok in zip(trajectories, valid.tolist())], dtype=torch.float32)
    return group_advantages(rewards, group_index, valid, std_normalize=std_normalize)


def collate(
    trajectories: Sequence[Trajectory],
    advantages: torch.Tensor | Sequence[float],
    pad_token_id: int,
) -> TrainBatch:
    """Right-pad trajectories into a :class:`TrainBatch`.

    A trajectory that is not :attr:`Trajectory.trainable` keeps its row but gets an
    all-zero ``loss_mask``, so it adds nothing to the loss or to its normaliser.

    Args:
        trajectories: B finished episodes.
        advantages: [B] one advantage per trajectory (e.g. from :func:`trajectory_advantages`).
        pad_token_id: id written into padding positions (masked out by ``attention_mask``).

    Raises:
        DataError: no trajectories, an empty trajectory, a loss mask set on token 0, or
            ``advantages`` of another length.
    """
    if not trajectories:
        raise DataError("collate needs at least one trajectory; got none")
    adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
    if adv.numel() != len(trajectories):
        raise DataError(f"got {adv.numel()} advantages for {len(trajectories)} trajectories")
    empty = [t.sample_id for t in trajectories if not t.token_ids]
    if empty:
        raise DataError(f"trajectories without tokens cannot be trained on: {empty}")
    first = [t.sample_id for t in trajectories if t.loss_mask[0]]
    if first:
        raise DataError(f"loss_mask is 1 on token 0 (which has no log-prob, nothing precedes it) in {first}")
    b, t_max = len(trajectories), max(len(t.token_ids) for t in trajectories)
    input_ids = torch.full((b, t_max), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, t_max), dtype=torch.long)
    loss_mask = torch.zeros((b, t_max), dtype=torch.bool)
    rollout_logprobs = torch.zeros((b, t_max), dtype=torch.float32)
    for i, traj in enumerate(trajectories):
        n = len(traj.token_ids)
        input_ids[i, :n] = torch.tensor(traj.token_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        rollout_logprobs[i, :n] = torch.tensor(traj.rollout_logprobs, dtype=torch.float32)
        if traj.trainable:
            loss_mask[i, :n] = torch.tensor(traj.loss_mask, dtype=torch.bool)
    return TrainBatch(input_ids, attention_mask, loss_mask, rollout_logprobs, adv, *collate_routes(trajectories, t_max))


def collate_routes(trajectories: Sequence[Trajectory], t_max: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(routed_experts [B, T, layers, top_k], routes_mask [B, T])`` right-padded; (None, None) without routes.

    Raises:
        DataError: trajectories disagree on the routes' [layers, top_k] or dtype.
    """
    routes = [t.routed_experts for t in trajectories]
    present = [r for r in routes if r is not None]
    if not present:
        return None, None
    kinds = {(r.shape[1:], r.dtype) for r in present}
    if len(kinds) > 1:
        raise DataError(f"trajectories carry routed_experts of different [layers, top_k] / dtype: {sorted(map(str, kinds))}")
    shape, dtype = kinds.pop()
    out = np.zeros((len(trajectories), t_max, *shape), dtype=dtype)
    mask = np.zeros((len(trajectories), t_max), dtype=bool)
    for i, (traj, r) in enumerate(zip(trajectories, routes)):
        if r is not None:
            out[i, :len(r)] = r
            mask[i, :len(r)] = traj.routes_mask
    return torch.from_numpy(out), torch.from_numpy(mask)
