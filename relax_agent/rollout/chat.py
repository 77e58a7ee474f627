"""Chat rendering for token-in/token-out rollouts.

The prompt is rendered through the tokenizer's chat template exactly once per episode.
After that the trajectory only grows by (a) the token ids the engine sampled and (b) the
template's token *delta* for each new observation (tool results, user follow-ups), so the
sampled tokens are never re-rendered or re-tokenized (re-rendering multi-turn history drifts: a
template may tokenize the same text differently than the engine sampled it).

How a delta is found, without assuming how the template closes a turn: the template renders a
short context conversation twice, once ending with an assistant turn and once with the new
messages after it (the assistant turn carries one tool call per tool result, for templates
that need ``tool_calls`` before a tool message). Where the two renderings part, or at the last
special token of the assistant turn, is the token that closes the turn (``<|im_end|>``, or
``<|eom_id|>`` where Llama-3.1 closes a turn that a tool result follows); the delta is what
follows it. What a template cannot do is refused when the renderer is built, with a
:class:`~relax_agent.errors.ConfigError` naming the feature.

Templates that are not append-only are supported when the difference lies *before* the content
of a past assistant turn: Qwen3 (and GLM-4.5+) render ``<think>...</think>`` only for the
assistant turns after the last user query, so re-rendering a history changes the tokens of
earlier turns. The engine never re-renders: the two renderings are aligned from the assistant
content on, the delta is still what the template puts after the closing token, and the sampled
turn (its reasoning included) stays in the trajectory exactly as sampled; the trained tokens are
the sampled ones. ``ChatRenderer.append_only`` is False for such a template (also for one that drops
a past turn's ``reasoning_content``: GLM-4.5+, gpt-oss). A template that changes the content itself,
or what follows it before the closing token, is still refused.

Two more shapes are accepted. GLM-4.5+ writes no token of its own after an assistant turn: the next
role's token (``<|observation|>`` before tool results, ``<|user|>``) closes it, and the policy samples
it (the engine stops on it), so where no token after the content is a stop token and the next one
is, that next token is the closing token. Gemma 4 prefills an empty thought channel in the
generation prompt that past turns drop (accepted when rendering it as the start of the content gives
the same turn), ends a tool-calling turn with ``<|tool_response>`` and renders the results in the
same model turn, *before* that turn's content: the turn that calls tools is probed without content
(as the policy samples it: calls, then ``<|tool_response>``), and the tool's name in Gemma's
``response:NAME{...}`` is taken from the sampled calls (``observation_delta(..., calls=)``).

Observation text is plain text: a tool result or user message that spells a special or added
token (``<|im_end|>``, ``<tool_call>``) is tokenized as the characters it is, so a tool cannot
forge turns; special tokens come only from the template's own structure.

Content parts (image, audio, video) stay parts. A text-only policy (``accepts_media=False``)
refuses them with an error naming the part type and the message index; every policy refuses a
part of an unknown type (a template would drop it silently); :func:`check_media` is the same
check for start-up code.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relax_agent.errors import ConfigError, EnvError
from relax_agent.rollout.engines.base import default_stop_ids

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

_REF_USER = {"role": "user", "content": "ping"}
_REF_ASSISTANT = "pong"
_PLAIN_ROLES = frozenset({"user", "tool"})
"""Roles whose text comes from the env (observations): always tokenized as plain text."""
_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


def _placeholder(i: int) -> str:
    return f"\ue000{i}\ue001"  # private-use characters: no template trims or escapes them


def text_of(content: Any) -> str:
    """Flatten OpenAI content (a string or a list of content parts) to its text parts."""
    from relax_agent.multimodal.parts import TEXT_PART_TYPES

    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES)


def media_parts(messages: Sequence[dict[str, Any]]) -> list[tuple[int, str]]:
    """``(message index, part type)`` of every non-text content part in ``messages``."""
    from relax_agent.multimodal.parts import TEXT_PART_TYPES

    return [(i, str(p.get("type"))) for i, m in enumerate(messages) if isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") not in TEXT_PART_TYPES]


def check_parts(messages: Sequence[dict[str, Any]], where: str = "messages") -> None:
    """Refuse every content part relax-agent cannot render, for text and media policies alike: a
    part that is not a dict with a known ``type`` (text, ``input_text``, or a media type of
    :data:`~relax_agent.multimodal.parts.PART_KINDS`), and the known types it cannot take
    (``image_file``: an uploaded file's id). A chat template would silently drop such a part and
    the policy would train without it.

    Raises:
        ConfigError: names the message index, the part's index and type, and the types accepted.
    """
    from relax_agent.multimodal.parts import PART_KINDS, REFUSED_PART_TYPES, TEXT_PART_TYPES

    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in TEXT_PART_TYPES or kind in PART_KINDS:
                continue
            if kind in REFUSED_PART_TYPES:
                raise ConfigError(f"{where}[{i}] content part {j} has type {kind!r}, which relax-agent cannot take: "
                                  f"{REFUSED_PART_TYPES[kind]}")
            shown = f"type {kind!r}" if isinstance(p, dict) else f"no type (a {type(p).__name__}, not a dict)"
            raise ConfigError(f"{where}[{i}] content part {j} has {shown}: not a part relax-agent knows, and a chat "
                              f"template would drop it silently; expected one of {sorted([*TEXT_PART_TYPES, *PART_KINDS])}")


def check_media(messages: Sequence[dict[str, Any]], accepts_media: bool, where: str = "messages") -> None:
    """Refuse unknown content parts for every policy (:func:`check_parts`) and media content parts
    for a text-only policy (call it at start-up on the env's prompts).

    Args:
        messages: OpenAI-format chat messages.
        accepts_media: whether the policy takes image/audio/video parts.
        where: how the error names the list (e.g. ``"env.reset observation"``).

    Raises:
        ConfigError: a part :func:`check_parts` refuses; or ``accepts_media`` is False and a
            message has a media part: names the first one's message index and part type, and
            how many there are.
    """
    check_parts(messages, where)
    found = [] if accepts_media else media_parts(messages)
    if found:
        i, kind = found[0]
        more = f" ({len(found)} media parts in all)" if len(found) > 1 else ""
        raise ConfigError(
            f"{where}[{i}] has a {kind!r} content part{more}, but the policy is text-only "
            f"(ChatRenderer accepts_media=False): use a policy that takes media or an env whose messages are text"
        )


def _template_part(part: dict[str, Any]) -> dict[str, Any]:
    """A content part in the form chat templates read: the Responses API's ``input_text`` as
    ``text`` and ``input_image`` (its ``image_url`` a string) as ``image_url``."""
    kind = part.get("type")
    if kind == "input_text":
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image":
        url = part.get("image_url")
        return {"type": "image_url", "image_url": url if isinstance(url, dict) else {"url": url}}
    return part


def template_supports_tools(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template reads a ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


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


class ChatRenderer:
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
            are aligned from the content on, and sampled turns are kept as sampled (module doc).

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
        self._call_content = _REF_ASSISTANT
        self.append_only = True
        self.system_role = self._renders([{"role": "system", "content": "s"}, _REF_USER])
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
                self._call_content, self._heads = _REF_ASSISTANT, {}
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
        prefix = self._template("a user turn", [_REF_USER], gen=True)
        turn = self._template("an assistant turn", [_REF_USER, {"role": "assistant", "content": _REF_ASSISTANT}])
        if turn.startswith(prefix):
            return prefix
        common = len(_common_prefix(prefix, turn))
        try:  # the prefilled block written as the start of a past turn's content is dropped again
            dropped = self._render([_REF_USER, {"role": "assistant", "content": prefix[common:] + _REF_ASSISTANT}]) == turn
        except Exception:  # the template refuses that content
            dropped = False
        if not dropped or not turn[common:].startswith(_REF_ASSISTANT):
            raise ConfigError(
                "model.path: the chat template's generation prompt (add_generation_prompt=True ends with "
                f"{prefix[-40:]!r}) is not how it starts an assistant turn ({turn[len(prefix) - 40:][:80]!r}); "
                "token-in/token-out samples right after the generation prompt, so the two must agree"
            )
        return prefix[:common]

    def _drops_past_reasoning(self) -> bool:
        """True when a past assistant turn's reasoning (``reasoning_content``) is rendered differently
        once a user message follows (GLM-4.5+ drops it); informational (``append_only``)."""
        turn = {"role": "assistant", "content": _REF_ASSISTANT, "reasoning_content": "r"}
        try:
            alone = self._render([_REF_USER, turn])
            after = self._render([_REF_USER, turn, {"role": "user", "content": "x"}])
        except Exception:  # the template refuses the field: nothing to tell
            return False
        a, b = alone.rfind(_REF_ASSISTANT), after.find(_REF_ASSISTANT)
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

    def _render(self, msgs: Sequence[dict[str, Any]], gen: bool = False, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=gen, **kwargs)

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
                content = [_template_part(p) for p in content]
                if all(p.get("type") == "text" for p in content):
                    content = text_of(content)
            out.append({**m, "content": "" if content is None else content})
        return out

    # -- deltas ---------------------------------------------------------------------------
    def _head(self, calls: tuple[tuple[str, str], ...]) -> dict[str, Any]:
        """The context assistant turn: fixed text, plus one tool call ``(id, name)`` per tool result that
        follows (templates may require ``tool_calls`` before a tool message; Gemma 4 names the tool in
        the result, so the names are the sampled calls' where known)."""
        if not calls:
            return {"role": "assistant", "content": _REF_ASSISTANT}
        return {"role": "assistant", "content": self._call_content,
                "tool_calls": [{"id": i, "type": "function", "function": {"name": n, "arguments": {}}} for i, n in calls]}

    def _after_assistant(self, new: list[dict[str, Any]],
                         sampled_calls: Sequence[dict[str, Any]] = ()) -> tuple[str, str]:
        """Render the context's assistant turn alone and followed by ``new`` (with the generation prompt).

        Args:
            new: the messages after the turn.
            sampled_calls: the tool calls the policy made in the turn (OpenAI format); they name the
                context turn's calls (matched to the tool results by ``tool_call_id``, else in order).

        Returns:
            (the turn alone, the turn followed by ``new``), each after the generation prompt.
        """
        new = [self._as_user(m) if m["role"] == "tool" and self.tool_role == "user" else m for m in new]
        names = {str(c.get("id")): str(c.get("function", {}).get("name", "tool")) for c in sampled_calls}
        in_order = [str(c.get("function", {}).get("name", "tool")) for c in sampled_calls]
        calls: list[tuple[str, str]] = []
        for i, m in enumerate(new):
            if m["role"] == "tool":
                k = len(calls)
                new[i] = {"tool_call_id": f"call_{k}", **m}
                call_id = str(new[i]["tool_call_id"])
                name = names.get(call_id) or (in_order[k] if k < len(in_order) else "tool")
                calls.append((call_id, name))
        key = tuple(calls)
        if key not in self._heads:
            if len(self._heads) >= 64:  # ids come from the env: keep the cache bounded
                self._heads.clear()
            self._heads[key] = self._render([_REF_USER, self._head(key)])[len(self._gen_prefix):]
        full = self._render([_REF_USER, self._head(key), *new], gen=True)
        if not full.startswith(self._gen_prefix):
            raise ConfigError("model.path: the chat template renders the context before an assistant turn differently "
                              "once more messages follow it; token-in/token-out needs a stable prefix")
        return self._heads[key], full[len(self._gen_prefix):]

    def _closing_token(self, closed: str, tail: str, roles: list[str]) -> tuple[int, int]:
        """Character span in ``tail`` of the token closing the assistant turn (see module doc).

        Templates that render a past assistant turn differently *before* its content (Qwen3
        drops the ``<think>`` block of turns before the last user query) are aligned from the
        content on: the sampled turn is never re-rendered, so only what follows the content (tool
        calls, the closing token) has to agree with what the policy sampled. Only a template that
        renders *less* before the content is aligned so; one that renders more there (Gemma 4 puts
        the tool results before a past turn's content) is not dropping history.
        """
        ca, ta = closed.rfind(_REF_ASSISTANT), tail.find(_REF_ASSISTANT)
        try:
            span = self._closing_token_from(closed, tail, roles, 0, ca + len(_REF_ASSISTANT) if ca >= 0 else 0)
        except ConfigError:
            if ca <= 0 or ta < 0 or closed[:ca] == tail[:ta] or ta >= ca:
                raise
            span = self._closing_token_from(closed[ca:], tail[ta:], roles, ta, len(_REF_ASSISTANT))
            self.append_only = False
        if ta >= 0 and span[0] < ta + len(_REF_ASSISTANT):
            raise ConfigError(
                f"model.path: the chat template closes an assistant turn with no special token after its content "
                f"(its last special token, {tail[span[0]:span[1]]!r}, comes before it: {tail[:80]!r}); "
                "token-in/token-out needs one (the engine stops on it)")
        return span

    def _closing_token_from(self, closed: str, tail: str, roles: list[str], ta: int, content_end: int) -> tuple[int, int]:
        """:meth:`_closing_token` on ``closed`` and ``tail``, where ``tail`` starts at character ``ta`` of
        the full tail (the returned span is in full-tail characters) and the turn's content ends at
        character ``content_end`` of ``closed``.

        Where ``closed`` is a prefix of ``tail``, the closing token is the last special token of the
        turn alone; but where no token after the content is one the engine stops on and the next
        token of ``tail`` is (GLM-4.5+ ends a turn with the next role's token, ``<|observation|>``
        or ``<|user|>``, which the policy samples), it is that next token.
        """
        a = self.tokenizer(closed, add_special_tokens=False, return_offsets_mapping=True)
        b = self.tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)
        a_ids, b_ids = list(a["input_ids"]), list(b["input_ids"])
        k = next((j for j, (x, y) in enumerate(zip(a_ids, b_ids, strict=False)) if x != y), min(len(a_ids), len(b_ids)))
        special = self._special_ids
        if k < len(a_ids):  # the template closes the turn with another token when `roles` follow
            if k < len(b_ids) and a_ids[k] in special and b_ids[k] in special:
                return _shift(b["offset_mapping"][k], ta)
            raise ConfigError(
                f"model.path: the chat template renders an assistant turn differently when {roles} follow "
                f"({closed[:80]!r} vs {tail[:80]!r}), not only by its closing token or before its content; "
                "token-in/token-out cannot append observations to sampled turns with this template"
            )
        after = [j for j in range(len(a_ids)) if a["offset_mapping"][j][0] >= content_end]
        if k < len(b_ids) and b_ids[k] in self._stop_ids and not any(a_ids[j] in self._stop_ids for j in after):
            return _shift(b["offset_mapping"][k], ta)  # the next role's token closes the turn (GLM)
        ends = [j for j in range(len(a_ids)) if a_ids[j] in special]
        j = ends[-1] if ends else k
        if j >= len(b_ids) or b_ids[j] not in special:
            raise ConfigError(
                f"model.path: the chat template closes an assistant turn with no special token (after the turn it "
                f"renders {tail[:80]!r}); token-in/token-out needs one (the engine stops on it)"
            )
        return _shift(b["offset_mapping"][j], ta)

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

    @staticmethod
    def _as_user(m: dict[str, Any]) -> dict[str, Any]:
        """A tool result as a user message, wrapped in ``<tool_response>`` (parts stay parts)."""
        content = m["content"]
        if isinstance(content, str):
            return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        return {"role": "user", "content": [{"type": "text", "text": "<tool_response>\n"}, *content,
                                            {"type": "text", "text": "\n</tool_response>"}]}

    # -- plain-text tokenization ------------------------------------------------------------
    def _placeheld(self, msgs: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
        """(texts, ``msgs`` with each user/tool text replaced by placeholder i for texts[i])."""
        texts: list[str] = []

        def hold(text: str) -> str:
            texts.append(text)
            return _placeholder(len(texts) - 1)

        out = []
        for m in msgs:
            content = m["content"]
            if m["role"] in _PLAIN_ROLES:
                if isinstance(content, str):
                    content = hold(content)
                else:
                    content = [{**p, "text": hold(p["text"])} if p.get("type") == "text" else p for p in content]
            out.append({**m, "content": content})
        return texts, out

    def _render_plain(self, msgs: list[dict[str, Any]], gen: bool, **kwargs: Any) -> tuple[str, list[tuple[int, int]] | None]:
        """(rendered text, character spans of user/tool text in it, or None if they cannot be located)."""
        texts, held = self._placeheld(msgs)
        text = self._render(msgs, gen=gen, **kwargs)
        if not self._spells_added(texts):
            return text, []
        return text, self._spans(self._render(held, gen=gen, **kwargs), text, texts)

    def _spells_added(self, texts: list[str]) -> bool:
        return any(tok in t for t in texts for tok in self._added)

    @staticmethod
    def _spans(held: str, text: str, texts: list[str]) -> list[tuple[int, int]] | None:
        """Where ``texts`` sit in ``text``, given its rendering ``held`` with placeholders; None when
        the template changed them (neither verbatim nor trimmed)."""
        parts = _PLACEHOLDER.split(held)  # [structure, index, structure, index, ..., structure]
        for variant in (lambda t: t, str.strip):
            out, spans = [], []
            for k, piece in enumerate(parts):
                if k % 2 == 0:
                    out.append(piece)
                    continue
                start = sum(map(len, out))
                out.append(variant(texts[int(piece)]))
                spans.append((start, start + len(out[-1])))
            if "".join(out) == text:
                return spans
        return None

    def _encode(self, text: str, spans: list[tuple[int, int]] | None) -> list[int]:
        """Token ids of ``text`` in which an added/special token spelled inside ``spans`` is plain text.

        Each such occurrence is split after its first character, so the tokenizer cannot match
        it; text without one is tokenized in one call (identical to plain ``tokenizer(text)``).
        """
        if spans is None:
            raise EnvError("a user/tool message spells a special token (one of the tokenizer's added tokens) and the "
                           "chat template rewrites message content, so it cannot be tokenized as plain text")
        cuts = sorted({s + i + 1 for s, e in spans for tok in self._added for i in _find_all(text[s:e], tok)})
        bounds = [0, *cuts, len(text)]
        ids: list[int] = []
        for lo, hi in itertools.pairwise(bounds):
            ids += self.tokenizer(text[lo:hi], add_special_tokens=False)["input_ids"]
        return ids


def _common_prefix(a: str, b: str) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return a[:n]


def _shift(span: Any, by: int) -> tuple[int, int]:
    return span[0] + by, span[1] + by


def _find_all(text: str, sub: str) -> list[int]:
    out, i = [], text.find(sub)
    while i >= 0:
        out.append(i)
        i = text.find(sub, i + 1)
    return out
