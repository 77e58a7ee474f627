"""Media in training batches: a :class:`MediaTrainBatch` keeps each row's
:class:`~relax_agent.records.MediaInputs`, and :func:`media_model_kwargs` turns the rows of a
(micro-)batch into the keyword arguments of the model's forward.

Rows' arrays are concatenated along dim 0 in row order: the Qwen families consume image grids,
video grids and audio clips in the order their placeholder tokens appear, row after row, so the
concatenation lines every item up with its own tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from relax_agent.records import MediaInputs
from relax_agent.train.batch import TrainBatch


@dataclass(frozen=True)
class MediaTrainBatch(TrainBatch):
    """A :class:`~relax_agent.train.batch.TrainBatch` whose rows carry media.

    Attributes:
        media: [B] each row's :class:`~relax_agent.records.MediaInputs` (None for a row without media).
    """

    media: tuple[MediaInputs | None, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        assert len(self.media) == self.size, "one media entry per row"

    def to(self, device: torch.device | str) -> MediaTrainBatch:
        """The same batch with every tensor on ``device`` (media arrays move at forward time)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return MediaTrainBatch(**moved)

    def split(self, micro_batch_size: int, max_tokens: int | None = None) -> list[MediaTrainBatch]:
        """:meth:`TrainBatch.split` keeping each micro-batch's rows' media."""
        out: list[MediaTrainBatch] = []
        for rows, micro in zip(self.micro_slices(micro_batch_size, max_tokens), super().split(micro_batch_size, max_tokens), strict=True):
            parts = {f.name: getattr(micro, f.name) for f in fields(TrainBatch)}
            out.append(MediaTrainBatch(**parts, media=self.media[rows]))
        return out


def batch_media(batch: Any) -> tuple[MediaInputs | None, ...] | None:
    """The rows' media of a batch, or None when it has none (a text batch)."""
    media = getattr(batch, "media", None)
    return media if media and any(m is not None for m in media) else None


def media_model_kwargs(model: Any, family: Any, input_ids: torch.Tensor,
                       media: Sequence[MediaInputs | None] | None) -> dict[str, torch.Tensor]:
    """Forward keyword arguments for ``input_ids`` [B, T] whose rows' media are ``media`` [B].

    Returns ``{}`` without media. Otherwise each model input name of the rows' arrays
    (``pixel_values`` [patches, D], ``image_grid_thw`` [images, 3], ``input_features``
    [clips, mels, frames], ...) concatenated over rows, as tensors on ``input_ids``' device, and
    ``mm_token_type_ids`` [B, T] (0 text, 1 image, 2 video, 3 audio) when the forward takes it
    (Qwen-VL computes its 3-D rope positions from it; without it positions fall back to 1-D).
    """
    merged = MediaInputs.concat(list(media or ()))
    if merged is None:
        return {}
    device = input_ids.device
    out: dict[str, torch.Tensor] = {k: torch.from_numpy(np.array(v)).to(device)  # a copy: bus arrays are read-only
                                    for k, v in merged.arrays.items()}
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        out["mm_token_type_ids"] = family.token_type_ids(input_ids)
    return out


def checked_media_kwargs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         media: Sequence[MediaInputs | None] | None) -> dict[str, torch.Tensor]:
    """:func:`media_model_kwargs` after checking every row: the placeholder tokens of its real
    (unpadded) tokens match its media (:func:`~relax_agent.multimodal.processor.check_placeholders`).

    Raises:
        DataError: a row whose placeholders and features disagree (names the row and the kind).
    """
    if not media or all(m is None for m in media):
        return {}
    from relax_agent.multimodal.processor import MediaFamily, check_placeholders

    family = MediaFamily.from_config(model.config)
    lengths = attention_mask.sum(dim=1).tolist()
    for i, m in enumerate(media):
        check_placeholders(input_ids[i, :int(lengths[i])].cpu().numpy(), m, family, where=f"batch row {i}")
    return media_model_kwargs(model, family, input_ids, media)
