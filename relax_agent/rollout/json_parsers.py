"""The JSON tool-call parsers: ``json`` / ``json_strict`` (bare JSON: ``{"name": ..., "arguments": {...}}`` or a
list of them) and ``json_fenced`` / ``json_fenced_strict`` (the same inside a Markdown fence); registered by
:func:`relax_agent.rollout.parsers.build_parser` (see that module for the contract a parser keeps)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from relax_agent.rollout.parsers import ParsedAction, ToolCallParser, call_from_object


def calls_of(obj: Any, first_index: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The calls in a decoded JSON value: one call object, or a list of them (errors per element)."""
    calls: list[dict[str, Any]] = []
    errors: list[str] = []
    for item in obj if isinstance(obj, list) else [obj]:
        call, error = call_from_object(item, first_index + len(calls))
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    if isinstance(obj, list) and not obj:
        errors.append("tool call list is empty")
    return calls, errors


def looks_like_call(obj: Any) -> bool:
    """``obj`` is a call object (an object with a ``name``) or a non-empty list of them."""
    items = obj if isinstance(obj, list) else [obj]
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


class JsonParser:
    """Bare JSON calls: ``{"name": ..., "arguments": {...}}`` or a list of such objects.

    The native format of many instruction-tuned models (e.g. Qwen2.5-Coder prompted with tool
    schemas) when no tool-call tags are in their template.

    Args:
        strict: when True (``"json_strict"``), the whole response (stripped) must be one call
            object or one list of call objects; a response that starts with ``{`` or ``[`` but is
            not exactly that (invalid JSON, text after it, an object without ``name``) is a parse
            error, and any other response is a plain answer (no call). When False (``"json"``),
            every JSON object or list in the text that decodes and whose objects all have a
            ``name`` is a call (or calls), text around them is content; an object that starts
            like a call (``{"name"``) but does not decode is a parse error.
    """

    _decoder = json.JSONDecoder()
    _CALL_START = re.compile(r'[\[{]\s*(\{\s*)?"name"\s*:')

    def __init__(self, strict: bool = False):
        self.strict = strict

    def format(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) as one bare JSON object, or a list of several."""
        return json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)

    def parse(self, text: str) -> ParsedAction:
        """Every JSON call object (or list of them) in ``text`` as a call; the rest is content. With
        ``strict``, a reply starting with ``{``/``[`` must be exactly one JSON value of calls (else a parse
        error), and any other reply is content."""
        if self.strict:
            return self._parse_strict(text)
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        content: list[str] = []
        pos = i = 0
        while i < len(text):
            if text[i] not in "{[":
                i += 1
                continue
            try:
                obj, stop = self._decoder.raw_decode(text, i)
            except json.JSONDecodeError as exc:
                if self._CALL_START.match(text, i):
                    content.append(text[pos:i])
                    errors.append(f"tool call is not valid JSON ({exc.msg}): {text[i:i + 200]!r}")
                    pos = i = len(text)
                    break
                i += 1
                continue
            if not looks_like_call(obj):
                i = stop
                continue
            content.append(text[pos:i])
            found, bad = calls_of(obj, len(calls))
            calls += found
            errors += bad
            pos = i = stop
        content.append(text[pos:])
        return ParsedAction("".join(content).strip(), tuple(calls), tuple(errors))

    def _parse_strict(self, text: str) -> ParsedAction:
        body = text.strip()
        if not body.startswith(("{", "[")):
            return ParsedAction(body)
        try:
            obj, stop = self._decoder.raw_decode(body)
        except json.JSONDecodeError as exc:
            return ParsedAction("", (), (f"tool call is not valid JSON ({exc.msg}): {body[:200]!r}",))
        if body[stop:].strip():
            return ParsedAction("", (), (f"tool call JSON is followed by {body[stop:].strip()[:40]!r}",))
        calls, errors = calls_of(obj, 0)
        return ParsedAction("", tuple(calls), tuple(errors))


class FencedJsonParser:
    """JSON calls (as :class:`JsonParser`) inside Markdown code fences: ````json ... ````.

    Args:
        strict: when True (``"json_fenced_strict"``), only closed fences tagged ``json`` count,
            and each body must be exactly one call object or list of calls (else a parse error).
            When False (``"json_fenced"``), a fence tagged ``json`` or untagged counts, an
            unclosed last fence runs to the end of the text, and text after the JSON value inside
            the fence is ignored; an untagged fence whose body is not a call is kept as content
            (it may be code), a ``json`` one is a parse error.
    Text outside the fences is content.
    """

    _FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n?")
    _decoder = json.JSONDecoder()

    def __init__(self, strict: bool = False):
        self.strict = strict

    def format(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) as one fenced ``json`` block (an object, or a list of several)."""
        body = calls[0] if len(calls) == 1 else calls
        return f"```json\n{json.dumps(body, ensure_ascii=False)}\n```"

    def parse(self, text: str) -> ParsedAction:
        """The calls in ```` ```json ```` fences (and, not strict, untagged fences); other text and fences
        are content."""
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        content: list[str] = []
        pos = 0
        while (fence := self._FENCE.search(text, pos)) is not None:
            tag = fence.group(1).lower()
            close = text.find("```", fence.end())
            end = len(text) if close == -1 else close + 3
            body = text[fence.end():close if close != -1 else len(text)]
            wanted = tag == "json" or (not self.strict and tag == "")
            if not wanted or (self.strict and close == -1):
                content.append(text[pos:end])
                pos = end
                continue
            found, bad = self._body(body, tag, len(calls))
            if found is None:  # an untagged fence that holds no call: ordinary content
                content.append(text[pos:end])
            else:
                content.append(text[pos:fence.start()])
                calls += found
                errors += bad
            pos = end
        content.append(text[pos:])
        return ParsedAction("".join(content).strip(), tuple(calls), tuple(errors))

    def _body(self, body: str, tag: str, index: int) -> tuple[list[dict[str, Any]] | None, list[str]]:
        stripped = body.strip()
        try:
            obj, stop = self._decoder.raw_decode(stripped)
        except json.JSONDecodeError as exc:
            if tag == "":
                return None, []
            return [], [f"fenced tool call is not valid JSON ({exc.msg}): {stripped[:200]!r}"]
        if tag == "" and not looks_like_call(obj):
            return None, []
        if self.strict and stripped[stop:].strip():
            return [], [f"fenced tool call JSON is followed by {stripped[stop:].strip()[:40]!r}"]
        return calls_of(obj, index)


JSON_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "json": JsonParser,
    "json_strict": lambda: JsonParser(strict=True),
    "json_fenced": FencedJsonParser,
    "json_fenced_strict": lambda: FencedJsonParser(strict=True),
}
"""The parsers of this module by ``rollout.tool_parser`` name."""
