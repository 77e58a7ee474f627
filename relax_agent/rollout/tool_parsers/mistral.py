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

    Strict: a list that does not decode or an element without a string ``name`` and an object
    ``arguments`` is a parse error and no call; text after a call is content. Special tokens are kept
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
        """Reasoning, the content before ``[TOOL_CALLS]``, and the calls after it; text after a call's
        JSON is content too (as vLLM's parser reads it); anything else is an error."""
        reasoning, rest = split_reasoning(strip_end_tokens(text, self.END_TOKENS), *self.THINK)
        at = rest.find(self.TOOL_CALLS)
        if at == -1:
            return ParsedAction(rest.strip(), (), (), reasoning)
        content, body = rest[:at].strip(), rest[at + len(self.TOOL_CALLS):]
        calls, error, trailing = self._calls(body)
        content = f"{content}\n{trailing}".strip() if trailing else content
        return ParsedAction(content, tuple(calls), (error,) if error else (), reasoning)

    def _calls(self, body: str) -> tuple[list[dict[str, Any]], str, str]:
        """(calls, error, the text after the last call) of what follows ``[TOOL_CALLS]``."""
        stripped = body.strip()
        if stripped.startswith("["):
            try:
                obj, stop = self._decoder.raw_decode(stripped)
            except json.JSONDecodeError as exc:
                return [], f"[TOOL_CALLS] list is not valid JSON ({exc.msg}): {stripped[:200]!r}", ""
            if not obj:
                return [], "[TOOL_CALLS] list is empty", ""
            calls: list[dict[str, Any]] = []
            for item in obj:
                args = item.get("arguments") if isinstance(item, dict) else None
                if isinstance(args, str):
                    args, _ = json_object(args, "tool call arguments")
                if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(args, dict):
                    return [], (f"[TOOL_CALLS] element must have a string 'name' and object 'arguments': "
                                f"{json.dumps(item)[:200]}"), ""
                calls.append(call(len(calls), item["name"], args))
            return calls, "", stripped[stop:].strip()
        calls, trailing = [], ""
        parts = body.split(self.TOOL_CALLS)  # v11+: NAME[ARGS]{...}, one [TOOL_CALLS] per call
        for i, part in enumerate(parts):
            m = self._NAMED.match(part)
            if m is None:  # kept: the complete calls before a cut last one
                return ((calls if i == len(parts) - 1 else []),
                        f"[TOOL_CALLS] is followed by {part.strip()[:80]!r}, not a JSON list or NAME[ARGS]{{...}}", "")
            raw, after = _json_and_rest(part[m.end():])
            args, error = json_object(raw, f"tool call {m.group(1)!r} arguments")
            if args is None:  # a cut last call: the complete ones before it stand
                return (calls if i == len(parts) - 1 else []), error, ""
            calls.append(call(len(calls), m.group(1), args))
            trailing = f"{trailing}\n{after}".strip()
        return calls, "", trailing


def _json_and_rest(text: str) -> tuple[str, str]:
    """(the JSON value ``text`` opens with, the text after it); (text, "") when it opens with none."""
    body = text.lstrip()
    try:
        _, stop = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        return text, ""
    return body[:stop], body[stop:].strip()
