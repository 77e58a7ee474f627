"""Media items -> model inputs for one model family, and the placeholder tokens they occupy.

A :class:`MediaFamily` is read from the model's config (no weights): which token id stands for
each media kind, the vision patching and the audio mel bins. :class:`MediaProcessor` turns one
content part into a :class:`~relax_agent.records.MediaInputs` of one item, whose ``num_tokens``
is the number of feature vectors the model's encoder produces for it (so the number of
placeholder tokens the renderer writes).

Families: the Qwen vision-language line (``qwen2_vl``, ``qwen2_5_vl``, and Qwen3-VL: ``qwen3_vl``
and its MoE ``qwen3_vl_moe``), and the Qwen2.5-Omni thinker (``qwen2_5_omni_thinker``: image,
video, audio). One placeholder token per kind is repeated ``num_tokens`` times; images use the PIL
backend of the Qwen2-VL image processor (Qwen3-VL uses it too, with 16-px patches), audio Whisper
log-mel features, and video frames are patched here with the same layout as transformers' Qwen2-VL
and Qwen3-VL video processors (which need torchvision).

Qwen3-VL writes a video frame by frame (:data:`TIMESTAMPED_VIDEO`): each temporal grid step is
``<{t:.1f} seconds><|vision_start|>`` + its ``h*w/merge²`` placeholders + ``<|vision_end|>``, the
text timestamp standing in for the temporal rope index of Qwen2.5-VL; :meth:`MediaProcessor.video_timestamps_s`
gives the timestamps and the renderer writes them (:mod:`relax_agent.multimodal.render`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relax_agent.errors import ConfigError, DataError
from relax_agent.multimodal.parts import (
    AUDIO_RATE_HZ,
    MAX_ASPECT_RATIO,
    MAX_IMAGE_PIXELS,
    MAX_VIDEO_FRAMES,
    decode_audio,
    decode_image,
    decode_video,
    part_kind,
    video_frame_count,
)
from relax_agent.records import MEDIA_KINDS, MediaInputs

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_omni_thinker")
"""``model_type`` values whose media this module processes."""

TIMESTAMPED_VIDEO = ("qwen3_vl", "qwen3_vl_moe")
"""Families whose videos are written frame by frame with text timestamps (see the module docstring);
their rope indices split ``video_grid_thw`` into one grid per temporal step, so the placeholders of
each step must form their own run of tokens."""

IMAGE_MIN_PIXELS = 56 * 56
IMAGE_MAX_PIXELS = 224 * 224
"""Default pixel budget of an image (and a video frame) after resizing; small, for CPU runs."""

AUDIO_CLIP_S = 2
"""Default audio clip length in seconds: features are padded / cut to it."""

VIDEO_FPS = 2.0
"""Frames per second a video part's frames are taken to be (sets the temporal rope step)."""

_SECONDS_PER_GRID = {"qwen2_5_vl": "second_per_grid_ts", "qwen2_5_omni_thinker": "video_second_per_grid"}
"""Forward argument holding each video's seconds per temporal grid step, by family."""


