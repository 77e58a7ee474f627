"""DeepSeek V3 / V3.1 / R1-0528: calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``,
``<think>`` reasoning (V3.1 thinking mode, R1).

Reference: the DeepSeek V3.1 chat template (``tests/data/chat_templates/deepseek-ai-DeepSeek-V3.1.jinja``)
and vLLM's ``deepseek_v3`` / ``deepseek_v31`` tool parsers. A call is
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}<｜tool▁call▁end｜>`` (V3.1) or
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{args}\\n```<｜tool▁call▁end｜>`` (V3, R1).
"""

from __future__ import annotations

import json
import re
from typing import Any

from relax_agent.rollout.parsers import ParsedAction
from relax_agent.rollout.tool_parsers._common import call, json_object, split_reasoning, strip_end_tokens


class DeepSeekV3Parser:
    """Strict: the calls section must be closed, hold only closed calls, each with a JSON object;
    anything else is a parse error and no call. Text before the section is content. Special
    tokens are kept when decoding; the closing ``<｜end▁of▁sentence｜>`` is dropped."""

    family = "deepseek_v3"
    keeps_special_tokens = True
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    THINK = ("<think>", "</think>")
    END_TOKENS = ("<｜end▁of▁sentence｜>",)
    _V3 = re.compile(r"function\s*" + re.escape("<｜tool▁sep｜>") + r"([^\n]+)\n```json\n(.*)\n```\s*", re.S)
    _V31 = re.compile(r"([^<]+?)" + re.escape("<｜tool▁sep｜>") + r"(.*)", re.S)

    def format(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) in the V3.1 layout the template renders."""
        body = "".join(f"{self.CALL_BEGIN}{c['name']}{self.SEP}{json.dumps(c['arguments'], ensure_ascii=False)}"
                       f"{self.CALL_END}" for c in calls)
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
            body = section[start + len(self.CALL_BEGIN):end]
            m = self._V3.fullmatch(body) or self._V31.fullmatch(body)
            if m is None:
                return [], f"tool call is not NAME{self.SEP}{{arguments}}: {body[:200]!r}"
            args, error = json_object(m.group(2), f"tool call {m.group(1).strip()!r} arguments")
            if args is None:
                return [], error
            calls.append(call(len(calls), m.group(1).strip(), args))
            pos = end + len(self.CALL_END)
        return calls, ""
