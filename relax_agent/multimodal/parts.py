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

def decode_image(value: Any, where: str = "image") -> Any:
    """A PIL RGB image from a PIL image, an [H, W, 3] array, a data URL or a part dict.

    Raises:
        DataError: anything else (names ``where``); remote URLs are refused (no network at rollout).
    """
    from PIL import Image

    if isinstance(value, dict):
        value = value.get("image_url", value.get("image"))
        value = value.get("url") if isinstance(value, dict) else value
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, np.ndarray):
        return Image.fromarray(value.astype(np.uint8)).convert("RGB")
    if isinstance(value, str) and value.startswith("data:") and ";base64," in value:
        try:
            return Image.open(io.BytesIO(base64.b64decode(value.split(",", 1)[1]))).convert("RGB")
        except Exception as exc:
            raise DataError(f"{where}: the data URL is not a readable image ({type(exc).__name__}: {exc})") from exc
    shown = value[:60] if isinstance(value, str) else type(value).__name__
    raise DataError(f"{where}: expected a PIL image, an [H, W, 3] array or a base64 data URL; got {shown!r}")


def decode_audio(value: Any, where: str = "audio") -> np.ndarray:
    """[n] float32 mono samples at :data:`AUDIO_RATE_HZ` from a part dict, a base64 WAV, an array or a list of floats (16 kHz).

    Raises:
        DataError: not a WAV (names ``where``) or not 8/16/32-bit PCM.
    """
    if isinstance(value, dict):
        value = value.get("input_audio", value.get("audio"))
        value = value.get("data") if isinstance(value, dict) else value
    if isinstance(value, (np.ndarray, list, tuple)):
        return np.asarray(value, dtype=np.float32).reshape(-1)
    if not isinstance(value, str):
        raise DataError(f"{where}: expected base64 WAV data or a float array; got {type(value).__name__}")
    try:
        with wave.open(io.BytesIO(base64.b64decode(value))) as w:
            rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
            raw = w.readframes(w.getnframes())
    except Exception as exc:
        raise DataError(f"{where}: not a base64 WAV file ({type(exc).__name__}: {exc})") from exc
    dtype = {1: np.uint8, 2: "<i2", 4: "<i4"}.get(width)
    if dtype is None:
        raise DataError(f"{where}: {8 * width}-bit WAV samples are not supported; expected 8, 16 or 32-bit PCM")
    pcm = np.frombuffer(raw, dtype=dtype).astype(np.float32)
    pcm = (pcm - 128.0) / 128.0 if width == 1 else pcm / float(2 ** (8 * width - 1))
    pcm = pcm.reshape(-1, channels).mean(axis=1)
    if rate != AUDIO_RATE_HZ:
        n = int(round(len(pcm) * AUDIO_RATE_HZ / rate))
        pcm = np.interp(np.linspace(0, len(pcm) - 1, n), np.arange(len(pcm)), pcm).astype(np.float32)
    return pcm


def video_frame_count(value: Any) -> int:
    """Frames of a ``video`` part (or a list / [n, H, W, 3] array of frames), without decoding them."""
    frames = value.get("video", value.get("video_url")) if isinstance(value, dict) else value
    return len(frames)


def decode_video(value: Any, where: str = "video") -> list[Any]:
    """The frames (PIL RGB images) of a ``video`` part or a list of frames.

    Raises:
        DataError: not a non-empty list of frames (names ``where``).
    """
    frames = value.get("video", value.get("video_url")) if isinstance(value, dict) else value
    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        frames = list(frames)
    if not isinstance(frames, (list, tuple)) or not frames:
        raise DataError(f"{where}: expected a non-empty list of frames; got {type(frames).__name__}")
    return [decode_image(f, f"{where} frame {i}") for i, f in enumerate(frames)]
