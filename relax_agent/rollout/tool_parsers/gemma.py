"""Gemma 4: ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` with Gemma's own argument syntax,
``<|channel>thought ...<channel|>`` reasoning.

Reference: the Gemma 4 chat template (``tests/data/chat_templates/google-gemma-4-31B-it.jinja``,
macro ``format_argument``): keys bare, strings between ``<|"|>`` marks, numbers and
``true``/``false`` bare, objects ``{k:v}`` and lists ``[v,...]``. (Gemma 2 and 3 have no call
format of their own: use ``hermes_strict`` or ``json`` with them.)
"""

from __future__ import annotations

import json
import re
from typing import Any

from relax_agent.errors import ToolCallParseError
from relax_agent.rollout.parsers import ParsedAction
from relax_agent.rollout.tool_parsers._common import call, split_reasoning, strip_end_tokens

QUOTE = '<|"|>'
_KEY = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*")


def _value(s: str, i: int) -> tuple[Any, int]:
    if s.startswith(QUOTE, i):
        j = s.find(QUOTE, i + len(QUOTE))
        if j == -1:
            raise ToolCallParseError(f"unclosed string at {s[i:i + 40]!r}")
        return s[i + len(QUOTE):j], j + len(QUOTE)
    if s.startswith("{", i):
        return _object(s, i + 1)
    if s.startswith("[", i):
        out: list[Any] = []
        i += 1
        if s.startswith("]", i):
            return out, i + 1
        while True:
            v, i = _value(s, i)
            out.append(v)
            if s.startswith("]", i):
                return out, i + 1
            if not s.startswith(",", i):
                raise ToolCallParseError(f"expected ',' or ']' at {s[i:i + 40]!r}")
            i += 1
    m = re.compile(r"[^,\]}]+").match(s, i)
    if m is None:
        raise ToolCallParseError(f"expected a value at {s[i:i + 40]!r}")
    token = m.group().strip()
    literal = {"true": True, "false": False, "null": None, "None": None, "True": True, "False": False}
    if token in literal:
        return literal[token], m.end()
    try:
        return json.loads(token), m.end()
    except json.JSONDecodeError:
        raise ToolCallParseError(f"bare value {token[:40]!r} is not a number, boolean or quoted string") from None


def _object(s: str, i: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    if s.startswith("}", i):
        return out, i + 1
    while True:
        if s.startswith(QUOTE, i):
            key, i = _value(s, i)
        else:
            m = _KEY.match(s, i)
            if m is None:
                raise ToolCallParseError(f"expected a bare key at {s[i:i + 40]!r}")
            key, i = m.group(1), m.end()
        if not key or not s.startswith(":", i):
            raise ToolCallParseError(f"expected 'key:' at {s[i:i + 40]!r}")
        out[key], i = _value(s, i + 1)
        if s.startswith("}", i):
            return out, i + 1
        if not s.startswith(",", i):
            raise ToolCallParseError(f"expected ',' or '}}' at {s[i:i + 40]!r}")
        i += 1


def parse_arguments(text: str) -> dict[str, Any]:
    """``{key:value,...}`` in Gemma's syntax -> a dict.

    Raises:
        ToolCallParseError: the text is not one such object (message names where it failed).
    """
    if not text.startswith("{"):
        raise ToolCallParseError(f"arguments must start with '{{', got {text[:40]!r}")
    obj, end = _object(text, 1)
    if text[end:].strip():
        raise ToolCallParseError(f"arguments are followed by {text[end:][:40]!r}")
    return obj


def format_argument(value: Any) -> str:
    """``value`` in Gemma's syntax (the template's ``format_argument`` with bare keys)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{format_argument(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_argument(v) for v in value) + "]"
    return json.dumps(value)


class GemmaParser:
    """Strict Gemma 4 calls; text outside the call blocks is content.

    A block must be ``call:NAME`` then one argument object in Gemma's syntax and end with
    ``<tool_call|>``; anything else (a block cut at the token limit, JSON-style quoting, text
    after the object) is a parse error and no call. Special tokens are kept when decoding; the
    closing ``<turn|>`` / ``<|tool_response>`` is dropped.
    """

    family = "gemma"
    keeps_special_tokens = True
    OPEN, CLOSE = "<|tool_call>", "<tool_call|>"
    THINK = ("<|channel>", "<channel|>")
    END_TOKENS = ("<turn|>", "<|tool_response>", "<eos>")
    _HEAD = re.compile(r"call:([A-Za-z_][\w.\-]*)")

    def format(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) as the template writes them."""
        return "".join(f"{self.OPEN}call:{c['name']}{format_argument(dict(c['arguments']))}{self.CLOSE}" for c in calls)

    def parse(self, text: str) -> ParsedAction:
        """Reasoning (the thought channel), the ``<|tool_call>`` blocks as calls (a malformed block as an
        error) and the text around them as content; end tokens are stripped."""
        reasoning, rest = split_reasoning(strip_end_tokens(text, self.END_TOKENS), *self.THINK)
        reasoning = reasoning[len("thought"):].strip() if reasoning.startswith("thought") else reasoning
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        content: list[str] = []
        pos = 0
        while (start := rest.find(self.OPEN, pos)) != -1:
            content.append(rest[pos:start])
            body_start = start + len(self.OPEN)
            close = rest.find(self.CLOSE, body_start)
            if close == -1:
                errors.append(f"tool call block has no closing {self.CLOSE}: {rest[body_start:][:200].strip()!r}")
                pos = len(rest)
                break
            body = rest[body_start:close].strip()
            m = self._HEAD.match(body)
            if m is None:
                errors.append(f"tool call block does not start with call:NAME: {body[:200]!r}")
            else:
                try:
                    calls.append(call(len(calls), m.group(1), parse_arguments(body[m.end():].strip())))
                except ToolCallParseError as exc:
                    errors.append(f"tool call {m.group(1)!r} arguments are not Gemma's syntax: {exc}")
            pos = close + len(self.CLOSE)
        content.append(rest[pos:])
        return ParsedAction("".join(content).strip(), tuple(calls), tuple(errors), reasoning)
