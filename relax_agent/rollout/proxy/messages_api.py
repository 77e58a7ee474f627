"""The Anthropic Messages API (``POST /v1/messages``) as a translation to the internal chat request.

Request (https://docs.anthropic.com/en/api/messages):

- ``messages``: ``user`` / ``assistant`` turns whose content is a string or content blocks:
  ``text``; in a user turn ``tool_result`` (``tool_use_id``, ``content`` a string or text
  blocks), each a tool message answering that id (placed before the turn's text); in an assistant
  turn ``tool_use`` (``id``, ``name``, ``input``), the assistant message's tool calls. An agent
  that sends back ``response.content`` as the assistant turn sends exactly the turn it got, so
  the session reuses the sampled tokens. ``is_error`` of a tool result is not shown to the
  policy (the chat template has no such flag); ``cache_control`` changes nothing.
- ``system`` (a string or text blocks), ``tools`` (``name``, ``description``, ``input_schema``),
  ``tool_choice`` (``auto``, ``any`` = required, ``tool`` = a named one, ``none``;
  ``disable_parallel_tool_use``), ``max_tokens`` (required), ``stop_sequences`` (at most 4, as the
  chat path's ``stop``), ``temperature``, ``top_p``, ``stream``, ``model``; the hints of
  :data:`HINTS` (``metadata``, ``service_tier``, ``cache_control``, ``inference_geo``, ``speed``,
  ``user_profile_id``, ``workspace_id``) are accepted and change nothing.
- Prefill: a final ``assistant`` turn (text, no trailing whitespace) is the start of the reply:
  its tokens follow the generation prompt as context (loss mask 0), the policy continues it, and
  the returned content is only the new text (as the Messages API returns it).
- Refused with 400 naming the field: ``top_k``, ``thinking`` (but ``{"type": "disabled"}``),
  server tools (web search, bash...), image / document / thinking blocks, a missing
  ``max_tokens``, any unknown field; an assistant turn whose ``tool_use`` ids the next user turn
  does not all answer with ``tool_result`` blocks (the Messages API's message, naming the ids);
  ``thread`` (the endpoint stores no conversation), with ``error.details.error_code``
  ``thread_unsupported_request``, on which the SDK's tool runner re-sends the whole history.

``POST /v1/messages/count_tokens`` (``model``, ``messages``, ``system``, ``tools``,
``tool_choice``) answers ``{"input_tokens": N}``: the length of the prompt ``/v1/messages`` would
sample from for the same body (the episode's recorded tokens where the messages extend them).

Response: ``type: "message"`` with content blocks ``text`` (when the reply has text) and
``tool_use`` (``input`` the decoded arguments), ``stop_reason`` ``end_turn``, ``tool_use``,
``max_tokens`` or ``stop_sequence`` (with ``stop_sequence``), ``usage``. Streamed: Anthropic's
events (``message_start``, ``content_block_start`` / ``content_block_delta`` (``text_delta`` as
tokens are sampled, ``input_json_delta``) / ``content_block_stop``, ``message_delta`` with the stop
reason and usage, ``message_stop``; ``error`` after a failure); ``input_tokens`` is in
``message_start`` and again in ``message_delta`` (there only, for a retry answered from the record).
Errors have Anthropic's body ``{"type": "error", "error": {"type", "message"}}``. The key is read
from ``x-api-key`` or ``Authorization: Bearer``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from relax_agent.rollout.proxy.openai_api import Answer, ChatRequest, Choice, RequestError, parse_chat_request
from relax_agent.rollout.proxy.streaming import continuation
from relax_agent.rollout.proxy.wire import bearer, check_fields, sse_event

HINTS = frozenset({"metadata", "service_tier", "cache_control", "inference_geo", "speed", "user_profile_id",
                   "workspace_id"})
"""Documented fields that change neither the sampling nor the response (attribution, caching, where and how fast
the request is served), accepted at any value and ignored."""
ACCEPTED = frozenset({"model", "messages", "system", "tools", "tool_choice", "max_tokens", "stop_sequences",
                      "temperature", "top_p", "stream", *HINTS})
COUNTED = frozenset({"model", "messages", "system", "tools", "tool_choice", "cache_control", "speed"})
"""Fields of ``POST /v1/messages/count_tokens``."""
NOOP: dict[str, tuple[Any, ...]] = {"top_k": (None,), "thinking": (None, {"type": "disabled"})}
"""Fields accepted only at these values (they change nothing)."""
THREAD_UNSUPPORTED = "thread_unsupported_request"
"""The error code (in ``error.details.error_code``) with which the Messages API refuses a ``thread`` it cannot hold;
the ``anthropic`` SDK's tool runner then sends the whole history without one."""
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               422: "invalid_request_error", 429: "rate_limit_error", 529: "overloaded_error"}
"""Anthropic's error type of each HTTP status (others: ``api_error``)."""


