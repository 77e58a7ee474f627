"""Tool-call parsers: model text -> one OpenAI-format assistant message.

Parsers are registered by name (``rollout.tool_parser`` in the config). A parser never raises
on bad model output: malformed calls are reported in ``ParsedAction.errors`` so the
environment can grade them (a malformed call is a wrong answer, not a crash).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from relax_agent.errors import ConfigError


@dataclass(frozen=True)
class ParsedAction:
    """The parsed assistant turn.

    Attributes:
        content: text outside the tool-call blocks (stripped).
        tool_calls: OpenAI-format calls ``{"id", "type": "function", "function": {"name", "arguments": dict}}``.
        errors: one message per block that looked like a call but did not parse.
    """

    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()
    errors: tuple[str, ...] = field(default=())

    def message(self) -> dict[str, Any]:
        """The assistant message handed to ``env.step``."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        msg["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.errors:
            msg["parse_errors"] = list(self.errors)
        return msg


class ToolCallParser(Protocol):
    """Turns sampled text into a :class:`ParsedAction`."""

    def parse(self, text: str) -> ParsedAction: ...


def _call(index: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes / Qwen style).

    The JSON object right after ``<tool_call>`` is decoded on its own. ``arguments`` may be an
    object or a JSON string holding one; ``parameters`` is accepted as an alias.

    Args:
        strict: when False (``"hermes"``), a complete JSON object is a call even if junk
            follows it instead of ``</tool_call>`` (the junk is kept as content): a weak policy
            gets credit for the call itself. When True (``"hermes_strict"``), only whitespace
            and then ``</tool_call>`` (or the end of the turn) may follow the object; anything
            else makes the block a parse error. A policy trained with the lenient parser can
            learn to emit junk after its calls: evaluate with the strict one to see it.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _decoder = json.JSONDecoder()

    def __init__(self, strict: bool = False):
        self.strict = strict

    def parse(self, text: str) -> ParsedAction:
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        content: list[str] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) != -1:
            content.append(text[pos:start])
            body_start = start + len(self.OPEN)
            call, error, pos = self._parse_block(text, body_start, len(calls))
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        content.append(text[pos:])
        return ParsedAction("".join(content).strip(), tuple(calls), tuple(errors))

    def _parse_block(self, text: str, i: int, index: int) -> tuple[dict[str, Any] | None, str, int]:
        """Decode the call starting at ``text[i]``; returns (call, error, position after the block)."""
        close = text.find(self.CLOSE, i)
        end = len(text) if close == -1 else close + len(self.CLOSE)
        j = i + len(text[i:]) - len(text[i:].lstrip())
        try:
            obj, stop = self._decoder.raw_decode(text, j)
        except json.JSONDecodeError as exc:
            body = text[i:close if close != -1 else len(text)].strip()
            return None, f"tool call is not valid JSON ({exc.msg}): {body[:200]!r}", end
        rest = text[stop:]
        if rest.lstrip().startswith(self.CLOSE):
            end = stop + (len(rest) - len(rest.lstrip())) + len(self.CLOSE)
        elif self.strict and rest.strip():
            return None, f"tool call JSON is followed by {rest.strip()[:40]!r} instead of {self.CLOSE}", end
        elif close == -1 or text[stop:close].strip():
            end = stop  # no closing tag right after the object: keep what follows as content
        call, error = self._to_call(obj, index)
        return call, error, end

    @staticmethod
    def _to_call(obj: Any, index: int) -> tuple[dict[str, Any] | None, str]:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, f"tool call must be an object with a string 'name', got {json.dumps(obj)[:200]}"
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None, f"tool call arguments are not a JSON object: {args[:200]!r}"
        if not isinstance(args, dict):
            return None, f"tool call arguments must be an object, got {type(args).__name__}"
        return _call(index, obj["name"], args), ""


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "hermes_strict": lambda: HermesParser(strict=True),
}


def register_parser(name: str, factory: Callable[[], ToolCallParser]) -> None:
    """Make a parser available as ``rollout.tool_parser: NAME``."""
    _PARSERS[name] = factory


def build_parser(name: str) -> ToolCallParser:
    """The parser registered as ``name``.

    Raises:
        ConfigError: no parser has that name.
    """
    if name not in _PARSERS:
        raise ConfigError(f"rollout.tool_parser={name!r} is not a registered parser; known: {sorted(_PARSERS)}")
    return _PARSERS[name]()
