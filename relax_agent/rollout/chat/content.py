"""Content parts of chat messages: their text, the media parts among them, and the checks that refuse
an unknown part type or a media part for a text-only policy (a template would drop either silently);
the form chat templates read a part in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relax_agent.errors import ConfigError


def text_of(content: Any) -> str:
    """Flatten OpenAI content (a string or a list of content parts) to its text parts."""
    from relax_agent.multimodal.parts import TEXT_PART_TYPES

    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES)


def media_parts(messages: Sequence[dict[str, Any]]) -> list[tuple[int, str]]:
    """``(message index, part type)`` of every non-text content part in ``messages``."""
    from relax_agent.multimodal.parts import TEXT_PART_TYPES

    return [(i, str(p.get("type"))) for i, m in enumerate(messages) if isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") not in TEXT_PART_TYPES]


def check_parts(messages: Sequence[dict[str, Any]], where: str = "messages") -> None:
    """Refuse every content part relax-agent cannot render, for text and media policies alike: a
    part that is not a dict with a known ``type`` (text, ``input_text``, or a media type of
    :data:`~relax_agent.multimodal.parts.PART_KINDS`), and the known types it cannot take
    (``image_file``: an uploaded file's id). A chat template would silently drop such a part and
    the policy would train without it.

    Raises:
        ConfigError: names the message index, the part's index and type, and the types accepted.
    """
    from relax_agent.multimodal.parts import PART_KINDS, REFUSED_PART_TYPES, TEXT_PART_TYPES

    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in TEXT_PART_TYPES or kind in PART_KINDS:
                continue
            if kind in REFUSED_PART_TYPES:
                raise ConfigError(f"{where}[{i}] content part {j} has type {kind!r}, which relax-agent cannot take: "
                                  f"{REFUSED_PART_TYPES[kind]}")
            shown = f"type {kind!r}" if isinstance(p, dict) else f"no type (a {type(p).__name__}, not a dict)"
            raise ConfigError(f"{where}[{i}] content part {j} has {shown}: not a part relax-agent knows, and a chat "
                              f"template would drop it silently; expected one of {sorted([*TEXT_PART_TYPES, *PART_KINDS])}")


def check_media(messages: Sequence[dict[str, Any]], accepts_media: bool, where: str = "messages") -> None:
    """Refuse unknown content parts for every policy (:func:`check_parts`) and media content parts
    for a text-only policy (call it at start-up on the env's prompts).

    Args:
        messages: OpenAI-format chat messages.
        accepts_media: whether the policy takes image/audio/video parts.
        where: how the error names the list (e.g. ``"env.reset observation"``).

    Raises:
        ConfigError: a part :func:`check_parts` refuses; or ``accepts_media`` is False and a
            message has a media part: names the first one's message index and part type, and
            how many there are.
    """
    check_parts(messages, where)
    found = [] if accepts_media else media_parts(messages)
    if found:
        i, kind = found[0]
        more = f" ({len(found)} media parts in all)" if len(found) > 1 else ""
        raise ConfigError(
            f"{where}[{i}] has a {kind!r} content part{more}, but the policy is text-only "
            f"(ChatRenderer accepts_media=False): use a policy that takes media or an env whose messages are text"
        )


def template_part(part: dict[str, Any]) -> dict[str, Any]:
    """A content part in the form chat templates read: the Responses API's ``input_text`` as
    ``text`` and ``input_image`` (its ``image_url`` a string) as ``image_url``."""
    kind = part.get("type")
    if kind == "input_text":
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image":
        url = part.get("image_url")
        return {"type": "image_url", "image_url": url if isinstance(url, dict) else {"url": url}}
    return part
