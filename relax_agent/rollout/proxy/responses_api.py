"""The OpenAI Responses API (``POST /v1/responses``) as a translation to the internal chat request.

Request (https://platform.openai.com/docs/api-reference/responses/create):

- ``input``: a string (one user message) or a list of items: messages (``{"role", "content"}``,
  ``type: "message"`` optional; content a string or ``input_text`` / ``output_text`` parts; role
  ``user``, ``system``, ``developer`` or ``assistant``), ``function_call`` items (``call_id``,
  ``name``, ``arguments``), which join the assistant message right before them, and
  ``function_call_output`` items (``call_id``, ``output``), which become tool messages answering
  that ``call_id``. An agent that appends ``response.output`` and its tool outputs to its input
  sends back exactly the assistant turn it got, so the session reuses the sampled tokens.
- ``instructions`` (a system message first), ``tools`` (``{"type": "function", "name",
  "description", "parameters", "strict"}``), ``tool_choice`` (``auto``, ``none``, ``required``,
  ``{"type": "function", "name"}``), ``parallel_tool_calls``, ``max_output_tokens``,
  ``temperature``, ``top_p``, ``stream``, ``model``; ``store``, ``metadata``, ``user`` and the hints
  ``prompt_cache_key``, ``prompt_cache_retention``, ``prompt_cache_options``, ``safety_identifier``,
  ``service_tier`` are accepted and change nothing (nothing is stored); so is
  ``stream_options.include_obfuscation`` (no obfuscation padding is sent).
- Refused with 400 naming the field: ``previous_response_id`` and ``item_reference`` items (the
  endpoint stores no responses: send the whole input), ``conversation``, non-function tools,
  ``reasoning`` items, non-text content (images, files), ``reasoning`` / ``text`` / ``truncation``
  / ``include`` / ``background`` at any value but their no-op one, and any unknown field.

Response: ``object: "response"`` with ``output`` items ``message`` (one ``output_text`` part;
present when the reply has text or no tool call; its ``status`` ``incomplete`` when the reply was
cut by its token limit) and ``function_call`` (``call_id``, ``name``,
``arguments`` as a JSON string), ``status`` ``completed`` (or ``incomplete`` with reason
``max_output_tokens`` when the reply was cut by its token limit) and ``usage``. Streamed: the
event sequence the ``openai`` SDK parses (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
as tokens are sampled, ``.done`` events, ``response.function_call_arguments.delta`` / ``.done``,
``response.output_item.done``, then ``response.completed`` or ``response.incomplete``; a failure
after the stream started is ``response.failed``). Errors have OpenAI's error body.
"""

from __future__ import annotations

import uuid
from typing import Any

from relax_agent.rollout.proxy.openai_api import (
    HINT_FIELDS,
    Answer,
    ChatRequest,
    RequestError,
    now_s,
    parse_chat_request,
)
from relax_agent.rollout.proxy.wire import bearer, check_fields, sse_event

PASSED = ("model", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "stream")
"""Fields whose meaning is the chat request's (``tools`` and ``tool_choice`` translated)."""
ACCEPTED = frozenset({"input", "instructions", "max_output_tokens", "store", "metadata", "user", *HINT_FIELDS})
"""Fields read (``input``...) or accepted and ignored (``store``, ``metadata``, ``user`` and the hints of
:data:`~relax_agent.rollout.proxy.openai_api.HINT_FIELDS`)."""
NOOP: dict[str, tuple[Any, ...]] = {
    "reasoning": (None, {}),
    "text": (None, {}, {"format": {"type": "text"}}),
    "truncation": (None, "disabled"),
    "include": (None, []),
    "background": (None, False),
    "top_logprobs": (None, 0),
    "stream_options": (None, {}, {"include_obfuscation": False}, {"include_obfuscation": True}),
}
"""Fields accepted only at these values (they change nothing)."""
REFUSED = {
    "previous_response_id": "this endpoint stores no responses; send the whole conversation as input",
    "conversation": "this endpoint stores no conversations; send the whole conversation as input",
    "prompt": "stored prompts are not available; send instructions and input",
}
RENAMED = {"max_tokens": "max_output_tokens", "messages": "input"}
"""Fields of the internal chat request that this API names otherwise (in error bodies)."""
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ResponsesApi:
    """``POST /v1/responses`` (see :class:`~relax_agent.rollout.proxy.wire.WireApi` and the module doc)."""

    path = "/v1/responses"

    def api_key(self, headers: Any) -> str:
        """The ``Authorization: Bearer`` key ("" when none)."""
        return bearer(headers)

    def parse(self, body: Any) -> ChatRequest:
        """The internal chat request of a Responses API body (:func:`chat_body` converts it)."""
        return parse_chat_request(chat_body(body))

    def response(self, answer: Answer, req: ChatRequest, body: dict[str, Any]) -> dict[str, Any]:
        """A completed ``response`` object with the answer's output items."""
        out = _Response(req, body, req.model or answer.model)
        return out.body(answer, output_items(answer))

    def writer(self, req: ChatRequest, body: dict[str, Any], model: str) -> ResponsesStreamWriter:
        """A :class:`ResponsesStreamWriter` for ``req`` and ``model``."""
        return ResponsesStreamWriter(_Response(req, body, model))

    def error(self, exc: RequestError) -> dict[str, Any]:
        """OpenAI's error body, the chat request's field names put back as this API names them
        (``max_tokens`` -> ``max_output_tokens``, ``messages`` -> ``input``)."""
        body = exc.body()
        if exc.param in RENAMED:
            new = RENAMED[exc.param]
            body["error"]["param"] = new
            body["error"]["message"] = body["error"]["message"].replace(f"{exc.param}=", f"{new}=").replace(
                f"{exc.param} must", f"{new} must")
        return body


