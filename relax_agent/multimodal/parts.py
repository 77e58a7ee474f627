"""Media content parts: building them (envs) and decoding them (the renderer's processor).

Parts are JSON-safe, so observations, rollout dumps and reward requests can carry them:

- image: ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (OpenAI);
  also accepted: ``{"type": "input_image", "image_url": "data:image/png;base64,..."}`` (the
  Responses API) and ``{"type": "image", "image": <PIL image | [H, W, 3] uint8 array | data URL>}``
  (Hugging Face chat templates);
- audio: ``{"type": "input_audio", "input_audio": {"data": <base64 WAV>, "format": "wav"}}``
  (OpenAI); also ``{"type": "audio", "audio": <[n] float array at 16 kHz | base64 WAV>}``;
- video: ``{"type": "video", "video": [<frame as an image value above>, ...]}`` (Hugging Face).

No torch here: envs import this module.
"""

from __future__ import annotations

import base64
import io
import wave
from typing import Any

import numpy as np

from relax_agent.errors import DataError

AUDIO_RATE_HZ = 16_000
"""Sample rate the audio processors take (Whisper features); other rates are resampled."""

MAX_IMAGE_PIXELS = 40_000_000
"""Default bound on an image's (or video frame's) width x height, read from its header before its
pixels are decoded (``rollout.max_image_pixels``): a 6000 x 6000 photo passes, an 8000 x 8000 one is
refused. Above it an image is refused, not downscaled: downscaling would still decode every pixel."""

MAX_VIDEO_FRAMES = 256
"""Default bound on a video part's frames (``rollout.max_video_frames``), counted before any frame is
decoded: with each frame under :data:`MAX_IMAGE_PIXELS` and resized to the processor's pixel budget,
it bounds a video's pixels and placeholder tokens too (2,000 frames of 224 x 224 made 64,000 tokens
and 3 GB)."""

MAX_AUDIO_CHANNELS = 8
"""A 2-D audio array's smaller dimension is its channels when it is at most this; the channels are
averaged to mono."""

MAX_ASPECT_RATIO = 200.0
"""The longest side over the shortest an image may have: Qwen's ``smart_resize`` raises above 200."""

PART_KINDS = {"image_url": "image", "input_image": "image", "image": "image", "input_audio": "audio",
              "audio": "audio", "video": "video", "video_url": "video"}
"""Content-part ``type`` -> media kind (``input_image``: the Responses API's image part, whose
``image_url`` is the data URL itself)."""
TEXT_PART_TYPES = ("text", "input_text")
"""Content-part types of text (``input_text``: the Responses API's)."""
REFUSED_PART_TYPES = {
    "image_file": "it names an uploaded file by id, which a rollout cannot fetch; send the image as an "
                  "image_url part with a base64 data URL",
    "file": "files are not media the policy reads; send images, audio or video as their own parts",
    "input_file": "files are not media the policy reads; send images, audio or video as their own parts",
}
"""Known content-part types relax-agent cannot take, with why and what to send instead."""


def part_kind(part: dict[str, Any]) -> str | None:
    """The media kind ("image", "audio", "video") of a content part; None for text and unknown parts."""
    return PART_KINDS.get(str(part.get("type")))


# -- building ------------------------------------------------------------------------------------

def png_data_url(image: Any) -> str:
    """``data:image/png;base64,...`` of a PIL image or an [H, W, 3] uint8 array."""
    from PIL import Image

    img = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(image: Any) -> dict[str, Any]:
    """An OpenAI ``image_url`` part holding ``image`` (PIL image or [H, W, 3] uint8) as a PNG data URL."""
    return {"type": "image_url", "image_url": {"url": png_data_url(image)}}


