"""gpt-oss: OpenAI harmony messages; ``analysis`` is reasoning, ``commentary to=functions.NAME`` a call,
``final`` the answer.

Reference: the gpt-oss chat template (``tests/data/chat_templates/openai-gpt-oss-120b.jinja``) and
the harmony response format (https://cookbook.openai.com/articles/openai-harmony): a message is
``<|start|>ROLE [to=RECIPIENT]<|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>]json<|message|>BODY``
ended by ``<|end|>``, ``<|call|>`` (a tool call) or ``<|return|>`` (the final answer). The
generation prompt ends with ``<|start|>assistant``, so the first message's header has no
``<|start|>``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from relax_agent.rollout.parsers import ParsedAction
from relax_agent.rollout.tool_parsers._common import call, json_object


class GptOssParser:
    """Reads the harmony messages of one sampled turn.

    Strict: a call (a message to ``functions.NAME``) must carry a JSON object and end with
    ``<|call|>``; a message to any other recipient (the built-in ``python`` or ``browser``
    tools), a header without ``<|message|>``, or a call cut before ``<|call|>`` is a parse error
    and no call. ``analysis`` bodies are the reasoning; ``final`` bodies, and ``commentary``
    without a recipient (preambles), the content. A reply with no harmony header at all is plain
    content. Special tokens are kept when decoding (the harmony markers are special tokens).
    """

    family = "gpt_oss"
    keeps_special_tokens = True
    START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
    ENDS = ("<|end|>", "<|call|>", "<|return|>")
    _RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
    _END = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")

    def format(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) as harmony messages, as the policy samples them after the
        generation prompt (``<|start|>assistant``); each message after the first opens with it."""
        return f"{self.START}assistant".join(
            f" to=functions.{c['name']}{self.CHANNEL}commentary json{self.MESSAGE}"
            f"{json.dumps(c['arguments'], ensure_ascii=False)}<|call|>" for c in calls)

    def parse(self, text: str) -> ParsedAction:
        """The harmony messages of ``text``: ``analysis`` as reasoning, ``final`` (and preambles) as content,
        messages to ``functions.NAME`` as calls (see the class doc for what is an error)."""
        if self.CHANNEL not in text and self.MESSAGE not in text:
            return ParsedAction(self._clean(text))
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        pos = 0
        while pos < len(text):
            msg_at = text.find(self.MESSAGE, pos)
            if msg_at == -1:
                if text[pos:].strip():
                    errors.append(f"harmony header without {self.MESSAGE}: {text[pos:][:120]!r}")
                break
            header = text[pos:msg_at]
            end = self._END.search(text, msg_at)
            body_end, stop = (end.start(), end.group()) if end else (len(text), "")
            body = text[msg_at + len(self.MESSAGE):body_end]
            pos = end.end() if end else len(text)
            if text.startswith(self.START, pos):
                pos += len(self.START)
            self._message(header, body, stop, reasoning, content, calls, errors)
        return ParsedAction("\n".join(content).strip(), tuple(calls), tuple(errors), "\n".join(reasoning).strip())

    def _message(self, header: str, body: str, stop: str, reasoning: list[str], content: list[str],
                 calls: list[dict[str, Any]], errors: list[str]) -> None:
        words = header.split(self.CHANNEL, 1)[1].split() if self.CHANNEL in header else []
        channel = words[0].split("<|")[0] if words else ""
        recipient = self._RECIPIENT.search(header)
        if recipient is None:
            if channel == "analysis":
                reasoning.append(body)
            elif channel in ("final", "commentary", ""):
                content.append(body)
            else:
                errors.append(f"harmony message on unknown channel {channel!r}")
            return
        target = recipient.group(1)
        if not target.startswith("functions."):
            errors.append(f"harmony message to {target!r}: not a function tool (only functions.NAME calls are tool calls)")
            return
        if stop != "<|call|>":
            errors.append(f"tool call to {target!r} does not end with <|call|> (the reply ended inside it): {body[:200]!r}")
            return
        args, error = json_object(body, f"tool call {target!r} arguments")
        if args is None:
            errors.append(error)
            return
        calls.append(call(len(calls), target[len("functions."):], args))

    def _clean(self, text: str) -> str:
        for tok in self.ENDS:
            text = text.replace(tok, "")
        return text.strip()