def model_type_of(config: Any) -> str:
    """``config.model_type`` of a transformers config or a ``config.json`` dict."""
    return str(config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", ""))


def is_media_config(config: Any) -> bool:
    """True when the config is of a family in :data:`FAMILIES`."""
    return model_type_of(config) in FAMILIES


@dataclass(frozen=True)
class MediaFamily:
    """What the renderer, engine and trainer need to know of a multimodal model.

    Attributes:
        model_type: the config's ``model_type`` (one of :data:`FAMILIES`).
        token_ids: media kind -> the placeholder token id the model replaces with that kind's
            features (only the kinds the model takes).
        patch_size / temporal_patch_size / merge_size: vision patching (Qwen2/2.5-VL: 14, 2, 2;
            Qwen3-VL: 16, 2, 2).
        num_mel_bins: audio features per frame (0 without an audio encoder).
        vision_start_id / vision_end_id: the tokens around a vision item (None when the config has none).
        timestamped_video: videos are written frame by frame with text timestamps (:data:`TIMESTAMPED_VIDEO`).
    """

    model_type: str
    token_ids: Mapping[str, int]
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    num_mel_bins: int = 0
    vision_start_id: int | None = None
    vision_end_id: int | None = None
    timestamped_video: bool = False

    @classmethod
    def from_config(cls, config: Any) -> MediaFamily:
        """Read the family from a transformers config.

        Raises:
            ConfigError: the model type is not in :data:`FAMILIES`.
        """
        kind = model_type_of(config)
        if kind not in FAMILIES:
            raise ConfigError(f"model.path: model_type {kind!r} is not a multimodal family relax-agent processes; "
                              f"supported: {list(FAMILIES)}")
        ids = {k: getattr(config, f"{k}_token_id", None) for k in MEDIA_KINDS}
        vision, audio = getattr(config, "vision_config", None), getattr(config, "audio_config", None)
        start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
        return cls(
            model_type=kind, token_ids={k: int(v) for k, v in ids.items() if v is not None and (k != "audio" or audio)},
            patch_size=int(getattr(vision, "patch_size", 14)),
            temporal_patch_size=int(getattr(vision, "temporal_patch_size", 2)),
            merge_size=int(getattr(vision, "spatial_merge_size", 2)),
            num_mel_bins=int(getattr(audio, "num_mel_bins", 0) or 0),
            vision_start_id=None if start is None else int(start), vision_end_id=None if end is None else int(end),
            timestamped_video=kind in TIMESTAMPED_VIDEO,
        )

    def kind_of_token(self) -> dict[int, str]:
        """placeholder token id -> media kind."""
        return {v: k for k, v in self.token_ids.items()}

    def count_placeholders(self, token_ids: Any) -> dict[str, int]:
        """media kind -> placeholder tokens of that kind in ``token_ids`` [T]."""
        ids = np.asarray(token_ids)
        return {k: int(np.count_nonzero(ids == v)) for k, v in self.token_ids.items()}

    def token_type_ids(self, input_ids: Any) -> Any:
        """[B, T] ``mm_token_type_ids`` of ``input_ids`` [B, T] (torch): 0 text, 1 image, 2 video, 3 audio."""
        out = input_ids.new_zeros(input_ids.shape)
        for k, v in self.token_ids.items():
            out[input_ids == v] = MEDIA_KINDS.index(k) + 1
        return out


def audio_output_length(frames: int) -> int:
    """Feature vectors the Qwen audio encoder makes of ``frames`` mel frames (two stride-2 stages)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


MIN_AUDIO_SAMPLES = 321
"""Fewest samples at 16 kHz (three mel frames of a 160-sample hop: just over 20 ms) from which the
audio encoder makes a token; the processor checks the token count itself, this is what it says."""


@dataclass
class MediaProcessor:
    """Processes one content part at a time into a one-item :class:`MediaInputs`.

    Args:
        family: the model family.
        min_pixels / max_pixels: resize budget of an image or video frame (Qwen ``smart_resize``).
        audio_clip_s: audio features are padded or cut to this many seconds (with a folder's
            feature extractor: its ``n_samples`` window); a longer clip is cut, with a note.
        video_fps: frames per second of a video part's frames.
        image_processor: the folder's image processor when it has one (``preprocessor_config.json``);
            else the Qwen2-VL PIL image processor with the family's patching.
        max_image_pixels: an image or video frame with more pixels (read from its header) is refused
            before it is decoded (``rollout.max_image_pixels``).
        max_aspect_ratio: an image's longest side over its shortest may be at most this (Qwen's
            ``smart_resize`` raises above 200).
        max_video_frames: a video part with more frames is refused before any frame is decoded
            (``rollout.max_video_frames``).

    Raises:
        ConfigError: the image processor's patching (``patch_size``, ``merge_size``,
            ``temporal_patch_size``) differs from the model's vision config: its pixel rows would not
            fit the vision tower's patch embedding (Qwen3-VL takes 16-px patches, the Qwen2-VL
            processor's default is 14).
    """

    family: MediaFamily
    min_pixels: int = IMAGE_MIN_PIXELS
    max_pixels: int = IMAGE_MAX_PIXELS
    audio_clip_s: int = AUDIO_CLIP_S
    video_fps: float = VIDEO_FPS
    image_processor: Any = None
    feature_extractor: Any = field(default=None, repr=False)
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_aspect_ratio: float = MAX_ASPECT_RATIO
    max_video_frames: int = MAX_VIDEO_FRAMES

    def __post_init__(self) -> None:
        f = self.family
        if self.image_processor is None and ("image" in f.token_ids or "video" in f.token_ids):
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            self.image_processor = Qwen2VLImageProcessorPil(
                patch_size=f.patch_size, temporal_patch_size=f.temporal_patch_size, merge_size=f.merge_size,
                min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        if self.image_processor is not None:
            self._check_patching()
        if self.feature_extractor is None and "audio" in f.token_ids:
            from transformers import WhisperFeatureExtractor

            self.feature_extractor = WhisperFeatureExtractor(
                feature_size=f.num_mel_bins, sampling_rate=AUDIO_RATE_HZ, chunk_length=self.audio_clip_s,
                n_samples=self.audio_clip_s * AUDIO_RATE_HZ)

    def _check_patching(self) -> None:
        f, ip = self.family, self.image_processor
        for name, want in (("patch_size", f.patch_size), ("merge_size", f.merge_size),
                           ("temporal_patch_size", f.temporal_patch_size)):
            got = getattr(ip, name, None)
            if got is not None and int(got) != want:
                model_key = "spatial_merge_size" if name == "merge_size" else name
                raise ConfigError(
                    f"the image processor (preprocessor_config.json) has {name}={got} but the {f.model_type} model's "
                    f"vision_config.{model_key}={want}: its pixel rows would not fit the vision tower; set {name} "
                    f"to {want} in preprocessor_config.json")

    def video_timestamps_s(self, num_frames: int) -> list[float]:
        """[t] seconds of each temporal grid step of a video of ``num_frames`` frames at ``video_fps``:
        the mean time of the step's first and last frame, the last frame repeated to fill the last step
        (transformers' ``Qwen3VLProcessor._calculate_timestamps``)."""
        tp = self.family.temporal_patch_size
        indices = list(range(num_frames)) + [num_frames - 1] * (-num_frames % tp)
        return [(indices[i] + indices[i + tp - 1]) / 2 / self.video_fps for i in range(0, len(indices), tp)]

    @classmethod
    def from_pretrained(cls, folder: str | Path, config: Any, **limits: Any) -> MediaProcessor:
        """The processor of a model folder: its ``preprocessor_config.json`` when present (image
        processor and Whisper feature extractor both read it, as in Qwen2.5-Omni checkpoints), else
        class defaults with the config's patching. A Qwen3-VL folder's ``video_preprocessor_config.json``
        is not read: video frames use the image processor's pixel budget and normalisation.

        ``limits``: ``max_image_pixels`` / ``max_aspect_ratio`` / ``max_video_frames`` (the class defaults
        when not given).

        Raises:
            ConfigError: the folder's patching differs from the model's vision config (names the key).
        """
        family = MediaFamily.from_config(config)
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            return cls(family, **limits)
        kwargs: dict[str, Any] = dict(limits)
        if "image" in family.token_ids:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            kwargs["image_processor"] = Qwen2VLImageProcessorPil.from_pretrained(str(folder))
        if "audio" in family.token_ids:
            from transformers import WhisperFeatureExtractor

            kwargs["feature_extractor"] = WhisperFeatureExtractor.from_pretrained(str(folder))
        return cls(family, **kwargs)

    def process(self, part: dict[str, Any], where: str = "part", notes: list[str] | None = None) -> MediaInputs:
        """One content part -> its item: arrays and ``num_tokens``.

        CPU-bound (decoding, resizing, mel features): the episode driver calls it in a worker thread.
        ``notes`` (when given) receives a line for each change made to the part (audio cut to the
        model's window).

        Raises:
            ConfigError: the model takes no media of this kind (names ``where`` and the kind).
            DataError: the part's payload cannot be decoded, or is refused by the limits (image
                pixels, aspect ratio, video frames; 0-second, NaN / inf audio or audio too short to
                make one token); names ``where``.
        """
        kind = part_kind(part)
        if kind is None or kind not in self.family.token_ids:
            raise ConfigError(f"{where}: a {part.get('type')!r} part, but the policy ({self.family.model_type}) takes "
                              f"only {sorted(self.family.token_ids)}")
        if kind == "image":
            return self._image(decode_image(part, where, self.max_image_pixels, self.max_aspect_ratio))
        if kind == "video":
            frames = video_frame_count(part)
            if frames > self.max_video_frames:
                raise DataError(f"{where}: a video of {frames} frames; rollout.max_video_frames={self.max_video_frames} "
                                "(send fewer frames, or raise the bound)")
            return self._video(decode_video(part, where, self.max_image_pixels, self.max_aspect_ratio))
        samples = decode_audio(part, where)
        window = self.audio_window_samples
        if len(samples) > window:
            if notes is not None:
                notes.append(f"{where}: audio of {len(samples) / AUDIO_RATE_HZ:.2f} s is longer than the model's "
                             f"{window / AUDIO_RATE_HZ:.2f} s window; only its first {window / AUDIO_RATE_HZ:.2f} s "
                             "reach the policy")
            samples = samples[:window]
        item = self._audio(samples)
        if item.num_tokens[0] < 1:
            raise DataError(f"{where}: audio of {1000 * len(samples) / AUDIO_RATE_HZ:.1f} ms makes no audio token "
                            f"for the policy; expected at least {MIN_AUDIO_SAMPLES} samples "
                            f"({1000 * MIN_AUDIO_SAMPLES / AUDIO_RATE_HZ:.2f} ms at {AUDIO_RATE_HZ} Hz)")
        return item

    @property
    def audio_window_samples(self) -> int:
        """Samples at :data:`AUDIO_RATE_HZ` the feature extractor takes (Whisper's ``n_samples``:
        ``chunk_length`` seconds); longer audio is cut to it."""
        fe = self.feature_extractor
        n = getattr(fe, "n_samples", None)
        return int(n) if n else int(getattr(fe, "chunk_length", self.audio_clip_s)) * AUDIO_RATE_HZ

    def _image(self, image: Any) -> MediaInputs:
        out = self.image_processor(images=[image], return_tensors="np")
        pixels, grid = np.asarray(out["pixel_values"], dtype=np.float32), np.asarray(out["image_grid_thw"], dtype=np.int64)
        return MediaInputs(("image",), (int(grid.prod()) // self.family.merge_size ** 2,),
                           {"pixel_values": pixels, "image_grid_thw": grid})

    def _video(self, frames: list[Any]) -> MediaInputs:
        """Frames -> ``pixel_values_videos`` [t*h*w, C*tp*p*p], ``video_grid_thw`` [1, 3] (Qwen2-VL layout)
        and, where the family takes it, the seconds per temporal grid step [1]."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        f, ip = self.family, self.image_processor
        p, m, tp = f.patch_size, f.merge_size, f.temporal_patch_size
        w0, h0 = frames[0].size
        size = dict(ip.size)  # the image processor keeps its pixel budget as shortest/longest edge
        h, w = smart_resize(h0, w0, factor=p * m, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        mean, std = np.asarray(ip.image_mean, np.float32), np.asarray(ip.image_std, np.float32)
        video = np.stack([(np.asarray(fr.resize((w, h)), np.float32) / 255.0 - mean) / std for fr in frames])
        video = video.transpose(0, 3, 1, 2)  # [T, C, H, W]
        if pad := -len(video) % tp:
            video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
        t, c = len(video) // tp, video.shape[1]
        gh, gw = h // p, w // p
        patches = video.reshape(t, tp, c, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        pixels = np.ascontiguousarray(patches.reshape(t * gh * gw, c * tp * p * p), dtype=np.float32)
        arrays: dict[str, np.ndarray] = {"pixel_values_videos": pixels,
                                         "video_grid_thw": np.asarray([[t, gh, gw]], dtype=np.int64)}
        if f.model_type in _SECONDS_PER_GRID:
            arrays[_SECONDS_PER_GRID[f.model_type]] = np.asarray([tp / self.video_fps], dtype=np.float32)
        return MediaInputs(("video",), (t * gh * gw // m ** 2,), arrays)

    def _audio(self, samples: np.ndarray) -> MediaInputs:
        fe = self.feature_extractor
        out = fe([samples], sampling_rate=AUDIO_RATE_HZ, return_attention_mask=True, padding="max_length",
                 truncation=True, return_tensors="np")
        feats, mask = np.asarray(out["input_features"], np.float32), np.asarray(out["attention_mask"], np.int64)
        return MediaInputs(("audio",), (audio_output_length(int(mask.sum())),),
                           {"input_features": feats, "feature_attention_mask": mask})


def check_media_inputs(media: MediaInputs, family: MediaFamily, where: str = "media") -> None:
    """Each item's token count agrees with its arrays (vision: grid patches / merge² and pixel rows;
    audio: the encoder's output length of the feature mask).

    Raises:
        DataError: names ``where``, the item and both numbers.
    """
    m2 = family.merge_size ** 2
    seen = {"image": 0, "video": 0, "audio": 0}
    grids = {"image": media.arrays.get("image_grid_thw"), "video": media.arrays.get("video_grid_thw")}
    rows = {"image": 0, "video": 0}
    for i, (kind, n) in enumerate(zip(media.kinds, media.num_tokens, strict=True)):
        j = seen[kind]
        seen[kind] += 1
        if kind == "audio":
            mask = media.arrays["feature_attention_mask"]
            expect = audio_output_length(int(mask[j].sum()))
        else:
            grid = grids[kind]
            if grid is None or j >= len(grid):
                raise DataError(f"{where}: {kind} item {i} has no grid row ({kind}_grid_thw has "
                                f"{0 if grid is None else len(grid)} rows)")
            rows[kind] += int(np.prod(grid[j]))
            expect = int(np.prod(grid[j])) // m2
        if expect != n:
            raise DataError(f"{where}: {kind} item {i} occupies {n} placeholder tokens but its features give {expect}")
    for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        got = len(media.arrays[key]) if key in media.arrays else 0
        if got != rows[kind]:
            raise DataError(f"{where}: {key} has {got} patch rows but the {kind} grids need {rows[kind]}")
    if seen["audio"] != (len(media.arrays["input_features"]) if "input_features" in media.arrays else 0):
        raise DataError(f"{where}: {seen['audio']} audio items but input_features holds "
                        f"{len(media.arrays.get('input_features', ()))} clips")


def check_placeholders(token_ids: Any, media: MediaInputs | None, family: MediaFamily, where: str = "row") -> None:
    """The placeholder tokens of each kind in ``token_ids`` [T] equal the tokens ``media``'s items
    of that kind occupy, and the items agree with their arrays (:func:`check_media_inputs`).

    Raises:
        DataError: names ``where``, the kind and both counts (e.g. a sequence cut inside an image).
    """
    counts = family.count_placeholders(token_ids)
    expect = {k: 0 for k in family.token_ids}
    if media is not None:
        check_media_inputs(media, family, where)
        for kind, n in zip(media.kinds, media.num_tokens, strict=True):
            expect[kind] = expect.get(kind, 0) + n
    for kind, n in counts.items():
        if n != expect.get(kind, 0):
            items = sum(k == kind for k in (media.kinds if media is not None else ()))
            raise DataError(f"{where}: {n} {kind} placeholder tokens in token_ids but its media has {items} {kind} "
                            f"item(s) with {expect.get(kind, 0)} features: image/audio features and placeholder "
                            "tokens do not match (was the sequence cut inside a media item?)")
