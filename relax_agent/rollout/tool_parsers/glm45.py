"""GLM-4.5 / 4.6 / 4.7: ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``,
``<think>`` reasoning.

Reference: the GLM-4.6 chat template (``tests/data/chat_templates/GLM-4.6.jinja``, the GLM-4.5
tool format) and vLLM's ``glm45`` tool parser.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from relax_agent.rollout.parsers import ParsedAction
from relax_agent.rollout.tool_parsers._common import (
    call,
    only_space,
    param_schemas,
    schema_value,
    split_reasoning,
    strip_end_tokens,
    value_text,
)


class Glm45Parser:
    """Strict GLM calls; text outside ``<tool_call>`` blocks is content.

    A block is a function name on its first line, then only ``<arg_key>``/``<arg_value>`` pairs,
    and must end with ``</tool_call>``; anything else (a block cut at the token limit, a key
    without a value) is a parse error and no call. Values are typed by the tool schemas when
    :meth:`parse_with_tools` has them (a string parameter's ``75001`` stays a string, as vLLM's
    parser types it), else JSON when they decode, else strings (the template writes strings bare). Special tokens are kept when decoding (GLM's tags are
    special tokens); the turn-closing ``<|observation|>``/``<|user|>``/``<|endoftext|>`` is dropped.
    """

    family = "glm45"
    keeps_special_tokens = True
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    THINK = ("<think>", "</think>")
    END_TOKENS = ("<|observation|>", "<|user|>", "<|endoftext|>")
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def format(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) in the template's layout."""
        return "\n".join(self.OPEN + c["name"] + "".join(
            f"\n<arg_key>{k}</arg_key>\n<arg_value>{value_text(v)}</arg_value>" for k, v in c["arguments"].items())
            + "\n" + self.CLOSE for c in calls)

    def parse(self, text: str) -> ParsedAction:
        """Reasoning (``<think>``), the ``<tool_call>`` blocks as calls (a malformed block as an error)
        and the text around them as content; end tokens are stripped. Values typed without schemas
        (:func:`typed_value`)."""
        return self.parse_with_tools(text, ())

    def parse_with_tools(self, text: str, tools: Sequence[dict[str, Any]]) -> ParsedAction:
        """:meth:`parse` with each value typed by its parameter's schema in ``tools`` (:func:`schema_value`)."""
        schemas = param_schemas(tools)
        reasoning, rest = split_reasoning(strip_end_tokens(text, self.END_TOKENS), *self.THINK, call_open=self.OPEN)
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        content: list[str] = []
        pos = 0
        while (start := rest.find(self.OPEN, pos)) != -1:
            content.append(rest[pos:start])
            body_start = start + len(self.OPEN)
            close = rest.find(self.CLOSE, body_start)
            if close == -1:
                errors.append(f"tool call block has no closing {self.CLOSE}: {rest[body_start:][:200].strip()!r}")
                pos = len(rest)
                break
            found, error = self._block(rest[body_start:close], len(calls), schemas)
            calls += [found] if found else []
            errors += [error] if error else []
            pos = close + len(self.CLOSE)
        content.append(rest[pos:])
        return ParsedAction("".join(content).strip(), tuple(calls), tuple(errors), reasoning)

    def _block(self, body: str, index: int, schemas: dict[str, dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
        first, sep, pairs = body.partition("<arg_key>")
        name = first.strip()
        if not name or "<" in name or "\n" in name:
            return None, f"tool call block does not start with a function name: {body[:200].strip()!r}"
        pairs = sep + pairs
        args: dict[str, Any] = {}
        pos = 0
        for m in self._PAIR.finditer(pairs):
            if not only_space(pairs[pos:m.start()]):
                return None, f"tool call {name!r} has text outside its arguments: {pairs[pos:m.start()].strip()[:80]!r}"
            key = m.group(1).strip()
            args[key] = schema_value(m.group(2), schemas.get(name, {}).get(key))
            pos = m.end()
        if not only_space(pairs[pos:]):
            return None, f"tool call {name!r} has text outside its arguments: {pairs[pos:].strip()[:80]!r}"
        return call(index, name, args), ""
