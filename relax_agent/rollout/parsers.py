"""Tool-call parsers: model text -> one OpenAI-format assistant message.

Parsers are registered by name (``rollout.tool_parser`` in the config). A parser never raises
on bad model output: malformed calls are reported in ``ParsedAction.errors`` so the
environment can grade them (a malformed call is a wrong answer, not a crash).
"""

from __future__ import annotations

import json
import re
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

    A final block whose closing tag is missing (the turn ended) is still parsed.
    ``arguments`` may be an object or a JSON string holding one; ``parameters`` is accepted
    as an alias.
    """

    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedAction:
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        for match in self._BLOCK.finditer(text):
            call, error = self._parse_block(match.group(1).strip(), len(calls))
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        content = self._BLOCK.sub("", text).strip()
        return ParsedAction(content, tuple(calls), tuple(errors))

    @staticmethod
    def _parse_block(body: str, index: int) -> tuple[dict[str, Any] | None, str]:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            return None, f"tool call is not valid JSON ({exc.msg} at char {exc.pos}): {body[:200]!r}"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, f"tool call must be an object with a string 'name': {body[:200]!r}"
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None, f"tool call arguments are not a JSON object: {args[:200]!r}"
        if not isinstance(args, dict):
            return None, f"tool call arguments must be an object, got {type(args).__name__}"
        return _call(index, obj["name"], args), ""


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesParser}


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
