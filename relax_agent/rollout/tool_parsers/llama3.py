"""Llama 3.1 / 3.2 / 3.3: a JSON call ``{"name": ..., "parameters": {...}}`` as the whole reply, or after ``<|python_tag|>``.

Reference: the Llama 3.3 chat template (``tests/data/chat_templates/meta-llama-Llama-3.3-70B-Instruct.jinja``,
"Respond in the format {"name": function name, "parameters": dictionary of argument name and its
value}") and vLLM's ``llama3_json`` tool parser (several calls separated by ``;``).
"""

from __future__ import annotations

import json
from typing import Any

from relax_agent.rollout.parsers import ParsedAction
from relax_agent.rollout.tool_parsers._common import call, strip_end_tokens


class Llama3JsonParser:
    """A reply that starts with ``{`` (after an optional ``<|python_tag|>``) is one or more calls.

    Strict: the whole reply must then be call objects separated by ``;`` (``name`` a string,
    ``parameters`` or ``arguments`` an object), else it is a parse error and no call; a reply
    that does not start with ``{`` is a plain answer. ``<|python_tag|>`` followed by anything but
    JSON (built-in tool code) is a parse error: it is not a function call. Special tokens are kept
    when decoding (``<|python_tag|>`` is one); the closing ``<|eot_id|>``/``<|eom_id|>`` is dropped.
    """

    family = "llama3"
    keeps_special_tokens = True
    PYTHON_TAG = "<|python_tag|>"
    END_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    _decoder = json.JSONDecoder()

    def format(self, calls: list[dict[str, Any]]) -> str:
        """``calls`` (``{"name", "arguments"}``) as the template writes them (``parameters``, ``; `` between)."""
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False) for c in calls)

    def parse(self, text: str) -> ParsedAction:
        """A reply starting with ``{`` (after ``<|python_tag|>``) as its JSON calls; any other reply is
        content (an error when the tag is followed by no call)."""
        body = strip_end_tokens(text, self.END_TOKENS).strip()
        tagged = body.startswith(self.PYTHON_TAG)
        body = body[len(self.PYTHON_TAG):].strip() if tagged else body
        if not body.startswith("{"):
            if tagged:
                return ParsedAction("", (), (f"{self.PYTHON_TAG} is followed by {body[:80]!r}, not a JSON function call",))
            return ParsedAction(body.replace(self.PYTHON_TAG, ""))
        calls: list[dict[str, Any]] = []
        pos = 0
        while True:
            try:
                obj, stop = self._decoder.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                return ParsedAction("", (), (f"tool call is not valid JSON ({exc.msg}): {body[pos:pos + 200]!r}",))
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                return ParsedAction("", (), ("tool call must be an object with a string 'name' and an object "
                                             f"'parameters', got {body[pos:stop][:200]!r}",))
            calls.append(call(len(calls), obj["name"], args))
            rest = body[stop:].lstrip()
            if not rest:
                return ParsedAction("", tuple(calls))
            if not rest.startswith(";"):
                return ParsedAction("", (), (f"tool call JSON is followed by {rest[:40]!r}",))
            pos = len(body) - len(rest[1:].lstrip())
