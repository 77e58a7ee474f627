"""Chat rendering for token-in/token-out rollouts.

The prompt is rendered through the tokenizer's chat template exactly once per episode.
After that the trajectory only grows by (a) the token ids the engine sampled and (b) the
template's token *delta* for each new observation (tool results, user follow-ups), which is
computed against a fixed reference conversation so the sampled tokens are never re-rendered
or re-tokenized (FIELD_NOTES: "token drift when multi-turn history is re-rendered").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from relax_agent.configbase import Section

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

_REF_USER = "ping"
_REF_ASSISTANT = "pong"


def text_of(content: Any) -> str:
    """Flatten OpenAI content (a string or a list of content parts) to text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def template_supports_tools(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template reads a ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


@dataclass(frozen=True)
class RenderedPrompt:
    """The opening of an episode.

    Attributes:
        token_ids: [P] the rendered prompt, ending with the assistant generation prompt.
        messages: the messages as rendered (system prompt with tools included).
    """

    token_ids: tuple[int, ...]
    messages: tuple[dict[str, Any], ...]


class ChatRenderer:
    """Renders prompts and observation deltas with a tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tools_in: "template" (pass ``tools=`` to the template), "system" (Hermes-style system
            prompt), or "auto" (template when it reads ``tools``, else system).
        system_prompt: replaces the default tool-introducing system prompt; may contain
            ``{tools}`` (the tool schemas, one JSON object per line).
        tool_example: show one worked tool call as a demonstration exchange (a user request and
            the assistant's ``<tool_call>`` reply) after the system prompt; small models follow
            a demonstrated format far more often than a described one.

    Raises:
        ConfigError: the tokenizer has no chat template.
    """

    def __init__(self, tokenizer: Any, tools_in: str = "auto", system_prompt: str | None = None,
                 tool_example: bool = True):
        from relax_agent.errors import ConfigError

        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("model.path: the tokenizer has no chat template; relax-agent needs one")
        self.tokenizer = tokenizer
        self.use_template_tools = tools_in == "template" or (tools_in == "auto" and template_supports_tools(tokenizer))
        self.system_prompt = system_prompt
        self.tool_example = tool_example
        self._end_of_turn = self._find_end_of_turn()

    # -- prompt ---------------------------------------------------------------------------
    def render_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()) -> RenderedPrompt:
        """Render the opening messages (and tools) once, ending with the generation prompt."""
        msgs = [self._plain(m) for m in messages]
        kwargs: dict[str, Any] = {}
        if tools and self.use_template_tools:
            kwargs["tools"] = list(tools)
            if self.system_prompt:
                msgs = self._with_system(msgs, self.system_prompt.replace("{tools}", ""))
        elif tools or self.system_prompt:
            msgs = self._with_system(msgs, self._tool_system_prompt(tools))
            if tools and self.tool_example:
                msgs = msgs[:1] + list(EXAMPLE_TURNS) + msgs[1:]
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return RenderedPrompt(tuple(ids), tuple(msgs))

    def _tool_system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        schemas = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        if self.system_prompt is not None:
            return self.system_prompt.replace("{tools}", schemas)
        return HERMES_SYSTEM.format(tools=schemas)

    @staticmethod
    def _with_system(msgs: list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
        if msgs and msgs[0]["role"] == "system":
            return [{"role": "system", "content": system + "\n\n" + msgs[0]["content"]}] + msgs[1:]
        return [{"role": "system", "content": system}] + msgs

    @staticmethod
    def _plain(message: dict[str, Any]) -> dict[str, Any]:
        return {"role": message["role"], "content": text_of(message.get("content"))}

    # -- deltas ---------------------------------------------------------------------------
    def _reference(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "s"}, {"role": "user", "content": _REF_USER},
                {"role": "assistant", "content": _REF_ASSISTANT}]

    def _find_end_of_turn(self) -> str:
        """The text the template puts right after an assistant message's content (its end token)."""
        text = self.tokenizer.apply_chat_template(self._reference(), tokenize=False)
        tail = text[text.rindex(_REF_ASSISTANT) + len(_REF_ASSISTANT):]
        eos = self.tokenizer.eos_token or ""
        if eos and eos in tail:
            return tail[: tail.index(eos) + len(eos)]
        return tail.rstrip("\n") if tail.strip() else tail

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """[k] tokens that close an assistant turn (appended, unmasked, after a length cut)."""
        return tuple(self.tokenizer(self._end_of_turn, add_special_tokens=False)["input_ids"])

    def observation_delta(self, new_messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids that follow a closed assistant turn: the new messages and the next
        generation prompt, exactly as the template would render them.

        Tool messages are rendered with role ``tool``; a template that rejects that role gets
        them as user messages wrapped in ``<tool_response>`` (Hermes convention).
        """
        ref = self._reference()
        msgs = [self._plain(m) for m in new_messages]
        try:
            full = self.tokenizer.apply_chat_template(ref + msgs, tokenize=False, add_generation_prompt=True)
        except Exception:  # template refuses the tool role
            msgs = [self._as_user(m) for m in msgs]
            full = self.tokenizer.apply_chat_template(ref + msgs, tokenize=False, add_generation_prompt=True)
        cut = full.index(_REF_ASSISTANT + self._end_of_turn) + len(_REF_ASSISTANT + self._end_of_turn)
        return self.tokenizer(full[cut:], add_special_tokens=False)["input_ids"]

    @staticmethod
    def _as_user(m: dict[str, Any]) -> dict[str, Any]:
        if m["role"] != "tool":
            return m
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