def chat_body(body: Any) -> dict[str, Any]:
    """The chat-completions body of a Responses request body.

    Raises:
        RequestError: an unknown, refused or malformed field (named as the Responses API names it).
    """
    check_fields(body, "/v1/responses", frozenset((*PASSED, *ACCEPTED)), NOOP, REFUSED)
    out: dict[str, Any] = {k: body[k] for k in PASSED if body.get(k) is not None}
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError(f"instructions must be a string, got {instructions!r}", "instructions")
        messages.append({"role": "system", "content": instructions})
    messages.extend(input_messages(body.get("input")))
    out["messages"] = messages
    if "tools" in out:
        out["tools"] = _tools(out["tools"])
    if "tool_choice" in out:
        out["tool_choice"] = _tool_choice(out["tool_choice"])
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    return out


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """Chat messages of a Responses ``input`` (see the module doc)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError("input must be a string or a non-empty list of input items", "input")
    out: list[dict[str, Any]] = []
    used: set[str] = set()
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an input item object, got {type(item).__name__}", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                                   f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for field in ("call_id", "name", "arguments"):
                if not isinstance(item.get(field), str):
                    raise RequestError(f"{where}.{field} must be a string (a function_call item has call_id, name and "
                                       f"arguments), got {item.get(field)!r}", f"{where}.{field}")
            used.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if item.get("call_id") not in used:
                raise RequestError(f"{where} is a function_call_output for call_id {item.get('call_id')!r}, which no "
                                   f"earlier function_call item has (known ids: {sorted(used)}); send the "
                                   "function_call item before its output", f"{where}.call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "item_reference":
            raise RequestError(f"{where} is an item_reference: this endpoint stores no items; send the item itself",
                               where)
        else:
            raise RequestError(f"{where} is a {kind!r} item; this endpoint takes message, function_call and "
                               "function_call_output items", f"{where}.type")
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text parts, got {content!r}", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}] is a {kind!r} part; this policy is text-only (input_text / output_text "
                               "parts only)", f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise RequestError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise RequestError(f"tools[{i}] must be a function tool {{'type': 'function', 'name': ..., 'parameters': "
                               f"...}}, got type {kind!r} (built-in tools are not available)", f"tools[{i}]")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> Any:
    if raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise RequestError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}, "
                       f"got {raw!r}", "tool_choice")


def output_items(answer: Answer, ids: list[str] | None = None) -> list[dict[str, Any]]:
    """The ``output`` items of choice 0: a message (text, or no tool call), then its function calls.
    ``ids``: item ids to use in order (the streamed ones), else fresh."""
    c = answer.choices[0]
    fresh = iter(ids or ())
    out = []
    if c.content or not c.tool_calls:
        out.append(_message_item(next(fresh, None) or f"msg_{uuid.uuid4().hex}", c.content or "", _status(answer)))
    for call in c.tool_calls:
        out.append(_call_item(next(fresh, None) or f"fc_{uuid.uuid4().hex}", call, call["function"]["arguments"]))
    return out


def _status(answer: Answer) -> str:
    """The status of the answer's message item: "incomplete" when its token limit cut it."""
    return "incomplete" if answer.choices[0].finish_reason == "length" else "completed"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call: dict[str, Any], arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": arguments, "status": status}


