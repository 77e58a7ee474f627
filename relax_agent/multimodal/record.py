"""What the token record keeps of a media episode, so that replay can check it: per media item its
kind, placeholder token count, first placeholder position and a digest of its processor outputs.

The media themselves are not copied into the record: the episode's messages (recorded beside the
tokens) already hold every media part in its encoded form (PNG / WAV data, as envs build them with
:mod:`relax_agent.multimodal.parts`), a few KB per image, where the processed arrays
(``pixel_values`` float32) are 10-100 times larger. Replay runs the model's processor on those
parts again, as rollout did, and the per-item digest proves the arrays it gets are the arrays the
trainer was given (a processor or preprocessing change shows up as a digest mismatch, not as a
silent log-prob drift). Parts that are not JSON data (a PIL image or an array in a message) are
written as PNG data URLs (lossless for 8-bit RGB) by :func:`json_safe_messages`.

No torch here: the control loop imports this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from relax_agent.errors import DataError
from relax_agent.records import MediaInputs

_PER_ITEM_ROW = {"image": ("image_grid_thw",),
                 "video": ("video_grid_thw", "second_per_grid_ts", "video_second_per_grid"),
                 "audio": ("input_features", "feature_attention_mask")}
"""Arrays holding one row per item of a kind (the Qwen families' layout, see :class:`MediaInputs`)."""
_PATCH_ROWS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
"""Arrays holding ``prod(grid row)`` rows per item of a kind, and the grid that sizes them."""


def split_items(media: MediaInputs) -> list[MediaInputs]:
    """[n] one-item :class:`MediaInputs` of ``media``'s items, in order (the inverse of :meth:`MediaInputs.concat`).

    Raises:
        DataError: an array name whose per-item layout is not known (names it).
    """
    known = {n for names in _PER_ITEM_ROW.values() for n in names} | {v[0] for v in _PATCH_ROWS.values()}
    unknown = sorted(set(media.arrays) - known)
    if unknown:
        raise DataError(f"media arrays {unknown} have no known per-item layout; expected names among {sorted(known)}")
    seen = {"image": 0, "video": 0, "audio": 0}
    patch = {"image": 0, "video": 0}
    out = []
    for kind, n in zip(media.kinds, media.num_tokens, strict=True):
        j = seen[kind]
        seen[kind] += 1
        arrays: dict[str, np.ndarray] = {}
        for name in _PER_ITEM_ROW[kind]:
            if name in media.arrays:
                arrays[name] = media.arrays[name][j:j + 1]
        if kind in _PATCH_ROWS:
            pixels, grid = _PATCH_ROWS[kind]
            rows = int(np.prod(media.arrays[grid][j]))
            arrays[pixels] = media.arrays[pixels][patch[kind]:patch[kind] + rows]
            patch[kind] += rows
        out.append(MediaInputs((kind,), (n,), arrays))
    return out


def item_digest(item: MediaInputs) -> str:
    """SHA-256 (first 16 hex digits) of a one-item :class:`MediaInputs`: kind, token count and, per
    array in name order, its name, dtype, shape and bytes. Equal digests: the same model inputs."""
    h = hashlib.sha256(f"{item.kinds}{item.num_tokens}".encode())
    for name in sorted(item.arrays):
        a = np.ascontiguousarray(item.arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def item_starts(token_ids: Sequence[int], kinds: Sequence[str], num_tokens: Sequence[int],
                kind_of_token: Mapping[int, str]) -> list[int] | None:
    """[n] index in ``token_ids`` of each item's first placeholder token: item ``j`` of a kind takes
    the next ``num_tokens[j]`` placeholders of that kind. None when the placeholders are too few."""
    positions: dict[str, list[int]] = {}
    for i, tok in enumerate(token_ids):
        kind = kind_of_token.get(tok)
        if kind is not None:
            positions.setdefault(kind, []).append(i)
    used = {k: 0 for k in positions}
    out = []
    for kind, n in zip(kinds, num_tokens, strict=True):
        at = used.get(kind, 0)
        if at + n > len(positions.get(kind, ())):
            return None
        out.append(positions[kind][at])
        used[kind] = at + n
    return out


def media_record(media: MediaInputs, token_ids: Sequence[int],
                 kind_of_token: Mapping[int, str] | None = None) -> dict[str, Any]:
    """The token record's ``media`` entry of one sample: ``kinds`` [n], ``num_tokens`` [n],
    ``digests`` [n] (:func:`item_digest`; None for arrays :func:`split_items` cannot split) and, with the family's placeholder ids
    (:meth:`MediaFamily.kind_of_token`), ``starts`` [n] (:func:`item_starts`; None when not known)."""
    if media.digests is not None or not media.arrays:  # a summary (MediaInputs.summary) carries its digests
        digests = None if media.digests is None else list(media.digests)
    else:
        try:
            digests = [item_digest(i) for i in split_items(media)]
        except DataError:  # an array layout not known here: the record keeps no digests (replay says so)
            digests = None
    starts = item_starts(token_ids, media.kinds, media.num_tokens, kind_of_token) if kind_of_token else None
    return {"kinds": list(media.kinds), "num_tokens": list(media.num_tokens), "digests": digests, "starts": starts}


def json_safe_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with media values that are not JSON data (PIL images, arrays) written as PNG data
    URLs (images, video frames) or a list of floats (audio arrays); everything else unchanged."""
    from relax_agent.multimodal.parts import png_data_url

    def image(v: Any) -> Any:
        return v if isinstance(v, (str, dict)) else png_data_url(v)

    out = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "image" and not isinstance(p.get("image"), (str, dict)):
                p = {**p, "image": image(p["image"])}
            elif isinstance(p, dict) and p.get("type") == "video" and not isinstance(p.get("video"), str):
                p = {**p, "video": [image(f) for f in p["video"]]}
            elif isinstance(p, dict) and p.get("type") == "audio" and isinstance(p.get("audio"), np.ndarray):
                p = {**p, "audio": np.asarray(p["audio"], dtype=np.float32).reshape(-1).tolist()}
            parts.append(p)
        out.append({**m, "content": parts})
    return out
