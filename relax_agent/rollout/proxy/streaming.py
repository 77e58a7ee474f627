"""Streamed content: the deltas of a reply's text as it is sampled.

Content deltas are sent as the reply's text grows, held back only where the text
could still turn out to be part of a tool call or a stop string (so the deltas joined equal the
non-streamed ``content``); tool calls are sent as deltas (id and name, then the arguments) once
the reply is parsed, then the finish reason, with all log-probs in the choice's last chunk. With a
family parser whose call markers are special tokens (every family but Hermes/Qwen), content is sent
once the reply is parsed; with one that splits reasoning off (Qwen3), content streams only after
the reasoning block has closed.
"""

from __future__ import annotations

from relax_agent.rollout.json_parsers import FencedJsonParser, JsonParser
from relax_agent.rollout.parsers import HermesParser, ToolCallParser, reasoning_markers
from relax_agent.rollout.tool_parsers._common import split_reasoning


class ContentStreamer:
    """Turns a reply's growing text into content deltas whose concatenation is a prefix of the final
    ``content`` (see the module doc).

    Args:
        parser: the tool-call parser (decides which text may open a call).
        parse: the reply is parsed for tool calls (tools given, ``tool_choice`` not "none").
        stops: stop strings (content ends before the first).
        prefix: the prefill the reply continues: never sent (the deltas are the text after it).
    """

    def __init__(self, parser: ToolCallParser, parse: bool, stops: tuple[str, ...] = (), prefix: str = "") -> None:
        self.parse = parse
        self.stops = tuple(stops)
        self.openers = _openers(parser) if parse else ()
        self.strict_json = parse and isinstance(parser, JsonParser) and parser.strict
        self.think = reasoning_markers(parser) if parse else None
        self.prefix = prefix
        self.sent = prefix.lstrip() if parse else prefix

    def safe(self, text: str) -> str:
        """The part of ``text`` that will start the final content whatever is sampled next."""
        for s in self.stops:
            i = text.find(s)
            if i >= 0:
                text = text[:i]
        text = text[:len(text) - _partial_suffix(text, self.stops + self.openers)]
        if self.think:  # a family parser that splits reasoning off: content starts after the reasoning block
            if self.think[1] not in text:
                return ""
            text = split_reasoning(text, *self.think)[1]
        if self.parse:
            if self.strict_json and (not text.strip() or text.lstrip()[0] in "{["):
                return ""
            found = [text.find(o) for o in self.openers if o in text]
            if found:
                text = text[:min(found)]
            text = text.strip()
        return text.rstrip("\ufffd")

    def update(self, text: str) -> str:
        """The new delta for the reply's text so far ("" when nothing new is safe to send)."""
        safe = self.safe(text)
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, content: str | None) -> str:
        """The rest of the final ``content`` after what was sent (after the prefix when nothing else
        was sent: the parser may have trimmed the prefix)."""
        content = content or ""
        if self.sent in (self.prefix, self.prefix.lstrip()) and not content.startswith(self.sent):
            self.sent = content
            return continuation(content, self.prefix)
        assert content.startswith(self.sent), "streamed content is not a prefix of the final content"
        rest, self.sent = content[len(self.sent):], content
        return rest


def continuation(content: str | None, prefix: str) -> str:
    """The part of a reply's ``content`` after the ``prefix`` (a prefill) it continues; the content
    whole when it does not start with it (the parser trimmed or moved it)."""
    content = content or ""
    for head in (prefix, prefix.lstrip()):
        if head and content.startswith(head):
            return content[len(head):]
    return content


def _openers(parser: ToolCallParser) -> tuple[str, ...]:
    if isinstance(parser, HermesParser):
        return (HermesParser.OPEN,)
    if isinstance(parser, FencedJsonParser):
        return ("```",)
    if isinstance(parser, JsonParser):
        return ("{", "[")
    return ("",)  # unknown format: any text may be a call, so content is sent once parsed


def _partial_suffix(text: str, guards: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of one of ``guards``."""
    best = 0
    for g in guards:
        for k in range(min(len(g) - 1, len(text)), best, -1):
            if text.endswith(g[:k]):
                best = k
                break
    return best