class MessagesApi:
    """``POST /v1/messages`` (see :class:`~relax_agent.rollout.proxy.wire.WireApi` and the module doc)."""

    path = "/v1/messages"

    def api_key(self, headers: Any) -> str:
        """The ``x-api-key`` header, else the ``Authorization: Bearer`` key ("" when neither)."""
        return (headers.get("x-api-key") or "").strip() or bearer(headers)

    def parse(self, body: Any) -> ChatRequest:
        """The internal chat request of a Messages API body (:func:`chat_body` converts it; a final
        assistant turn is the reply's ``prefill``)."""
        chat, prefill = chat_body(body)
        return dataclasses.replace(parse_chat_request(chat), prefill=prefill)

    def parse_count(self, body: Any) -> ChatRequest:
        """The internal chat request whose prompt a ``count_tokens`` body asks the length of.

        Raises:
            RequestError: a field ``count_tokens`` does not take, or a body ``/v1/messages`` would refuse.
        """
        body = check_fields(body, "/v1/messages/count_tokens", COUNTED, NOOP)
        return self.parse({**body, "max_tokens": 1})

    def response(self, answer: Answer, req: ChatRequest, body: dict[str, Any]) -> dict[str, Any]:
        """An Anthropic ``message`` object of the first choice: content blocks (after the prefill, which
        is not repeated), stop reason, usage."""
        c = answer.choices[0]
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "model": req.model or answer.model, "content": content_blocks(c, req.prefill),
                "stop_reason": stop_reason(c), "stop_sequence": c.stop_string,
                "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens}}

    def writer(self, req: ChatRequest, body: dict[str, Any], model: str) -> MessagesStreamWriter:
        """A :class:`MessagesStreamWriter` for ``model``."""
        return MessagesStreamWriter(model)

    def error(self, exc: RequestError) -> dict[str, Any]:
        """Anthropic's error body of ``exc``."""
        return error_body(exc)


