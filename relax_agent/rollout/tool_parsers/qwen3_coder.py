"""Qwen3-Coder: XML calls, ``<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>``.

Reference: the Qwen3-Coder chat template (``tests/data/chat_templates/Qwen3-Coder.jinja``) and
vLLM's ``qwen3_coder`` tool parser (one newline after ``<parameter=KEY>`` and before
``</parameter>`` belongs to the layout, not the value).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from relax_agent.rollout.parsers import ParsedAction
from relax_agent.rollout.tool_parsers._common import call, only_space, param_schemas, schema_value, value_text


def _value_text(value: Any) -> str:
    """A value as the template writes it: mappings and lists as JSON, anything else with Jinja's ``string``
    (so ``True``, ``None``: Python spellings, which :func:`typed_value` reads back)."""
    return str(value) if isinstance(value, bool) or value is None else value_text(value)


class Qwen3CoderParser:
    """Strict Qwen3-Coder calls; text outside ``<tool_call>`` blocks is content.

    A block must be exactly one ``<function=NAME>`` element holding only ``<parameter=KEY>``
    elements, every tag closed, and end with ``</tool_call>``; anything else (a block cut at the
    token limit, text between parameters, a missing ``</function>``) is a parse error and no
    call. Values are typed by the tool schemas when :meth:`parse_with_tools` has them (as vLLM types
    them: a string parameter's ``75001`` stays a string), else JSON when they decode, else strings
    (see :func:`typed_value`).
    """

    family = "qwen3_coder"
    keeps_special_tokens = False
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def format(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) in the template's layout."""
        blocks = []
        for c in calls:
            params = "".join(f"<parameter={k}>\n{_value_text(v)}\n</parameter>\n" for k, v in c["arguments"].items())
            blocks.append(f"{self.OPEN}\n<function={c['name']}>\n{params}</function>\n{self.CLOSE}")
        return "\n".join(blocks)

    def parse(self, text: str) -> ParsedAction:
        """The ``<tool_call><function=...>`` blocks as calls (a malformed block as an error) and the text
        around them as content. Values typed without schemas (:func:`typed_value`)."""
        return self.parse_with_tools(text, ())

    def parse_with_tools(self, text: str, tools: Sequence[dict[str, Any]]) -> ParsedAction:
        """:meth:`parse` with each value typed by its parameter's schema in ``tools`` (:func:`schema_value`)."""
        schemas = param_schemas(tools)
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        content: list[str] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) != -1:
            content.append(text[pos:start])
            body_start = start + len(self.OPEN)
            close = text.find(self.CLOSE, body_start)
            if close == -1:
                errors.append(f"tool call block has no closing {self.CLOSE}: {text[body_start:][:200].strip()!r}")
                pos = len(text)
                break
            found, error = self._block(text[body_start:close], len(calls), schemas)
            calls += [found] if found else []
            errors += [error] if error else []
            pos = close + len(self.CLOSE)
        content.append(text[pos:])
        return ParsedAction("".join(content).strip(), tuple(calls), tuple(errors))

    def _block(self, body: str, index: int, schemas: dict[str, dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
        m = self._FUNCTION.fullmatch(body)
        if m is None:
            return None, f"tool call block is not one closed <function=NAME> element: {body[:200].strip()!r}"
        name, inner = m.group(1).strip(), m.group(2)
        args: dict[str, Any] = {}
        pos = 0
        for p in self._PARAM.finditer(inner):
            if not only_space(inner[pos:p.start()]):
                return None, f"tool call {name!r} has text outside its parameters: {inner[pos:p.start()].strip()[:80]!r}"
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = p.group(1).strip()
            args[key] = schema_value(value, schemas.get(name, {}).get(key))
            pos = p.end()
        if not only_space(inner[pos:]):
            return None, f"tool call {name!r} has text outside its parameters: {inner[pos:].strip()[:80]!r}"
        return call(index, name, args), ""
