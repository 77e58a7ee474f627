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

from relax_agent.rollout.tool_parsers._common import SectionParser, json_object


class DeepSeekV3Parser(SectionParser):
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

    def _one_call(self, body: str) -> tuple[str, Any, str]:
        m = self._V3.fullmatch(body) or self._V31.fullmatch(body)
        if m is None:
            return "", None, f"tool call is not NAME{self.SEP}{{arguments}}: {body[:200]!r}"
        args, error = json_object(m.group(2), f"tool call {m.group(1).strip()!r} arguments")
        return m.group(1).strip(), args, "" if args is not None else error
