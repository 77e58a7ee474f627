"""Tool-call parsers: model text -> one OpenAI-format assistant message.

Parsers are registered by name (``rollout.tool_parser`` in the config). A parser never raises
on bad model output: malformed calls are reported in ``ParsedAction.errors`` so the
environment can grade them (a malformed call is a wrong answer, not a crash).

The policy families' own formats (``qwen3``, ``qwen3_coder``, ``llama3``, ``mistral``,
``gpt_oss``, ``deepseek_v3``, ``glm45``, ``kimi_k2``, ``gemma``) live one per file in
:mod:`relax_agent.rollout.tool_parsers`, and ``auto`` picks one from the chat template
(:func:`relax_agent.rollout.tool_parsers.resolve_tool_parser`). The generic formats (Hermes here, the JSON ones
in :mod:`relax_agent.rollout.json_parsers`) come
in a lenient and a strict flavour (train with the lenient one if the policy needs credit for
near-misses; evaluate with the strict one to see them):

    hermes / hermes_strict              <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    json / json_strict                  bare JSON: {"name": ..., "arguments": {...}} or a list of them
    json_fenced / json_fenced_strict    the same JSON inside a Markdown fence: ```json ... ```

A call object is ``{"name": str, "arguments": object}``; ``parameters`` is accepted for
``arguments``, and ``arguments`` may be a JSON string holding an object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from relax_agent.errors import ConfigError


@dataclass(frozen=True)
class ParsedAction:
    """The parsed assistant turn.

    Attributes:
        content: text outside the tool-call blocks (stripped).
        tool_calls: OpenAI-format calls ``{"id", "type": "function", "function": {"name", "arguments": dict}}``.
        errors: one message per block that looked like a call but did not parse.
        reasoning: the turn's reasoning text (``<think>`` block, gpt-oss analysis channel), kept
            out of ``content``; empty when the family has none or the turn wrote none.
        rejected: the JSON values of Hermes call blocks that decoded but are not call objects (a
            list, an object without a string ``name`` or without object ``arguments``), in block
            order; each also has its message in ``errors``. A judge that follows BFCL's decoder
            needs them: BFCL skips a block that is not JSON but counts or rejects one that is.
    """

    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()
    errors: tuple[str, ...] = field(default=())
    reasoning: str = ""
    rejected: tuple[Any, ...] = ()

    def message(self) -> dict[str, Any]:
        """The assistant message handed to ``env.step`` (``reasoning_content`` only when there is reasoning)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        msg["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.errors:
            msg["parse_errors"] = list(self.errors)
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.rejected:
            msg["rejected_calls"] = list(self.rejected)
        return msg


class ToolCallParser(Protocol):
    """Turns sampled text into a :class:`ParsedAction`.

    A parser whose family marks calls with special tokens (``[TOOL_CALLS]``, harmony's
    ``<|channel|>``) sets a class attribute ``keeps_special_tokens = True``: the rollout drivers
    then decode the sampled ids with special tokens kept (the turn's closing token included,
    which such a parser drops; see :class:`ReadsSpecialTokens`). Without the attribute they are skipped.
    """

    def parse(self, text: str) -> ParsedAction:
        """The content, tool calls, parse errors and reasoning of one sampled turn's ``text``."""


@runtime_checkable
class ReadsSpecialTokens(Protocol):
    """A :class:`ToolCallParser` that says whether its family's calls are marked by special tokens.

    Attributes:
        keeps_special_tokens: True when the parser needs the sampled text decoded with special
            tokens kept (``[TOOL_CALLS]``, ``<|channel|>``, the turn's closing token).
    """

    keeps_special_tokens: bool


@runtime_checkable
class SplitsReasoning(Protocol):
    """A :class:`ToolCallParser` whose family writes its reasoning between two markers.

    Attributes:
        THINK: ``(open, close)`` markers of the reasoning span (``("<think>", "</think>")``).
    """

    THINK: tuple[str, str]


@runtime_checkable
class WritesCalls(Protocol):
    """A :class:`ToolCallParser` that can also write calls in its family's format (the inverse of
    ``parse``): what demonstrations and re-rendered history need."""

    def format(self, calls: list[dict[str, Any]]) -> str:
        """The text a policy writes for ``calls`` (``[{"name", "arguments"}]``, arguments a dict)."""
        ...


@runtime_checkable
class ReadsToolSchemas(Protocol):
    """A :class:`ToolCallParser` whose family writes argument values as bare text (GLM-4.5,
    Qwen3-Coder): the episode's tool schemas say whether ``75001`` is a string or a number."""

    def parse_with_tools(self, text: str, tools: Sequence[dict[str, Any]]) -> ParsedAction:
        """``parse(text)`` with each argument value typed by its parameter's schema in ``tools``
        (OpenAI tool schemas); a parameter the tools do not declare is typed as ``parse`` types it."""
        ...


def parse_reply(parser: ToolCallParser, text: str, tools: Sequence[dict[str, Any]] = ()) -> ParsedAction:
    """``parser``'s reading of one sampled ``text``, its values typed by ``tools``' schemas where the
    parser reads them (:class:`ReadsToolSchemas`)."""
    if tools and isinstance(parser, ReadsToolSchemas):
        return parser.parse_with_tools(text, tools)
    return parser.parse(text)


def decodes_special_tokens(parser: Any) -> bool:
    """True when ``parser`` reads special tokens (:class:`ReadsSpecialTokens`): decode its text with
    ``skip_special_tokens=False``."""
    return isinstance(parser, ReadsSpecialTokens) and bool(parser.keeps_special_tokens)


def reasoning_markers(parser: Any) -> tuple[str, str] | None:
    """``parser``'s reasoning markers (:class:`SplitsReasoning`); None for a family without them."""
    if not isinstance(parser, SplitsReasoning):
        return None
    opener, closer = parser.THINK
    return opener, closer


def _plain_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{"name", "arguments"}]`` of an assistant message's OpenAI ``tool_calls``."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        out.append({"name": fn["name"], "arguments": json.loads(args) if isinstance(args, str) else args})
    return out


