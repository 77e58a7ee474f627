"""From trajectories to padded training tensors: advantages, collation, micro-batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from relax_agent.errors import DataError
from relax_agent.records import MediaInputs, Trajectory


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
        media: multimodal policies: [B] each row's :class:`~relax_agent.records.MediaInputs` (None for
            a row without media), fed to the forward with the rows (see
            :func:`relax_agent.multimodal.batch.checked_media_kwargs`); None for a text batch.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    routed_experts: torch.Tensor | None = None
    routes_mask: torch.Tensor | None = None
    media: tuple[MediaInputs | None, ...] | None = None

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
        if self.routed_experts is not None and self.routes_mask is not None and (
                tuple(self.routed_experts.shape[:2]) != shape or self.routed_experts.dim() != 4
                or tuple(self.routes_mask.shape) != shape):
            raise DataError(f"routed_experts must be [B, T, layers, top_k] and routes_mask [B, T] with "
                            f"[B, T]={shape}; got {tuple(self.routed_experts.shape)} and {tuple(self.routes_mask.shape)}")
        if self.media is not None and len(self.media) != shape[0]:
            raise DataError(f"media must have one entry per row, B={shape[0]}; got {len(self.media)}")

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

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on ``device`` (media arrays move at forward time)."""
        moved: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return TrainBatch(**moved)

    def micro_slices(self, micro_batch_size: int, max_tokens: int | None = None) -> list[slice]:
        """Row ranges of consecutive micro-batches: at most ``micro_batch_size`` sequences each
        and, with ``max_tokens``, at most that many padded tokens (rows x the longest row) each;
        a single row longer than ``max_tokens`` is a micro-batch of its own. The token cap bounds
        activation memory whatever the prompts' lengths (verl's dynamic batch size does the same).

        Raises:
            DataError: ``micro_batch_size`` < 1 or ``max_tokens`` < 1.
        """
        check_micro_batch_caps(micro_batch_size, max_tokens)
        lengths = [max(int(n), 1) for n in self.attention_mask.sum(dim=1).tolist()]
        out, start, longest = [], 0, 0
        for row, length in enumerate(lengths):
            rows, wider = row - start, max(longest, length)
            if rows and (rows == micro_batch_size or (max_tokens is not None and (rows + 1) * wider > max_tokens)):
                out.append(slice(start, row))
                start, wider = row, length
            longest = wider
        if start < len(lengths):
            out.append(slice(start, len(lengths)))
        return out

    def split(self, micro_batch_size: int, max_tokens: int | None = None) -> Sequence[TrainBatch]:
        """The micro-batches of :meth:`micro_slices`, each trimmed to its own longest sequence,
        so short sequences batched together cost no padding compute (each keeps its rows' media).

        Raises:
            DataError: ``micro_batch_size`` < 1 or ``max_tokens`` < 1.
        """
        return [self.select(rows) for rows in self.micro_slices(micro_batch_size, max_tokens)]

    def select(self, rows: slice | Sequence[int]) -> TrainBatch:
        """Rows ``rows`` of the batch (a slice, or indices in the order wanted), trimmed to the
        longest of them; each keeps its routes and media.

        Raises:
            DataError: ``rows`` selects no row.
        """
        index = rows if isinstance(rows, slice) else torch.tensor(list(rows), dtype=torch.long)
        picked = range(self.size)[rows] if isinstance(rows, slice) else [int(r) for r in rows]
        if not len(picked):
            raise DataError(f"select() needs at least one row of {self.size}; got {rows!r}")
        length = max(int(self.attention_mask[index].sum(dim=1).max()), 1)
        return TrainBatch(
            input_ids=self.input_ids[index, :length],
            attention_mask=self.attention_mask[index, :length],
            loss_mask=self.loss_mask[index, :length],
            rollout_logprobs=self.rollout_logprobs[index, :length],
            advantages=self.advantages[index],
            routed_experts=None if self.routed_experts is None else self.routed_experts[index, :length],
            routes_mask=None if self.routes_mask is None else self.routes_mask[index, :length],
            media=None if self.media is None else tuple(self.media[r] for r in picked),
        )


def check_micro_batch_caps(micro_batch_size: int, max_tokens: int | None) -> None:
    """Refuse micro-batch caps that cannot split a batch.

    Raises:
        DataError: ``micro_batch_size`` < 1 or ``max_tokens`` < 1.
    """
    if micro_batch_size < 1:
        raise DataError(f"micro_batch_size must be >= 1; got {micro_batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise DataError(f"micro_batch_tokens must be >= 1 (or None for no cap); got {max_tokens}")


def trajectory_advantages(trajectories: Sequence[Trajectory], std_normalize: bool = True,
                          estimator: str | None = None) -> torch.Tensor:
    """Advantages [B] for trajectories, grouped by ``group_id`` (the same computation as the
    pipeline's advantage consumer: :func:`relax_agent.train.collate.field_advantages` on their
    fields; for the ``reinforce_pp`` estimators followed, as in the loop, by the normalisation
    over these trajectories' policy tokens)."""
    from relax_agent.records import trajectory_fields
    from relax_agent.train.algorithms import BATCH_NORMALIZED, batch_normalized_advantages
    from relax_agent.train.collate import field_advantages

    fields = trajectory_fields(trajectories)
    adv = field_advantages(fields, [t.group_id for t in trajectories], std_normalize, estimator)
    if estimator in BATCH_NORMALIZED:
        counts = torch.tensor([t.num_policy_tokens for t in trajectories], dtype=torch.float64)
        adv = batch_normalized_advantages(adv, counts, torch.as_tensor(fields["trainable"]))
    return adv


def collate(
    trajectories: Sequence[Trajectory],
    advantages: torch.Tensor | Sequence[float],
    pad_token_id: int,
) -> TrainBatch:
    """Right-pad trajectories into a :class:`TrainBatch` through their bus fields
    (:func:`relax_agent.train.collate.collate_fields`): a trajectory that is not trainable keeps
    its row with an all-zero ``loss_mask``.

    Raises:
        DataError: see :func:`~relax_agent.train.collate.collate_fields`.
    """
    from relax_agent.records import route_layout, trajectory_fields
    from relax_agent.train.collate import collate_fields

    if not trajectories:
        raise DataError("collate needs at least one trajectory; got none")
    return collate_fields(trajectory_fields(trajectories, route_layout(trajectories)), pad_token_id, advantages)
