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


class SectionParser:
    """Families whose calls sit in one closed section of closed calls (DeepSeek V3, Kimi K2).

    Subclasses set ``BEGIN``/``END`` (the section), ``CALL_BEGIN``/``CALL_END`` (one call), ``THINK``
    (reasoning markers), ``END_TOKENS`` (dropped from the reply's end) and implement
    :meth:`_one_call`. Strict: an unclosed section or call, text between calls or after the section,
    or a call that does not parse is a parse error and no call; text before the section is content.
    """

    BEGIN: str
    END: str
    CALL_BEGIN: str
    CALL_END: str
    THINK: tuple[str, str]
    END_TOKENS: tuple[str, ...]

    def parse(self, text: str) -> Any:
        from relax_agent.rollout.parsers import ParsedAction

        reasoning, rest = split_reasoning(strip_end_tokens(text, self.END_TOKENS), *self.THINK)
        at = rest.find(self.BEGIN)
        if at == -1:
            return ParsedAction(rest.strip(), (), (), reasoning)
        content, section = rest[:at].strip(), rest[at + len(self.BEGIN):]
        close = section.find(self.END)
        if close == -1:
            return ParsedAction(content, (), (f"tool calls section has no closing {self.END}: {section[:200]!r}",), reasoning)
        calls, error = self._calls(section[:close])
        if not error and section[close + len(self.END):].strip():
            error = f"tool calls section is followed by {section[close + len(self.END):].strip()[:40]!r}"
        return ParsedAction(content, () if error else tuple(calls), (error,) if error else (), reasoning)

    def _calls(self, section: str) -> tuple[list[dict[str, Any]], str]:
        calls: list[dict[str, Any]] = []
        pos = 0
        while section[pos:].strip():
            start = section.find(self.CALL_BEGIN, pos)
            if start == -1 or section[pos:start].strip():
                return [], f"tool calls section holds {section[pos:][:80]!r} outside a call"
            end = section.find(self.CALL_END, start)
            if end == -1:
                return [], f"tool call has no closing {self.CALL_END}: {section[start:][:200]!r}"
            name, args, error = self._one_call(section[start + len(self.CALL_BEGIN):end])
            if error:
                return [], error
            calls.append(call(len(calls), name, args))
            pos = end + len(self.CALL_END)
        return calls, ""

    def _one_call(self, body: str) -> tuple[str, Any, str]:
        """(name, arguments, "") of one call's body, or ("", None, error)."""
        raise NotImplementedError
