"""Messages and tool calls as text: the normal form a sent message must match a recorded one in,
and a tool call written in a parser's own format (the forced opening of ``tool_choice``, edited
history re-rendered)."""

from __future__ import annotations

import json
from typing import Any

from relax_agent.rollout.chat import text_of
from relax_agent.rollout.json_parsers import FencedJsonParser, JsonParser
from relax_agent.rollout.parsers import HermesParser, ToolCallParser, WritesCalls


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


def content_key(message: dict[str, Any]) -> tuple[str, str]:
    """What an assistant message must still hold to count as a sampled reply sent back, however a
    framework re-templated it: its text with every run of whitespace made one space (stripped), and
    its tool calls as parsed (name and decoded arguments, canonical JSON; call ids ignored)."""
    text = " ".join(text_of(message.get("content")).split())
    calls = [[c["function"]["name"], _decoded(c["function"].get("arguments"))] for c in message.get("tool_calls") or ()]
    return text, json.dumps(calls, sort_keys=True, ensure_ascii=False)


def continues(sent: tuple[str, str], reply: tuple[str, str]) -> int:
    """How a sent assistant message (:func:`content_key`) holds a reply's: 2 the same, 1 the same tool
    calls with the reply's text inside a longer (annotated, prefixed) text, 0 not at all (nor ever a
    reply with neither text nor tool calls)."""
    if sent[1] != reply[1] or not (reply[0] or reply[1] != "[]"):
        return 0
    if sent[0] == reply[0]:
        return 2
    return 1 if reply[0] in sent[0] else 0