def wav_base64(samples: np.ndarray, rate_hz: int = AUDIO_RATE_HZ) -> str:
    """Base64 of a mono 16-bit WAV file of ``samples`` [n] float in [-1, 1]."""
    pcm = (np.clip(np.asarray(samples, dtype=np.float64), -1.0, 1.0) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate_hz)
        w.writeframes(pcm.tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def audio_part(samples: np.ndarray, rate_hz: int = AUDIO_RATE_HZ) -> dict[str, Any]:
    """An OpenAI ``input_audio`` part holding ``samples`` [n] float in [-1, 1] as a WAV file."""
    return {"type": "input_audio", "input_audio": {"data": wav_base64(samples, rate_hz), "format": "wav"}}


def video_part(frames: Any) -> dict[str, Any]:
    """A ``video`` part: each of ``frames`` ([H, W, 3] uint8 arrays or PIL images) as a PNG data URL."""
    return {"type": "video", "video": [png_data_url(f) for f in frames]}


# -- decoding ------------------------------------------------------------------------------------

def check_image_size(width: int, height: int, where: str = "image", max_pixels: int = MAX_IMAGE_PIXELS,
                     max_aspect_ratio: float = MAX_ASPECT_RATIO) -> None:
    """Refuse an image of ``width`` x ``height`` pixels (from its header) before its pixels are decoded.

    Raises:
        DataError: an empty image, more than ``max_pixels`` pixels (``rollout.max_image_pixels``) or a
            longest-over-shortest side ratio above ``max_aspect_ratio``; names ``where``, the size and the bound.
    """
    if width < 1 or height < 1:
        raise DataError(f"{where}: the image is {width}x{height} pixels; expected at least 1x1")
    if width * height > max_pixels:
        raise DataError(f"{where}: the image is {width}x{height} = {width * height} pixels, more than "
                        f"rollout.max_image_pixels={max_pixels}; send a smaller image or raise the bound")
    ratio = max(width, height) / min(width, height)
    if ratio > max_aspect_ratio:
        raise DataError(f"{where}: the image is {width}x{height} pixels, an aspect ratio of {ratio:.0f}:1; the policy's "
                        f"image processor takes at most {max_aspect_ratio:g}:1 (longest side over shortest)")


def decode_image(value: Any, where: str = "image", max_pixels: int = MAX_IMAGE_PIXELS,
                 max_aspect_ratio: float = MAX_ASPECT_RATIO) -> Any:
    """A PIL RGB image from a PIL image, an [H, W, 3] array, a data URL or a part dict.

    A data URL's size is read from its header (PIL's lazy open) and checked by
    :func:`check_image_size` before its pixels are decoded.

    Raises:
        DataError: anything else (names ``where``); remote URLs are refused (no network at rollout);
            an image over ``max_pixels`` or ``max_aspect_ratio`` (PIL's own decompression-bomb error
            included).
    """
    from PIL import Image

    if isinstance(value, dict):
        value = value.get("image_url", value.get("image"))
        value = value.get("url") if isinstance(value, dict) else value
    if isinstance(value, Image.Image):
        check_image_size(*value.size, where, max_pixels, max_aspect_ratio)
        return value.convert("RGB")
    if isinstance(value, np.ndarray):
        if value.ndim < 2:
            raise DataError(f"{where}: expected an [H, W, 3] image array; got shape {list(value.shape)}")
        check_image_size(value.shape[1], value.shape[0], where, max_pixels, max_aspect_ratio)
        return Image.fromarray(value.astype(np.uint8)).convert("RGB")
    if isinstance(value, str) and value.startswith("data:") and ";base64," in value:
        try:
            image = Image.open(io.BytesIO(base64.b64decode(value.split(",", 1)[1])))  # the header only
        except Image.DecompressionBombError as exc:
            raise DataError(f"{where}: the image is larger than rollout.max_image_pixels={max_pixels} "
                            f"(PIL refused it as a decompression bomb: {exc})") from exc
        except Exception as exc:
            raise DataError(f"{where}: the data URL is not a readable image ({type(exc).__name__}: {exc})") from exc
        check_image_size(*image.size, where, max_pixels, max_aspect_ratio)
        try:
            return image.convert("RGB")
        except Exception as exc:
            raise DataError(f"{where}: the data URL is not a readable image ({type(exc).__name__}: {exc})") from exc
    shown = value[:60] if isinstance(value, str) else type(value).__name__
    raise DataError(f"{where}: expected a PIL image, an [H, W, 3] array or a base64 data URL; got {shown!r}")


def decode_audio(value: Any, where: str = "audio") -> np.ndarray:
    """[n] float32 mono samples at :data:`AUDIO_RATE_HZ` from a part dict, a base64 WAV, an array or a list of floats (16 kHz).

    Raises:
        DataError: not a WAV (names ``where``), not 8/16/32-bit PCM, no samples (0 seconds) or
            NaN / inf samples.
    """
    if isinstance(value, dict):
        value = value.get("input_audio", value.get("audio"))
        value = value.get("data") if isinstance(value, dict) else value
    if isinstance(value, (np.ndarray, list, tuple)):
        try:
            samples = np.asarray(value, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise DataError(f"{where}: expected a float array of samples ({type(exc).__name__}: {exc})") from exc
        return _checked_audio(_mono(samples, where), where)
    if not isinstance(value, str):
        raise DataError(f"{where}: expected base64 WAV data or a float array; got {type(value).__name__}")
    try:
        with wave.open(io.BytesIO(base64.b64decode(value))) as w:
            rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
            raw = w.readframes(w.getnframes())
    except Exception as exc:
        raise DataError(f"{where}: not a base64 WAV file ({type(exc).__name__}: {exc})") from exc
    dtypes: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype("<i2"), 4: np.dtype("<i4")}
    dtype = dtypes.get(width)
    if dtype is None:
        raise DataError(f"{where}: {8 * width}-bit WAV samples are not supported; expected 8, 16 or 32-bit PCM")
    pcm = np.frombuffer(raw, dtype=dtype).astype(np.float32)
    pcm = (pcm - 128.0) / 128.0 if width == 1 else pcm / float(2 ** (8 * width - 1))
    pcm = pcm.reshape(-1, channels).mean(axis=1)
    if rate != AUDIO_RATE_HZ and len(pcm):
        n = int(round(len(pcm) * AUDIO_RATE_HZ / rate))
        pcm = np.interp(np.linspace(0, len(pcm) - 1, n), np.arange(len(pcm)), pcm).astype(np.float32)
    return _checked_audio(pcm, where)


def _mono(samples: np.ndarray, where: str) -> np.ndarray:
    """[n] samples of a [n] array, or of a [n, c] / [c, n] one (c <= :data:`MAX_AUDIO_CHANNELS`
    channels, averaged); DataError naming ``where`` for any other shape."""
    if samples.ndim <= 1:
        return samples.reshape(-1)
    if samples.ndim == 2:
        axis = int(np.argmin(samples.shape))
        if samples.shape[axis] <= MAX_AUDIO_CHANNELS and samples.shape[axis] < samples.shape[1 - axis]:
            return samples.mean(axis=axis)
    raise DataError(f"{where}: an audio array of shape {list(samples.shape)}; expected [samples] or "
                    f"[samples, channels] with at most {MAX_AUDIO_CHANNELS} channels")


def _checked_audio(samples: np.ndarray, where: str) -> np.ndarray:
    """``samples`` [n] unchanged; DataError naming ``where`` for 0 samples or NaN / inf ones."""
    if samples.size == 0:
        raise DataError(f"{where}: the audio has 0 samples (0 seconds); expected at least one sample")
    bad = int(np.count_nonzero(~np.isfinite(samples)))
    if bad:
        raise DataError(f"{where}: {bad} of the audio's {samples.size} samples are NaN or inf; expected finite "
                        "samples in [-1, 1]")
    return samples


def video_frame_count(value: Any) -> int:
    """Frames of a ``video`` part (or a list / [n, H, W, 3] array of frames), without decoding them;
    DataError for a part without frames."""
    frames = value.get("video", value.get("video_url")) if isinstance(value, dict) else value
    if frames is None:
        raise DataError("a video part needs its frames under 'video' or 'video_url'")
    return len(frames)


def decode_video(value: Any, where: str = "video", max_pixels: int = MAX_IMAGE_PIXELS,
                 max_aspect_ratio: float = MAX_ASPECT_RATIO) -> list[Any]:
    """The frames (PIL RGB images) of a ``video`` part or a list of frames.

    Raises:
        DataError: not a non-empty list of frames (names ``where``); a frame refused by :func:`decode_image`.
    """
    frames = value.get("video", value.get("video_url")) if isinstance(value, dict) else value
    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        frames = list(frames)
    if not isinstance(frames, (list, tuple)) or not frames:
        raise DataError(f"{where}: expected a non-empty list of frames; got {type(frames).__name__}")
    return [decode_image(f, f"{where} frame {i}", max_pixels, max_aspect_ratio) for i, f in enumerate(frames)]