class _Response:
    """The ``response`` object of one request: ids, echoed parameters, status and usage."""

    def __init__(self, req: ChatRequest, body: dict[str, Any], model: str) -> None:
        self.req, self.body_in, self.model = req, body, model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", now_s()

    def body(self, answer: Answer | None, output: list[dict[str, Any]], status: str | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body_in
        incomplete = answer is not None and answer.choices[0].finish_reason == "length"
        if status is None:
            status = "incomplete" if incomplete else "completed"
        usage = None if answer is None else {
            "input_tokens": answer.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": answer.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + answer.completion_tokens}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete and status == "incomplete" else None,
            "instructions": b.get("instructions"), "metadata": b.get("metadata") or {},
            "parallel_tool_calls": self.req.parallel_tool_calls, "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [], "temperature": self.req.temperature, "top_p": self.req.top_p,
            "max_output_tokens": self.req.max_tokens, "previous_response_id": None, "store": False,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage,
        }


class ResponsesStreamWriter:
    """The Responses API's stream events of one answer (see the module doc), each with its
    ``sequence_number``."""

    def __init__(self, response: _Response) -> None:
        self.response = response
        self.seq = 0
        self.message_id: str | None = None
        self.sent = ""

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(kind, body)

    def start(self, prompt_tokens: int | None = None) -> list[str]:
        """``response.created`` and ``response.in_progress`` with an empty, in-progress response."""
        snapshot = self.response.body(None, [], status="in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def text(self, index: int, delta: str) -> list[str]:
        """``delta`` as ``response.output_text.delta`` (adding the message item and its text part
        first); choice ``index`` is always 0."""
        out = []
        if self.message_id is None:
            self.message_id = f"msg_{uuid.uuid4().hex}"
            out.append(self._event("response.output_item.added", output_index=0,
                                   item=_message_item(self.message_id, "", "in_progress")))
            out.append(self._event("response.content_part.added", item_id=self.message_id, output_index=0,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self.sent += delta
        out.append(self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                               content_index=0, delta=delta, logprobs=[]))
        return out

    def finish(self, answer: Answer, rests: list[str]) -> list[str]:
        """The unsent text, the message item's ``done`` events, one function-call item per call, then
        ``response.completed`` (``response.incomplete`` when the answer was cut short)."""
        c = answer.choices[0]
        out = []
        if rests[0] or (self.message_id is None and not c.tool_calls):
            out.extend(self.text(0, rests[0]) if rests[0] else self._open_empty())
        ids = [self.message_id] if self.message_id is not None else []
        if self.message_id is not None:
            part = {"type": "output_text", "text": self.sent, "annotations": [], "logprobs": []}
            out.append(self._event("response.output_text.done", item_id=self.message_id, output_index=0,
                                   content_index=0, text=self.sent, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=self.message_id, output_index=0,
                                   content_index=0, part=part))
            out.append(self._event("response.output_item.done", output_index=0,
                                   item=_message_item(self.message_id, self.sent, _status(answer))))
        for call in c.tool_calls:
            index, item_id, args = len(ids), f"fc_{uuid.uuid4().hex}", call["function"]["arguments"]
            ids.append(item_id)
            out.append(self._event("response.output_item.added", output_index=index,
                                   item=_call_item(item_id, call, "", "in_progress")))
            out.append(self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                   delta=args))
            out.append(self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                   arguments=args, name=call["function"]["name"]))
            out.append(self._event("response.output_item.done", output_index=index, item=_call_item(item_id, call, args)))
        final = self.response.body(answer, output_items(answer, ids))
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + [self._event(kind, response=final)]

    def _open_empty(self) -> list[str]:
        """Open the message item of a reply with no text and no tool call."""
        self.message_id = f"msg_{uuid.uuid4().hex}"
        return [self._event("response.output_item.added", output_index=0,
                            item=_message_item(self.message_id, "", "in_progress")),
                self._event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]

    def fail(self, error: RequestError) -> list[str]:
        """``response.failed`` with a ``server_error`` naming ``error``."""
        failed = self.response.body(None, [], status="failed", error={"code": "server_error", "message": str(error)})
        return [self._event("response.failed", response=failed)]
