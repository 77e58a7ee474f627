"""Media in training batches: a :class:`~relax_agent.train.batch.TrainBatch`'s ``media`` keeps each
row's :class:`~relax_agent.records.MediaInputs`, and :func:`media_model_kwargs` turns the rows of a
(micro-)batch into the keyword arguments of the model's forward.

Rows' arrays are concatenated along dim 0 in row order: the Qwen families consume image grids,
video grids and audio clips in the order their placeholder tokens appear, row after row, so the
concatenation lines every item up with its own tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from relax_agent.records import MediaInputs


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
