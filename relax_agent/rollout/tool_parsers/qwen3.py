"""Qwen3 (and QwQ, Qwen2.5 with thinking): Hermes JSON in ``<tool_call>`` blocks, ``<think>`` reasoning.

Reference: the Qwen3 chat template (``tests/data/chat_templates/Qwen-Qwen3-0.6B.jinja``) and
vLLM's ``hermes`` tool parser with its ``qwen3`` reasoning parser.
"""

from __future__ import annotations

from relax_agent.rollout.parsers import HermesParser, ParsedAction
from relax_agent.rollout.tool_parsers._common import split_reasoning


class Qwen3Parser(HermesParser):
    """``<think>reasoning</think>`` then text and strict ``<tool_call>{"name", "arguments"}</tool_call>`` blocks.

    The reasoning block is split off first (a call written inside it is not a call; a block left
    without ``</think>`` ends at the first ``<tool_call>``, as vLLM's Qwen3 parser reads it); the rest is
    read by the strict Hermes parser: junk after a call's JSON, or a final block without its
    ``</tool_call>`` (a reply cut at the token limit), is a parse error. A Hermes parser in every
    other respect (``format``, and the agent proxy's forced call opening and
    ``parallel_tool_calls: false``, which key on :class:`HermesParser`).
    """

    family = "qwen3"
    keeps_special_tokens = False
    THINK = ("<think>", "</think>")

    def __init__(self) -> None:
        super().__init__(strict=True, framed=False)  # vLLM's hermes parser reads one-line blocks

    def parse(self, text: str) -> ParsedAction:
        """The ``<think>`` block as reasoning, the rest as :meth:`HermesParser.parse` reads it."""
        reasoning, rest = split_reasoning(text, *self.THINK, call_open=self.OPEN)
        action = super().parse(rest)
        return ParsedAction(action.content, action.tool_calls, action.errors, reasoning, action.rejected)
