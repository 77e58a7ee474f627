"""Pieces the family parsers share: reasoning split, end-token strip, argument decoding, call dicts."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
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


def split_reasoning(text: str, open_tag: str, close_tag: str, call_open: str = "") -> tuple[str, str]:
    """(reasoning, rest) of a reply that may open with a reasoning block.

    ``open_tag reasoning close_tag rest``; the open tag may be missing when the generation prompt
    already ends with it (DeepSeek V3.1 and Qwen3 thinking prompts). A block left open is all
    reasoning (the reply cut inside it: ``rest`` is empty, so nothing in it counts as a call), unless
    the family's ``call_open`` marker follows: that ends the reasoning, as in vLLM's reasoning parsers
    (a model that skipped ``close_tag`` and called a tool). Text before an open tag that is not at the
    start is not reasoning (returned as ``("", text)``).
    """
    body = text.lstrip()
    opened = body.startswith(open_tag)
    if opened:
        body = body[len(open_tag):]
    close = body.find(close_tag)
    if close == -1:
        at = body.find(call_open) if call_open and opened else -1
        if at != -1:
            return body[:at].strip(), body[at:]
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


_SCHEMA_TYPE_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_TYPE_ALIASES = {"str": "string", "int": "integer", "float": "number", "double": "number", "bool": "boolean",
                 "dict": "object", "list": "array"}


def param_schemas(tools: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{function name: {parameter: its JSON schema}}`` of OpenAI tool schemas ``tools`` (entries
    ``{"type": "function", "function": {"name", "parameters": {"properties"}}}`` or the bare function)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = props
    return out


def _schema_types(schema: dict[str, Any]) -> set[str]:
    """The JSON types ``schema`` allows: its ``type`` (one or a list), its ``enum`` values' types and
    those of its ``anyOf``/``oneOf``/``allOf`` choices; ``{"string"}`` when it names none."""
    found = schema.get("type")
    types = {found} if isinstance(found, str) else {t for t in found if isinstance(t, str)} if isinstance(found, list) else set()
    for value in schema.get("enum") or []:
        types.add("null" if value is None else "boolean" if isinstance(value, bool) else "integer" if isinstance(value, int)
                  else "number" if isinstance(value, float) else "string" if isinstance(value, str)
                  else "array" if isinstance(value, list) else "object")
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) or []:
            if isinstance(choice, dict):
                types |= _schema_types(choice)
    return {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types} or {"string"}


def schema_value(raw: str, schema: Any) -> Any:
    """A parameter value written as text, typed by its JSON ``schema`` as vLLM's XML-style parsers
    type it (GLM-4.5, Qwen3-Coder): the first of null, integer, number, boolean, object, array, string
    that the schema allows and ``raw`` spells (so ``75001`` stays the string ``"75001"`` for a string
    parameter). Without a schema (a parameter the tools do not declare): :func:`typed_value`."""
    if not isinstance(schema, dict):
        return typed_value(raw)
    types = _schema_types(schema)
    for kind in _SCHEMA_TYPE_ORDER:
        if kind in types and (value := _as_type(raw, kind)) is not _NO_VALUE:
            return value
    return typed_value(raw)


_NO_VALUE = object()


def _as_type(raw: str, kind: str) -> Any:
    """``raw`` read as JSON type ``kind``, or ``_NO_VALUE`` when it does not spell one."""
    if kind == "string":
        return raw
    if kind == "null":
        return None if raw.strip().lower() in ("null", "none") else _NO_VALUE
    if kind == "boolean":
        return {"true": True, "1": True, "false": False, "0": False}.get(raw.strip().lower(), _NO_VALUE)
    if kind == "integer":
        try:
            return int(raw)
        except ValueError:
            return _NO_VALUE
    if kind == "number":
        try:
            number = float(raw)
        except ValueError:
            return _NO_VALUE
        return _NO_VALUE if not math.isfinite(number) else int(number) if number == int(number) else number
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return _NO_VALUE
    return value if isinstance(value, dict if kind == "object" else list) else _NO_VALUE


def value_text(value: Any) -> str:
    """The inverse of :func:`typed_value` for writing calls: strings bare, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def only_space(text: str) -> bool:
    return not text.strip()


NAME = re.compile(r"[A-Za-z_][\w.\-]*")
"""A function name as the families write it."""


class SectionParser:
    """Families whose calls sit in closed sections of closed calls (DeepSeek V3, Kimi K2).

    Subclasses set ``BEGIN``/``END`` (the section), ``CALL_BEGIN``/``CALL_END`` (one call), ``THINK``
    (reasoning markers), ``END_TOKENS`` (dropped from the reply's end) and implement
    :meth:`_one_call`. Strict: text between calls or a call that does not parse is a parse error and
    no call of that section; text around sections is content, and every section's calls count (as
    vLLM reads them). A section left open (a reply cut at the
    token limit) keeps its complete calls, its cut last call is a parse error (vLLM keeps the
    complete calls too).
    """

    BEGIN: str
    END: str
    CALL_BEGIN: str
    CALL_END: str
    THINK: tuple[str, str]
    END_TOKENS: tuple[str, ...]

    def parse(self, text: str) -> Any:
        from relax_agent.rollout.parsers import ParsedAction

        reasoning, rest = split_reasoning(strip_end_tokens(text, self.END_TOKENS), *self.THINK, call_open=self.BEGIN)
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        content: list[str] = []
        pos = 0
        while (at := rest.find(self.BEGIN, pos)) != -1:
            content.append(rest[pos:at])
            section = rest[at + len(self.BEGIN):]
            close = section.find(self.END)
            found, error = self._calls(section if close == -1 else section[:close], cut=close == -1)
            if close == -1:
                error = error or f"tool calls section has no closing {self.END}"
            calls += [call(len(calls) + i, c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(found)]
            errors += [error] if error else []
            pos = len(rest) if close == -1 else at + len(self.BEGIN) + close + len(self.END)
        content.append(rest[pos:])
        return ParsedAction("".join(content).strip(), tuple(calls), tuple(errors), reasoning)

    def _calls(self, section: str, cut: bool = False) -> tuple[list[dict[str, Any]], str]:
        """(calls, error) of a section's body; ``cut``: the section was left open, so a last call
        without its end marker is an error beside the complete calls before it."""
        calls: list[dict[str, Any]] = []
        pos = 0
        while section[pos:].strip():
            start = section.find(self.CALL_BEGIN, pos)
            if start == -1 or section[pos:start].strip():
                return [], f"tool calls section holds {section[pos:][:80]!r} outside a call"
            end = section.find(self.CALL_END, start)
            if end == -1:
                return (calls if cut else []), f"tool call has no closing {self.CALL_END}: {section[start:][:200]!r}"
            name, args, error = self._one_call(section[start + len(self.CALL_BEGIN):end])
            if error:
                return [], error
            calls.append(call(len(calls), name, args))
            pos = end + len(self.CALL_END)
        return calls, ""

    def _one_call(self, body: str) -> tuple[str, Any, str]:
        """(name, arguments, "") of one call's body, or ("", None, error)."""
        raise NotImplementedError
