"""Gymnasium spaces for chat messages (OpenAI format, with content parts)."""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

_ROLES = ("system", "user", "assistant", "tool")
CONTENT_PART_TYPES = ("text", "input_text", "image_url", "input_image", "image", "input_audio", "audio", "video_url",
                      "video")
"""Content-part ``type`` values accepted in a message's ``content`` list (OpenAI's chat parts, the
Responses API's ``input_text`` / ``input_image``, and the ``image``/``audio``/``video`` parts of
Hugging Face chat templates): every type the renderer can put in front of the policy."""


def _valid_part(part: Any) -> bool:
    if not isinstance(part, dict) or part.get("type") not in CONTENT_PART_TYPES:
        return False
    kind = part["type"]
    if kind in ("text", "input_text"):
        return isinstance(part.get("text"), str)
    if kind in ("image_url", "video_url", "input_image"):
        ref = part.get("image_url" if kind == "input_image" else kind)
        return isinstance(ref, str) or (isinstance(ref, dict) and isinstance(ref.get("url"), str))
    if kind == "input_audio":
        audio = part.get("input_audio")
        return isinstance(audio, dict) and isinstance(audio.get("data"), str)
    return True


def _valid_content(content: Any) -> bool:
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(_valid_part(p) for p in content)


def _valid_call(call: Any) -> bool:
    """An OpenAI tool call ``{"id", "type", "function": {"name", "arguments"}}`` or a flat ``{"name", "arguments"}``."""
    if not isinstance(call, dict):
        return False
    function = call.get("function", call)
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def is_message(msg: Any) -> bool:
    """True when ``msg`` is one OpenAI-format chat message: a known ``role``, ``content`` that is
    None, a string or a list of content parts (:data:`CONTENT_PART_TYPES`), and ``tool_calls``
    (if any) a list of tool calls."""
    if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
        return False
    if not _valid_content(msg.get("content")):
        return False
    calls = msg.get("tool_calls")
    return calls is None or (isinstance(calls, list) and all(_valid_call(c) for c in calls))


class MessageSpace(spaces.Space):
    """One chat message: ``{"role", "content", optional "tool_calls"}`` (an action)."""

    def __init__(self, seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        """False: a message is a dict of text, not a fixed-size array."""
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> dict[str, Any]:
        """A random assistant message of 1-15 lowercase letters (``mask`` and ``probability`` are ignored)."""
        n = int(self.np_random.integers(1, 16))
        text = "".join(chr(int(c)) for c in self.np_random.integers(97, 123, size=n))
        return {"role": "assistant", "content": text}

    def contains(self, x: Any) -> bool:
        """Whether ``x`` is a well-formed chat message (:func:`is_message`)."""
        return is_message(x)

    def __repr__(self) -> str:
        return "MessageSpace()"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, MessageSpace)


class ConversationSpace(spaces.Space):
    """A list of chat messages (an observation: the new messages of a step)."""

    def __init__(self, max_messages: int = 1024, seed: int | None = None):
        self.max_messages = max_messages
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        """False: a conversation is a list of dicts, not a fixed-size array."""
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict[str, Any]]:
        """A one-message conversation (``mask`` and ``probability`` are ignored)."""
        return [{"role": "user", "content": "hello"}]

    def contains(self, x: Any) -> bool:
        """Whether ``x`` is a list or tuple of at most ``max_messages`` well-formed chat messages."""
        return isinstance(x, (list, tuple)) and len(x) <= self.max_messages and all(is_message(m) for m in x)

    def __repr__(self) -> str:
        return f"ConversationSpace(max_messages={self.max_messages})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ConversationSpace) and other.max_messages == self.max_messages


def np_seed(rng: np.random.Generator) -> int:
    """A fresh int seed drawn from ``rng`` (for child generators)."""
    return int(rng.integers(0, 2**31 - 1))