def format_message(parser: Any, message: dict[str, Any]) -> str:
    """The text a policy using ``parser`` writes for assistant ``message`` (its ``content`` when it
    has no tool calls): what a demonstration of that message trains the policy to sample, and what
    ``parser.parse`` reads back as the same calls.

    Raises:
        ConfigError: the parser has no written form (no ``format`` method).
    """
    calls = _plain_calls(message)
    if not calls:
        return message.get("content") or ""
    if not isinstance(parser, WritesCalls):
        raise ConfigError(f"tool parser {type(parser).__name__} cannot write calls (no format method); "
                          "use a built-in parser (hermes, json, json_fenced or a family parser) for demonstrations")
    return parser.format(calls)


def _call(index: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes / Qwen style).

    Args:
        strict: when False (``"hermes"``), the JSON object right after ``<tool_call>`` is decoded
            on its own and is a call even if junk follows it instead of ``</tool_call>``, or
            nothing does (the junk is kept as content): a weak policy gets credit for the call
            itself; ``arguments`` may be an object or a JSON string holding one, ``parameters``
            is accepted as an alias. When True (``"hermes_strict"``), the reply is read exactly
            as BFCL's decoder (``QwenFCHandler``) reads it, so a policy trained with the lenient
            parser and its habits (junk after a call, a dropped closing tag) show up in evaluation:

            * everything up to the last ``</think>`` is reasoning, not calls;
            * a block is ``<tool_call>\n BODY \n</tool_call>`` (BFCL's pattern, newlines
              included, the first closing tag after the opening one); a block not framed so (one
              line, cut off at the token limit, junk after the JSON) is a parse error;
            * BODY must be exactly one JSON value, else a parse error;
            * the value is a call when it is an object with a string ``name`` and an object
              ``arguments`` (no alias, no JSON-string arguments: BFCL's decoder refuses them);
              any other value is a parse error and is kept in ``ParsedAction.rejected``.
        framed: only with ``strict``: False reads strict blocks without BFCL's framing (a one-line
            block is a call; junk after the JSON or a missing ``</tool_call>`` is a parse error),
            for families whose reference (vLLM's ``hermes`` parser) reads them so.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    THINK_CLOSE = "</think>"
    _FRAMED = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
    _decoder = json.JSONDecoder()

    def __init__(self, strict: bool = False, framed: bool = True):
        self.strict = strict
        self.framed = strict and framed

    def format(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) as ``<tool_call>`` blocks, one per line group."""
        return "\n".join(f"{self.OPEN}\n{json.dumps(c, ensure_ascii=False)}\n{self.CLOSE}" for c in calls)

    def parse(self, text: str) -> ParsedAction:
        """Every ``<tool_call>`` block as a call (a malformed block as an error); the text around
        the blocks is the content."""
        if self.framed:
            return self._parse_framed(text)
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        rejected: list[Any] = []
        content: list[str] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) != -1:
            content.append(text[pos:start])
            body_start = start + len(self.OPEN)
            call, error, pos, obj = self._parse_block(text, body_start, len(calls))
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
                rejected += obj
        content.append(text[pos:])
        return ParsedAction("".join(content).strip(), tuple(calls), tuple(errors), rejected=tuple(rejected))

    def _parse_framed(self, text: str) -> ParsedAction:
        """``hermes_strict``: BFCL's decoder's reading of ``text`` (class docstring)."""
        reasoning = ""
        if self.THINK_CLOSE in text:
            head, _, text = text.rpartition(self.THINK_CLOSE)
            reasoning = head.strip().removeprefix("<think>").strip()
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        rejected: list[Any] = []
        content: list[str] = []
        pos = 0
        for block in self._FRAMED.finditer(text):
            content.append(self._unframed(text[pos:block.start()], errors))
            pos = block.end()
            try:
                obj = json.loads(block.group(1))
            except json.JSONDecodeError as exc:
                errors.append(f"tool call is not valid JSON ({exc.msg}): {block.group(1).strip()[:200]!r}")
                continue
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict):
                calls.append(_call(len(calls), obj["name"], obj["arguments"]))
            else:
                errors.append("tool call must be an object with a string 'name' and object 'arguments', "
                              f"got {json.dumps(obj)[:200]}")
                rejected.append(obj)
        content.append(self._unframed(text[pos:], errors))
        return ParsedAction("".join(content).strip(), tuple(calls), tuple(errors), reasoning, tuple(rejected))

    def _unframed(self, text: str, errors: list[str]) -> str:
        """``text`` (between framed blocks) without its unframed ``<tool_call>`` blocks, one error each."""
        kept = []
        while (start := text.find(self.OPEN)) != -1:
            kept.append(text[:start])
            close = text.find(self.CLOSE, start)
            end = len(text) if close == -1 else close + len(self.CLOSE)
            why = "has no closing " + self.CLOSE if close == -1 else "is not framed by newlines"
            errors.append(f"tool call block {why} (BFCL reads <tool_call>\\n{{...}}\\n</tool_call> only; e.g. a reply "
                          f"cut at the token limit, or junk after the JSON): {text[start:end][:200]!r}")
            text = text[end:]
        return "".join(kept) + text

    def _parse_block(self, text: str, i: int, index: int) -> tuple[dict[str, Any] | None, str, int, list[Any]]:
        """Decode the call starting at ``text[i]``; returns (call, error, position after the block, the
        decoded value in a list when it is not a call)."""
        close = text.find(self.CLOSE, i)
        end = len(text) if close == -1 else close + len(self.CLOSE)
        j = i + len(text[i:]) - len(text[i:].lstrip())
        try:
            obj, stop = self._decoder.raw_decode(text, j)
        except json.JSONDecodeError as exc:
            body = text[i:close if close != -1 else len(text)].strip()
            return None, f"tool call is not valid JSON ({exc.msg}): {body[:200]!r}", end, []
        rest = text[stop:]
        if rest.lstrip().startswith(self.CLOSE):
            end = stop + (len(rest) - len(rest.lstrip())) + len(self.CLOSE)
        elif self.strict and rest.strip():
            return None, f"tool call JSON is followed by {rest.strip()[:40]!r} instead of {self.CLOSE}", end, []
        elif self.strict:
            return None, (f"tool call block has no closing {self.CLOSE} (the reply ended inside the block, e.g. "
                          f"cut at the token limit): {text[i:][:200].strip()!r}"), end, []
        elif close == -1 or text[stop:close].strip():
            end = stop  # no closing tag right after the object: keep what follows as content
        call, error = call_from_object(obj, index)
        return call, error, end, [] if call is not None else [obj]


def call_from_object(obj: Any, index: int) -> tuple[dict[str, Any] | None, str]:
    """(the OpenAI-format call ``index`` of a decoded call object, "") or (None, why it is not one); a call
    object is ``{"name": str, "arguments": object}`` (``parameters`` accepted, ``arguments`` may be a JSON string)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, f"tool call must be an object with a string 'name', got {json.dumps(obj)[:200]}"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f"tool call arguments are not a JSON object: {args[:200]!r}"
    if not isinstance(args, dict):
        return None, f"tool call arguments must be an object, got {type(args).__name__}"
    return _call(index, obj["name"], args), ""


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "hermes_strict": lambda: HermesParser(strict=True),
}


