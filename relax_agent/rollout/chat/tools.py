"""How tools reach the policy when its chat template does not render them: the Hermes system prompt,
a worked tool call as a demonstration exchange, and whether a template reads ``tools`` at all."""

from __future__ import annotations

from typing import Any

HERMES_SYSTEM = (
    "You are a function-calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. If none of the "
    "functions fit the request, answer in plain text without a tool call.\n"
    "Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)

EXAMPLE_TURNS = (
    {"role": "user", "content": "Example request (the tool get_weather(city, unit) is only for this example): "
                                "What is the weather in Paris in celsius?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                     '"unit": "celsius"}}\n</tool_call>'},
)
"""A worked tool call shown as one demonstration exchange before the real request."""


def template_supports_tools(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template reads a ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template
