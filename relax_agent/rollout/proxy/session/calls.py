"""Messages and tool calls as text: the normal form a sent message must match a recorded one in,
and a tool call written in a parser's own format (the forced opening of ``tool_choice``, edited
history re-rendered)."""

from __future__ import annotations

import json
from typing import Any

from relax_agent.rollout.chat import text_of
from relax_agent.rollout.parsers import FencedJsonParser, HermesParser, JsonParser, ToolCallParser, WritesCalls


def normalise(message: dict[str, Any]) -> str:
    """What must agree for a sent message to match a recorded one: role, text, tool calls
    (name and decoded arguments), canonical JSON."""
    out: dict[str, Any] = {"role": message["role"], "content": text_of(message.get("content"))}
    if message["role"] == "assistant":
        out["tool_calls"] = [[c["function"]["name"], _decoded(c["function"].get("arguments"))]
                             for c in message.get("tool_calls") or ()]
    return json.dumps(out, sort_keys=True, ensure_ascii=False)


def _decoded(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def call_opening(parser: ToolCallParser) -> str | None:
    """The text every call of ``parser``'s format starts with, up to the function name; None if unknown."""
    if isinstance(parser, HermesParser):
        return HermesParser.OPEN + '\n{"name": "'
    if isinstance(parser, FencedJsonParser):
        return '```json\n{"name": "'
    if isinstance(parser, JsonParser):
        return '{"name": "'
    return None


def call_text(parser: ToolCallParser, call: dict[str, Any]) -> str:
    """One OpenAI tool call written in ``parser``'s format (for re-rendering edited history)."""
    body = json.dumps({"name": call["function"]["name"], "arguments": _decoded(call["function"].get("arguments"))},
                      ensure_ascii=False)
    if isinstance(parser, FencedJsonParser):
        return f"```json\n{body}\n```"
    if isinstance(parser, JsonParser):
        return body
    if not isinstance(parser, HermesParser) and isinstance(parser, WritesCalls):
        return parser.format([{"name": call["function"]["name"], "arguments": _decoded(call["function"].get("arguments"))}])
    return f"{HermesParser.OPEN}\n{body}\n{HermesParser.CLOSE}"