def register_parser(name: str, factory: Callable[[], ToolCallParser]) -> None:
    """Make a parser available as ``rollout.tool_parser: NAME``."""
    _PARSERS[name] = factory


def _registry() -> dict[str, Callable[[], ToolCallParser]]:
    """The registered parsers, the JSON ones (:mod:`relax_agent.rollout.json_parsers`) and the family parsers
    (``relax_agent.rollout.tool_parsers``) included."""
    from relax_agent.rollout.json_parsers import JSON_PARSERS
    from relax_agent.rollout.tool_parsers import FAMILY_PARSERS

    for name, factory in {**JSON_PARSERS, **FAMILY_PARSERS}.items():
        _PARSERS.setdefault(name, factory)  # type: ignore[arg-type]
    return _PARSERS


def known_parsers() -> list[str]:
    """Names ``rollout.tool_parser`` accepts (``auto`` aside), sorted."""
    return sorted(_registry())


def build_parser(name: str) -> ToolCallParser:
    """The parser registered as ``name``.

    Raises:
        ConfigError: no parser has that name, or ``name`` is ``"auto"`` (resolve it first with
            :func:`relax_agent.rollout.tool_parsers.resolve_tool_parser`, which needs the tokenizer).
    """
    registry = _registry()
    if name == "auto":
        raise ConfigError("rollout.tool_parser=auto is resolved from the policy's chat template: call "
                          "relax_agent.rollout.tool_parsers.resolve_tool_parser(tokenizer) and build that name")
    if name not in registry:
        raise ConfigError(f"rollout.tool_parser={name!r} is not a registered parser; known: {sorted(registry)} or 'auto'")
    return registry[name]()