def error_body(exc: RequestError) -> dict[str, Any]:
    """Anthropic's error body of ``exc`` (the field, when known, is named in the message)."""
    message = str(exc) if exc.param is None or exc.param in str(exc) else f"{exc.param}: {exc}"
    error: dict[str, Any] = {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": message}
    if exc.code == THREAD_UNSUPPORTED:
        error["details"] = {"error_code": THREAD_UNSUPPORTED, "unsupported": ["thread"]}
    return {"type": "error", "error": error}


def chat_body(body: Any) -> tuple[dict[str, Any], str]:
    """The chat-completions body of a Messages request body, and the text of its final assistant
    turn when it has one (a prefill the reply continues; "" otherwise).

    Raises:
        RequestError: an unknown, refused or malformed field (named as the Messages API names it);
            a ``thread`` (400 with ``error.details.error_code`` :data:`THREAD_UNSUPPORTED`).
    """
    if isinstance(body, dict) and body.get("thread") is not None:
        raise RequestError("thread is not supported: this endpoint stores no conversations; send the whole history "
                           "without thread", "thread", code=THREAD_UNSUPPORTED)
    check_fields(body, "/v1/messages", ACCEPTED, NOOP)
    if body.get("max_tokens") is None:
        raise RequestError("max_tokens is required (the most tokens to sample)", "max_tokens")
    out: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "max_tokens")
                           if body.get(k) is not None}
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 1:
        raise RequestError(f"temperature={temperature} must be in [0, 1]", "temperature")
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"], "system")})
    turns = turn_messages(body.get("messages"))
    prefill = _prefill(turns, body)
    if prefill:
        turns = turns[:-1]
    messages.extend(turns)
    out["messages"] = messages
    tools = body.get("tools")
    if tools is not None:
        out["tools"] = _tools(tools)
    if body.get("tool_choice") is not None:
        out["tool_choice"], parallel = _tool_choice(body["tool_choice"])
        if not parallel:
            out["parallel_tool_calls"] = False
    if body.get("stop_sequences") is not None:
        stops = body["stop_sequences"]
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise RequestError(f"stop_sequences must be a list of at most 4 non-empty strings, got {stops!r}",
                               "stop_sequences")
        if stops:
            out["stop"] = stops
    return out, prefill


def _prefill(turns: list[dict[str, Any]], body: dict[str, Any]) -> str:
    """The text of a final assistant turn ("" when the last turn is the user's or empty).

    Raises:
        RequestError: it ends with whitespace, or comes with a forced tool choice (as the Messages API refuses them).
    """
    last = turns[-1]
    if last["role"] != "assistant" or not last.get("content"):
        return ""
    text = last["content"]
    if text != text.rstrip():
        raise RequestError("messages: final assistant content cannot end with trailing whitespace", "messages")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        raise RequestError(f"a final assistant turn (prefill) cannot be continued with tool_choice "
                           f"{choice.get('type')!r}, which forces the reply to open with a tool call; use 'auto'",
                           "tool_choice")
    return text


def turn_messages(raw: Any) -> list[dict[str, Any]]:
    """Chat messages of the Messages API's ``messages`` (see the module doc)."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list of user / assistant turns", "messages")
    out: list[dict[str, Any]] = []
    used: set[str] = set()
    asked: list[str] = []  # tool_use ids of the previous assistant turn
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise RequestError(f"{where}.role must be 'user' or 'assistant', got {role!r}", f"{where}.role")
        content = m.get("content")
        _check_answered(asked, content if role == "user" else None, i - 1)
        asked = []
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                        or not isinstance(block.get("input"), dict):
                    raise RequestError(f"{at} must be {{'type': 'tool_use', 'id': ..., 'name': ..., 'input': {{...}}}}",
                                       at)
                used.add(block["id"])
                asked.append(block["id"])
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"],
                                           "arguments": json.dumps(block["input"], ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if block.get("tool_use_id") not in used:
                    raise RequestError(f"{at} is a tool_result for tool_use_id {block.get('tool_use_id')!r}, which no "
                                       f"earlier assistant turn's tool_use has (known ids: {sorted(used)}); a "
                                       "tool_result must answer a preceding tool_use by its id", f"{at}.tool_use_id")
                result = block.get("content")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": "" if result is None else _text(result, f"{at}.content")})
            else:
                raise RequestError(f"{at} is a {kind!r} block in a {role} turn; this endpoint takes text blocks, "
                                   "tool_use blocks in assistant turns and tool_result blocks in user turns "
                                   "(the policy is text-only)", at)
        if role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
        else:
            out.extend(results)
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
    _check_answered(asked, None, len(raw) - 1)
    return out


def _check_answered(asked: list[str], content: Any, index: int) -> None:
    """Refuse, as the Messages API does, ``tool_use`` ids of turn ``index`` (``asked``) that the next
    turn's ``content`` (None: no user turn follows) does not answer with ``tool_result`` blocks.

    Raises:
        RequestError: 400 naming the turn and the unanswered ids.
    """
    answered = {b.get("tool_use_id") for b in content if isinstance(b, dict) and b.get("type") == "tool_result"} \
        if isinstance(content, list) else set()
    missing = [a for a in asked if a not in answered]
    if missing:
        raise RequestError(f"messages.{index}: `tool_use` ids were found without `tool_result` blocks immediately "
                           f"after: {', '.join(missing)}. Each `tool_use` block must have a corresponding "
                           "`tool_result` block in the next message.")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text blocks, got {content!r}", where)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise RequestError(f"{where}[{j}] is a {kind!r} block; only text blocks are supported here "
                               "(the policy is text-only)", f"{where}[{j}]")
    return "".join(b["text"] for b in content)


def _tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise RequestError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str) \
                or not isinstance(t.get("input_schema"), dict):
            kind = t.get("type") if isinstance(t, dict) else None
            raise RequestError(f"tools[{i}] must be a client tool {{'name': ..., 'input_schema': {{...}}}}, got type "
                               f"{kind!r} (server tools are not available)", f"tools[{i}]")
        fn = {"name": t["name"], **({"description": t["description"]} if t.get("description") is not None else {}),
              "parameters": t["input_schema"]}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> tuple[Any, bool]:
    """(chat ``tool_choice``, parallel tool calls allowed)."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    parallel = not (isinstance(raw, dict) and raw.get("disable_parallel_tool_use") is True)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}, parallel
    raise RequestError(f"tool_choice must be {{'type': 'auto' | 'any' | 'none'}} or {{'type': 'tool', 'name': ...}}, "
                       f"got {raw!r}", "tool_choice")


