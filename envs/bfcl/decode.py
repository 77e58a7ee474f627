"""The calls BFCL's decoder reads from one assistant message: what the single-turn env and the BFCL
reward service judge, through this one function so the two cannot drift.

The message comes from a tool-call parser (``hermes_strict`` reads the text as BFCL's
``QwenFCHandler`` does: see :class:`relax_agent.rollout.parsers.HermesParser`) or from an agent's
OpenAI-format reply. BFCL's decoder, and so this module:

* skips a block it cannot read as JSON (cut off, not framed, junk after the JSON): the message's
  ``parse_errors`` do not change the verdict, and the good calls beside them are judged;
* reads a block that is JSON but not a call object as a failure of the whole turn (``decode_ast``
  raises): a ``rejected_calls`` value that is not an object with a ``name`` and object
  ``arguments`` makes the turn undecodable;
* reads an object whose ``name`` is not a string (a number, null, a boolean) as a call, a wrong
  one: such a ``rejected_calls`` value is judged as a call;
* reads nothing inside the reasoning (the parser keeps it out of ``tool_calls``).

An undecodable turn is wrong for a task that expects calls, right for an irrelevance task (no
call), wrong for a relevance task.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any

from relax_agent.envs.bfcl.checker import CheckResult, check_calls


def tool_call_entries(message: dict[str, Any]) -> list[tuple[str | None, Any, Any]]:
    """``(id, name, arguments)`` of each entry of an assistant message's ``tool_calls``.

    Entries are OpenAI-format (``{"id", "type": "function", "function": {...}}``) or flat
    ``{"name", "arguments"}``; ``id`` is None when absent. ``arguments`` may be a dict or a
    JSON string; a string that does not parse is kept as is (the caller judges it).
    """
    entries = []
    for tool_call in message.get("tool_calls") or []:
        function = tool_call.get("function", tool_call) if isinstance(tool_call, dict) else None
        function = function if isinstance(function, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        call_id = tool_call.get("id") if isinstance(tool_call, dict) else None
        entries.append((call_id, function.get("name"), arguments))
    return entries


def decoded_calls(message: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``[{"name", "arguments"}]`` that BFCL's decoder reads from assistant ``message``, or None when
    it cannot decode the turn (module docstring). ``arguments`` are dicts; ``name`` may be any JSON
    scalar (a non-string name is a call that names no task function)."""
    calls = [{"name": name, "arguments": arguments} for _, name, arguments in tool_call_entries(message)]
    for value in message.get("rejected_calls") or []:
        if not isinstance(value, dict) or "name" not in value or "arguments" not in value:
            return None
        calls.append({"name": value["name"], "arguments": value["arguments"]})
    if any(not _decodes(call) for call in calls):
        return None
    return calls


def _decodes(call: dict[str, Any]) -> bool:
    """BFCL's ``{name: {k: v for k, v in arguments.items()}}`` succeeds: a hashable name, dict arguments."""
    return isinstance(call["name"], Hashable) and isinstance(call["arguments"], dict)


def judge_message(message: dict[str, Any], task: dict[str, Any], bfcl_compat: bool = False) -> tuple[CheckResult, int]:
    """(BFCL's verdict on assistant ``message`` for ``task``, the number of call entries it holds).

    Raises:
        DataError: the task's answer or docs are malformed (see :func:`check_calls`).
    """
    calls = decoded_calls(message)
    entries = len(message.get("tool_calls") or []) + len(message.get("rejected_calls") or [])
    if calls is not None:
        return check_calls(calls, task, bfcl_compat=bfcl_compat), entries
    why = ("the turn does not decode as BFCL reads it (a call block holds JSON that is not an object with a "
           f"'name' and object 'arguments'): {json.dumps(message.get('rejected_calls'), default=str)[:200]}")
    expect = task.get("expect") or ("calls" if task["possible_answer"] else "no_call")
    if expect == "no_call":
        return CheckResult(True, True, f"ok ({why}, so it holds no call)"), entries
    return CheckResult(False, False, why), entries
