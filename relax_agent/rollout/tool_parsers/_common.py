"""Pieces the family parsers share: reasoning split, end-token strip, argument decoding, call dicts."""

from __future__ import annotations

import json
import re
from typing import Any

_decoder = json.JSONDecoder()


def call(index: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-format tool call ``{"id": "call_<index>", "type": "function", "function": {...}}``."""
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def strip_end_tokens(text: str, tokens: tuple[str, ...]) -> str:
    """``text`` without trailing end-of-turn tokens (and the whitespace around them)."""
    text = text.rstrip()
    changed = True
    while changed:
        changed = False
        for tok in tokens:
            if text.endswith(tok):
                text, changed = text[:-len(tok)].rstrip(), True
    return text


def split_reasoning(text: str, open_tag: str, close_tag: str) -> tuple[str, str]:
    """(reasoning, rest) of a reply that may open with a reasoning block.

    ``open_tag reasoning close_tag rest``; the open tag may be missing when the generation prompt
    already ends with it (DeepSeek V3.1 and Qwen3 thinking prompts). A block left open (the reply
    cut inside its reasoning) is all reasoning: ``rest`` is empty, so nothing in it counts as a call.
    Text before an open tag that is not at the start is not reasoning (returned as ``("", text)``).
    """
    body = text.lstrip()
    opened = body.startswith(open_tag)
    if opened:
        body = body[len(open_tag):]
    close = body.find(close_tag)
    if close == -1:
        return (body.strip(), "") if opened else ("", text)
    if not opened and open_tag in body[:close]:
        return "", text
    return body[:close].strip(), body[close + len(close_tag):]


def json_object(raw: str, what: str) -> tuple[dict[str, Any] | None, str]:
    """(the JSON object ``raw`` holds exactly, or None; the error naming ``what`` otherwise)."""
    body = raw.strip()
    try:
        obj, stop = _decoder.raw_decode(body)
    except json.JSONDecodeError as exc:
        return None, f"{what} are not valid JSON ({exc.msg}): {body[:200]!r}"
    if body[stop:].strip():
        return None, f"{what} JSON is followed by {body[stop:].strip()[:40]!r}"
    if not isinstance(obj, dict):
        return None, f"{what} must be a JSON object, got {type(obj).__name__}"
    return obj, ""


def typed_value(raw: str) -> Any:
    """A parameter value written as text (XML-style families): JSON when it decodes, else the string.

    Qwen3-Coder and GLM write string values bare and other values as JSON, so ``2`` is the number
    2 and ``Paris`` the string; Qwen3-Coder's template writes booleans and null the Python way
    (``True``, ``False``, ``None``), read as such too. A string value that spells a literal (``2``
    meant as text) cannot be told apart without the tool schema and comes back as the literal.
    """
    if raw in _PYTHON_LITERALS:
        return _PYTHON_LITERALS[raw]
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


_PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def value_text(value: Any) -> str:
    """The inverse of :func:`typed_value` for writing calls: strings bare, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def only_space(text: str) -> bool:
    return not text.strip()


NAME = re.compile(r"[A-Za-z_][\w.\-]*")
"""A function name as the families write it."""
