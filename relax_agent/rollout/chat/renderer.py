"""The chat renderer: a tokenizer's chat template probed once at start-up (refused with the missing
feature named), the episode's prompt rendered once, and each observation's token delta."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relax_agent.errors import ConfigError
from relax_agent.rollout.chat.content import check_media, template_part, text_of
from relax_agent.rollout.chat.deltas import REF_ASSISTANT, REF_USER, Deltas
from relax_agent.rollout.chat.tools import EXAMPLE_TURNS, HERMES_SYSTEM, template_supports_tools
from relax_agent.rollout.engines.base import default_stop_ids


@dataclass(frozen=True)
class RenderedPrompt:
    """The opening of an episode.

    Attributes:
        token_ids: [P] the rendered prompt, ending with the assistant generation prompt.
        messages: the messages as rendered (system prompt with tools included; text-only
            content flattened to strings, media parts kept as parts).
    """

    token_ids: tuple[int, ...]
    messages: tuple[dict[str, Any], ...]


class ChatRenderer(Deltas):
    """Renders prompts and observation deltas with a tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face (fast) tokenizer with a chat template.
        tools_in: "template" (pass ``tools=`` to the template), "system" (Hermes-style system
            prompt), or "auto" (template when it reads ``tools``, else system).
        system_prompt: replaces the default tool-introducing system prompt; may contain
            ``{tools}`` (the tool schemas, one JSON object per line).
        tool_example: show one worked tool call as a demonstration exchange (a user request and
            the assistant's ``<tool_call>`` reply) after the system prompt; small models follow
            a demonstrated format far more often than a described one.
        accepts_media: the policy takes image/audio/video content parts (they are passed to the
            template as parts, which renders each as its placeholder; the multimodal renderer,
            :class:`relax_agent.multimodal.render.MediaRenderer`, expands those into media
            tokens); when False a message with one raises ConfigError.

    Attributes:
        system_role: the template accepts a ``system`` message; when it refuses one, system
            text is put at the start of the first user message (as Gemma's own template does).
        tool_role: "tool" when the template renders tool messages, "user" when it refuses that
            role (tool results then go in as user messages wrapped in ``<tool_response>``,
            the Hermes convention). Decided once, here, never per message.
        append_only: False when the template renders a past assistant turn differently before its
            content once more messages follow (Qwen3 drops past ``<think>`` blocks); deltas then
            are aligned from the content on, and sampled turns are kept as sampled (package doc).

    Raises:
        ConfigError: the tokenizer has no chat template, or the template lacks a feature
            token-in/token-out needs (named in the message): a generation prompt that starts an
            assistant turn, a special token that closes it, a way to render tool results.
    """

    def __init__(self, tokenizer: Any, tools_in: str = "auto", system_prompt: str | None = None,
                 tool_example: bool = True, accepts_media: bool = False):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("model.path: the tokenizer has no chat template; relax-agent needs one")
        self.tokenizer = tokenizer
        self.use_template_tools = tools_in == "template" or (tools_in == "auto" and template_supports_tools(tokenizer))
        self.system_prompt = system_prompt
        self.tool_example = tool_example
        self.accepts_media = accepts_media
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._added = tuple(sorted({t.content for t in added.values() if len(t.content) > 1}))
        self._special_ids = frozenset(i for i, t in added.items() if t.special) | frozenset(self._eos_ids())
        self._stop_ids = frozenset(default_stop_ids(tokenizer)) & self._special_ids
        self._heads: dict[tuple[tuple[str, str], ...], str] = {}
        self._call_content = REF_ASSISTANT
        self.append_only = True
        self.system_role = self._renders([{"role": "system", "content": "s"}, REF_USER])
        self._gen_prefix = self._probe_generation_prompt()
        self.tool_role = "tool"
        self._end_after_user = self._probe_boundary([{"role": "user", "content": "x"}],
                                                    "a user message")
        tool = [{"role": "tool", "content": "x"}]
        try:
            self._after_assistant(tool)
        except Exception:  # the template refuses a tool message
            self.tool_role = "user"
        what = "a tool result, neither as a 'tool' message nor as a user message,"
        try:
            self._probe_boundary(tool, what)
        except ConfigError:
            if self.tool_role != "tool":
                raise
            # Gemma 4 renders a tool-call turn's content after the tool results (the policy goes on in the
            # same turn): the turn that calls tools is probed without content, as the policy samples it
            self._call_content, self._heads = "", {}
            try:
                self._probe_boundary(tool, what)
            except ConfigError:
                self._call_content, self._heads = REF_ASSISTANT, {}
                raise
        if self.append_only and self._drops_past_reasoning():
            self.append_only = False

    def _eos_ids(self) -> list[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos if isinstance(eos, list) else [] if eos is None else [eos]

    # -- start-up probes ----------------------------------------------------------------------
    def _renders(self, msgs: list[dict[str, Any]]) -> bool:
        try:
            self._render(msgs, gen=True)
        except Exception:  # the template raised: it refuses this conversation shape
            return False
        return True

    def _probe_generation_prompt(self) -> str:
        """The text an assistant turn starts with after the context (the generation prompt, less any
        empty reasoning block it prefills that the template drops from past turns, as Gemma 4's
        ``<|channel>thought\n<channel|>`` with thinking off)."""
        prefix = self._template("a user turn", [REF_USER], gen=True)
        turn = self._template("an assistant turn", [REF_USER, {"role": "assistant", "content": REF_ASSISTANT}])
        if turn.startswith(prefix):
            return prefix
        common = len(_common_prefix(prefix, turn))
        try:  # the prefilled block written as the start of a past turn's content is dropped again
            dropped = self._render([REF_USER, {"role": "assistant", "content": prefix[common:] + REF_ASSISTANT}]) == turn
        except Exception:  # the template refuses that content
            dropped = False
        if not dropped or not turn[common:].startswith(REF_ASSISTANT):
            raise ConfigError(
                "model.path: the chat template's generation prompt (add_generation_prompt=True ends with "
                f"{prefix[-40:]!r}) is not how it starts an assistant turn ({turn[len(prefix) - 40:][:80]!r}); "
                "token-in/token-out samples right after the generation prompt, so the two must agree"
            )
        return prefix[:common]

    def _drops_past_reasoning(self) -> bool:
        """True when a past assistant turn's reasoning (``reasoning_content``) is rendered differently
        once a user message follows (GLM-4.5+ drops it); informational (``append_only``)."""
        turn = {"role": "assistant", "content": REF_ASSISTANT, "reasoning_content": "r"}
        try:
            alone = self._render([REF_USER, turn])
            after = self._render([REF_USER, turn, {"role": "user", "content": "x"}])
        except Exception:  # the template refuses the field: nothing to tell
            return False
        a, b = alone.rfind(REF_ASSISTANT), after.find(REF_ASSISTANT)
        return a >= 0 and b >= 0 and alone[:a] != after[:b]

    def _probe_boundary(self, new: list[dict[str, Any]], what: str) -> str:
        """The text of the token that closes an assistant turn followed by ``new``."""
        try:
            alone, tail = self._after_assistant(new)
        except Exception as exc:
            raise ConfigError(f"model.path: the chat template cannot render {what} after an assistant turn "
                              f"({type(exc).__name__}: {exc}); multi-turn episodes need it") from exc
        start, stop = self._closing_token(alone, tail, [m["role"] for m in new])
        return tail[start:stop]

    def _template(self, what: str, msgs: list[dict[str, Any]], gen: bool = False) -> str:
        try:
            return self._render(msgs, gen=gen)
        except Exception as exc:
            raise ConfigError(f"model.path: the chat template cannot render {what}: {type(exc).__name__}: {exc}") from exc

    # -- prompt ---------------------------------------------------------------------------
    def render_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()) -> RenderedPrompt:
        """Render the opening messages (and tools) once, ending with the generation prompt.

        Raises:
            ConfigError: a media part reaches a text-only policy (names the message index and type).
            EnvError: a user/tool message spells a special token and the template rewrites
                message content, so it cannot be kept as plain text.
        """
        msgs = self._contents(messages)
        kwargs: dict[str, Any] = {}
        if tools and self.use_template_tools:
            kwargs["tools"] = list(tools)
            if self.system_prompt:
                msgs = self._with_system(msgs, self.system_prompt.replace("{tools}", ""))
        elif tools or self.system_prompt:
            msgs = self._with_system(msgs, self._tool_system_prompt(tools))
            if tools and self.tool_example:
                msgs = msgs[:1] + list(EXAMPLE_TURNS) + msgs[1:]
        rendered = msgs if self.system_role else self._fold_system(msgs)
        text, spans = self._render_plain(rendered, gen=True, **kwargs)
        return RenderedPrompt(tuple(self._encode(text, spans)), tuple(msgs))

    def _tool_system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        schemas = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        if self.system_prompt is not None:
            return self.system_prompt.replace("{tools}", schemas)
        return HERMES_SYSTEM.format(tools=schemas)

    @staticmethod
    def _with_system(msgs: list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
        if msgs and msgs[0]["role"] == "system":
            return [{**msgs[0], "content": system + "\n\n" + text_of(msgs[0]["content"])}] + msgs[1:]
        return [{"role": "system", "content": system}] + msgs

    @staticmethod
    def _fold_system(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """For templates that refuse a system role: leading system text opens the first user message."""
        if not msgs or msgs[0]["role"] != "system":
            return msgs
        system, rest = text_of(msgs[0]["content"]), msgs[1:]
        if rest and rest[0]["role"] == "user" and isinstance(rest[0]["content"], str):
            return [{**rest[0], "content": system + "\n\n" + rest[0]["content"]}] + rest[1:]
        return [{"role": "user", "content": system}] + rest

    def _contents(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as the template gets them: text-only content as a string, media parts as parts
        (the Responses API's ``input_text`` / ``input_image`` as ``text`` / ``image_url``).

        Raises:
            ConfigError: an unknown part, or a media part for a text-only policy (:func:`check_media`).
        """
        check_media(messages, self.accepts_media)
        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                content = [template_part(p) for p in content]
                if all(p.get("type") == "text" for p in content):
                    content = text_of(content)
            out.append({**m, "content": "" if content is None else content})
        return out

    def describe_tools_in(self) -> str:
        """How the tools reach the policy, for logs: ``"template (...)"`` or ``"system prompt (...)"``."""
        if self.use_template_tools:
            return "template (the chat template renders the tool schemas its own way)"
        if self.system_prompt is not None:
            return "system prompt (rollout.system_prompt lists the tool schemas)"
        return "system prompt (the Hermes system prompt lists the tool schemas and asks for <tool_call> JSON)"

    @property
    def stop_ids(self) -> frozenset[int]:
        """Special tokens the engine stops on by default (EOS and the families' turn-end tokens,
        :func:`~relax_agent.rollout.engines.base.default_stop_ids`): a sampled turn that ends with
        one is closed."""
        return self._stop_ids

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """[k] tokens that close an assistant turn a user message follows."""
        return tuple(self.tokenizer(self._end_after_user, add_special_tokens=False)["input_ids"])

    def observation_delta(self, new_messages: Sequence[dict[str, Any]], closed: bool = True,
                          calls: Sequence[dict[str, Any]] = ()) -> list[int]:
        """Token ids that follow an assistant turn: the new messages and the next generation
        prompt, exactly as the template renders them after that turn.

        Args:
            new_messages: the env's new messages (tool results, user follow-ups).
            closed: the sampled turn ends with the template's closing token (finish reason
                "stop"); when False (cut at ``max_new_tokens``) the delta starts with the token
                that closes the turn before these messages.
            calls: the tool calls parsed from the sampled turn (OpenAI format), for templates that
                name the tool in its result (Gemma 4's ``response:NAME{...}``); a result is matched
                to its call by ``tool_call_id``, else by order.

        Returns:
            [d] token ids; user/tool text in them is plain text (never special tokens).

        Raises:
            ConfigError: a media part reaches a text-only policy (names the message index and type).
            EnvError: a user/tool message spells a special token and the template rewrites
                message content, so it cannot be kept as plain text.
        """
        msgs = self._contents(new_messages)
        texts, held = self._placeheld(msgs)
        alone, held_tail = self._after_assistant(held, calls)  # where the turn closes: independent of the env's text
        start, stop = self._closing_token(alone, held_tail, [m["role"] for m in held])
        cut = stop if closed else start
        _, tail = self._after_assistant(msgs, calls)
        assert tail[:cut] == held_tail[:cut], "the context before the new messages depends on their text"
        spans = self._spans(held_tail[cut:], tail[cut:], texts) if self._spells_added(texts) else []
        return self._encode(tail[cut:], spans)

    def render_after_assistant(self, new_messages: Sequence[dict[str, Any]]) -> tuple[str, str]:
        """Text of a fixed assistant turn alone and followed by ``new_messages`` (and the generation
        prompt), as the template renders them; for diagnostics such as where a placeholder went.

        Raises:
            ConfigError: a media part reaches a text-only policy.
        """
        return self._after_assistant(self._contents(new_messages))


def _common_prefix(a: str, b: str) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return a[:n]
