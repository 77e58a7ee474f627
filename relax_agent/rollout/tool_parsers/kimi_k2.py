"""Kimi K2: calls between ``<|tool_calls_section_begin|>`` and ``<|tool_calls_section_end|>``, each
``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{args}<|tool_call_end|>``;
``<think>`` reasoning (K2-Thinking).

Reference: the Kimi K2 chat template (``tests/data/chat_templates/moonshotai-Kimi-K2.jinja``) and
vLLM's ``kimi_k2`` tool parser.
"""

from __future__ import annotations

import json
import re
from typing import Any

from relax_agent.rollout.parsers import ParsedAction
from relax_agent.rollout.tool_parsers._common import call, json_object, split_reasoning, strip_end_tokens


class KimiK2Parser:
    """Strict: the section must be closed and hold only closed calls whose id is
    ``functions.NAME:IDX`` and whose arguments are a JSON object; anything else is a parse error
    and no call. Text before the section is content. Special tokens are kept when decoding; the
    closing ``<|im_end|>`` is dropped."""

    family = "kimi_k2"
    keeps_special_tokens = True
    BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_BEGIN, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    THINK = ("<think>", "</think>")
    END_TOKENS = ("<|im_end|>",)
    _ID = re.compile(r"\s*(?:functions\.)?([A-Za-z_][\w.\-]*):(\d+)\s*")

    def format(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) in the template's layout."""
        body = "".join(f"{self.CALL_BEGIN}functions.{c['name']}:{i}{self.ARGS}"
                       f"{json.dumps(c['arguments'], ensure_ascii=False)}{self.CALL_END}" for i, c in enumerate(calls))
        return f"{self.BEGIN}{body}{self.END}"

    def parse(self, text: str) -> ParsedAction:
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
            head, sep, raw = section[start + len(self.CALL_BEGIN):end].partition(self.ARGS)
            m = self._ID.fullmatch(head)
            if not sep or m is None:
                return [], f"tool call is not functions.NAME:IDX{self.ARGS}{{arguments}}: {head[:120]!r}"
            args, error = json_object(raw, f"tool call {m.group(1)!r} arguments")
            if args is None:
                return [], error
            calls.append(call(len(calls), m.group(1), args))
            pos = end + len(self.CALL_END)
        return calls, ""
