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

from relax_agent.rollout.tool_parsers._common import SectionParser, json_object


class KimiK2Parser(SectionParser):
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

    def _one_call(self, body: str) -> tuple[str, Any, str]:
        head, sep, raw = body.partition(self.ARGS)
        m = self._ID.fullmatch(head)
        if not sep or m is None:
            return "", None, f"tool call is not functions.NAME:IDX{self.ARGS}{{arguments}}: {head[:120]!r}"
        args, error = json_object(raw, f"tool call {m.group(1)!r} arguments")
        return m.group(1), args, "" if args is not None else error