def stop_reason(c: Choice) -> str:
    """Anthropic's ``stop_reason`` of a choice."""
    if c.tool_calls:
        return "tool_use"
    if c.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if c.stop_string is not None else "end_turn"


def content_blocks(c: Choice, prefill: str = "") -> list[dict[str, Any]]:
    """The content blocks of a choice: its text after ``prefill`` (when any), then a ``tool_use`` per call."""
    text = continuation(c.content, prefill)
    out: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for call in c.tool_calls:
        out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"])})
    return out


class MessagesStreamWriter:
    """Anthropic's stream events of one answer (see the module doc)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex}"
        self.text_open = False

    def start(self, prompt_tokens: int | None = None) -> list[str]:
        """``message_start`` with an empty message (``prompt_tokens`` as its input usage)."""
        usage = {"input_tokens": prompt_tokens or 0, "output_tokens": 0}
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        return [sse_event("message_start", {"type": "message_start", "message": message})]

    def text(self, index: int, delta: str) -> list[str]:
        """``delta`` as a text ``content_block_delta`` (opening the text block first); choice ``index``
        is always 0."""
        out = []
        if not self.text_open:
            self.text_open = True
            out.append(sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                         "content_block": {"type": "text", "text": ""}}))
        out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                     "delta": {"type": "text_delta", "text": delta}}))
        return out

    def finish(self, answer: Answer, rests: list[str]) -> list[str]:
        """The unsent text, the text block's stop, one ``tool_use`` block per call, then
        ``message_delta`` (stop reason, usage) and ``message_stop``."""
        c = answer.choices[0]
        out = self.text(0, rests[0]) if rests[0] else []
        index = 0
        if self.text_open:
            out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
            index = 1
        for call in c.tool_calls:
            block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
            out.append(sse_event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": block}))
            out.append(sse_event("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}}))
            out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": index}))
            index += 1
        out.append(sse_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop_reason(c), "stop_sequence": c.stop_string},
            "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens}}))
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        return out

    def fail(self, error: RequestError) -> list[str]:
        """An ``error`` event with Anthropic's error body."""
        return [sse_event("error", error_body(error))]
