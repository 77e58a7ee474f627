"""Mistral: ``[TOOL_CALLS]`` followed by a JSON list of calls (v3 tokenizers: Mistral 7B v0.3, Nemo,
Small 3.1) or by ``NAME[ARGS]{...}`` (v11+ tokenizers: Small 3.2, Devstral, Magistral); Magistral's
``[THINK]...[/THINK]`` reasoning.

Reference: the Mistral Nemo chat template (``tests/data/chat_templates/mistralai-Mistral-Nemo-Instruct-2407.jinja``)
and vLLM's ``mistral`` tool parser.
"""

from __future__ import annotations

import json
import re
from typing import Any

from relax_agent.rollout.parsers import ParsedAction
from relax_agent.rollout.tool_parsers._common import call, json_object, split_reasoning, strip_end_tokens


class MistralParser:
    """Text before ``[TOOL_CALLS]`` is content; what follows must be calls and nothing else.

    Strict: a list that does not decode, an element without a string ``name`` and an object
    ``arguments``, or text after the calls is a parse error and no call. Special tokens are kept
    when decoding (``[TOOL_CALLS]`` is one); the closing ``</s>`` is dropped.
    """

    family = "mistral"
    keeps_special_tokens = True
    TOOL_CALLS = "[TOOL_CALLS]"
    THINK = ("[THINK]", "[/THINK]")
    END_TOKENS = ("</s>",)
    _decoder = json.JSONDecoder()
    _NAMED = re.compile(r"\s*([A-Za-z_][\w.\-]*)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")

    def format(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) in the v3 layout the Nemo template renders."""
        return self.TOOL_CALLS + json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls],
                                            ensure_ascii=False)

    def parse(self, text: str) -> ParsedAction:
        """Reasoning, the content before ``[TOOL_CALLS]``, and the calls after it (an error when anything
        else follows)."""
        reasoning, rest = split_reasoning(strip_end_tokens(text, self.END_TOKENS), *self.THINK)
        at = rest.find(self.TOOL_CALLS)
        if at == -1:
            return ParsedAction(rest.strip(), (), (), reasoning)
        content, body = rest[:at].strip(), rest[at + len(self.TOOL_CALLS):]
        calls, error = self._calls(body)
        return ParsedAction(content, tuple(calls), (error,) if error else (), reasoning)

    def _calls(self, body: str) -> tuple[list[dict[str, Any]], str]:
        stripped = body.strip()
        if stripped.startswith("["):
            try:
                obj, stop = self._decoder.raw_decode(stripped)
            except json.JSONDecodeError as exc:
                return [], f"[TOOL_CALLS] list is not valid JSON ({exc.msg}): {stripped[:200]!r}"
            if stripped[stop:].strip():
                return [], f"[TOOL_CALLS] list is followed by {stripped[stop:].strip()[:40]!r}"
            if not obj:
                return [], "[TOOL_CALLS] list is empty"
            calls: list[dict[str, Any]] = []
            for item in obj:
                args = item.get("arguments") if isinstance(item, dict) else None
                if isinstance(args, str):
                    args, _ = json_object(args, "tool call arguments")
                if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(args, dict):
                    return [], f"[TOOL_CALLS] element must have a string 'name' and object 'arguments': {json.dumps(item)[:200]}"
                calls.append(call(len(calls), item["name"], args))
            return calls, ""
        calls = []
        for part in body.split(self.TOOL_CALLS):  # v11+: NAME[ARGS]{...}, one [TOOL_CALLS] per call
            m = self._NAMED.match(part)
            if m is None:
                return [], f"[TOOL_CALLS] is followed by {part.strip()[:80]!r}, not a JSON list or NAME[ARGS]{{...}}"
            args, error = json_object(part[m.end():], f"tool call {m.group(1)!r} arguments")
            if args is None:
                return [], error
            calls.append(call(len(calls), m.group(1), args))
        return calls, ""
