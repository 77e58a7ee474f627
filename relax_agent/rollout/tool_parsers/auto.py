"""``rollout.tool_parser: auto``: the tool-call parser a policy's chat template (or name) calls for.

How it decides, first match wins:

1. The renderer does not put tools through the template (``tools_in: system``, or ``auto`` with a
   template that never reads ``tools``): the tools are introduced by the Hermes system prompt,
   which asks for ``<tool_call>`` JSON, so ``hermes_strict``. With a custom
   ``rollout.system_prompt`` the format is the prompt's own and ``auto`` refuses.
2. The template spells a family's call markers (table :data:`TEMPLATE_MARKERS`, checked in order:
   the more specific formats first, plain ``<tool_call>`` JSON last).
3. The model's name (``name_or_path``) names a family (:data:`NAME_PATTERNS`).
4. Otherwise a :class:`~relax_agent.errors.ConfigError` asks for an explicit parser.
"""

from __future__ import annotations

import re
from typing import Any

from relax_agent.errors import ConfigError

TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("gpt_oss", ("<|channel|>", "functions."), "harmony channels and functions.NAME recipients"),
    ("qwen3_coder", ("<function=", "<parameter="), "XML <function=..><parameter=..> calls"),
    ("deepseek_v3", ("tool▁calls▁begin",), "<｜tool▁calls▁begin｜> sections"),
    ("kimi_k2", ("<|tool_calls_section_begin|>",), "<|tool_calls_section_begin|> sections"),
    ("glm45", ("<arg_key>", "<arg_value>"), "<tool_call>NAME<arg_key>..</arg_key> calls"),
    ("gemma", ("<|tool_call>", "call:"), "<|tool_call>call:NAME{..} calls"),
    ("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS] calls"),
    ("llama3", ("<|start_header_id|>", '"parameters"'), "Llama 3 JSON calls with \"parameters\""),
    ("qwen3", ("<tool_call>", "<think>"), "<tool_call> JSON calls and <think> reasoning"),
    ("hermes_strict", ("<tool_call>",), "<tool_call> JSON calls (Hermes / Qwen2.5)"),
)
"""(parser, strings the chat template must all contain, what they show), in the order they are tried."""

NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    ("qwen3_coder", r"qwen3[-_.]?coder"),
    ("qwen3", r"qwen3|qwq"),
    ("gpt_oss", r"gpt[-_]?oss"),
    ("llama3", r"llama[-_]?3"),
    ("mistral", r"mistral|ministral|magistral|devstral"),
    ("deepseek_v3", r"deepseek[-_]?(v3|r1)"),
    ("glm45", r"glm[-_]?4\.[5-9]"),
    ("kimi_k2", r"kimi[-_]?k2"),
    ("gemma", r"gemma[-_]?4"),
)
"""(parser, regular expression searched in the lower-cased model name), in order."""


def resolve_tool_parser(tokenizer: Any, tools_in: str = "auto", system_prompt: str | None = None,
                        model_name: str | None = None) -> tuple[str, str]:
    """The parser ``rollout.tool_parser: auto`` stands for, and why (for the log line).

    Args:
        tokenizer: the policy's tokenizer (its ``chat_template`` and ``name_or_path`` are read).
        tools_in: ``rollout.tools_in`` (decides whether the template or the Hermes system prompt
            introduces the tools).
        system_prompt: ``rollout.system_prompt``.
        model_name: the model's name or path; defaults to ``tokenizer.name_or_path``.

    Returns:
        (registered parser name, a short reason such as ``"chat template has [TOOL_CALLS] calls"``).

    Raises:
        ConfigError: the format cannot be told (names the model and the parsers to choose from).
    """
    template = getattr(tokenizer, "chat_template", None) or ""
    name = model_name if model_name is not None else str(getattr(tokenizer, "name_or_path", "") or "")
    if tools_in == "system" or (tools_in == "auto" and "tools" not in template):
        if system_prompt is not None:
            raise ConfigError(
                f"rollout.tool_parser=auto: the tools are introduced by rollout.system_prompt, whose call format "
                f"auto cannot read; set rollout.tool_parser to the format that prompt asks for ({_choices()})")
        where = "tools_in: system" if tools_in == "system" else "the chat template renders no tools"
        return "hermes_strict", f"{where}; the Hermes system prompt asks for <tool_call> JSON"
    for parser, needles, shows in TEMPLATE_MARKERS:
        if all(n in template for n in needles):
            return parser, f"chat template has {shows}"
    lowered = name.lower()
    for parser, pattern in NAME_PATTERNS:
        if re.search(pattern, lowered):
            return parser, f"model name {name!r} matches {pattern!r}"
    raise ConfigError(
        f"rollout.tool_parser=auto: cannot tell the tool-call format of {name or 'the policy'!r}: its chat template "
        f"spells no known call markers and its name names no known family; set rollout.tool_parser to one of "
        f"{_choices()}")


def _choices() -> str:
    from relax_agent.rollout.parsers import known_parsers

    return ", ".join(known_parsers())
