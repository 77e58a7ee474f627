"""The OpenAI chat-completions wire format: request validation and response / chunk bodies.

:func:`parse_chat_request` turns a request body into a :class:`ChatRequest` or raises
:class:`RequestError` (HTTP 400, OpenAI error body, ``param`` naming the field). Every field of
the body is either used or refused: a field the endpoint cannot honour is never dropped
silently. A ``tool`` message must answer a tool call of an earlier assistant message by its id. Fields accepted only at their no-op value (``presence_penalty: 0``...) are listed in
:data:`NOOP_FIELDS`; documented hints that change neither what is sampled nor what is returned
(``prompt_cache_key``...) in :data:`HINT_FIELDS`, accepted at any value and ignored.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from relax_agent.errors import DataError

MAX_CHOICES = 64
"""Most choices (``n``) one request may ask for."""

SUPPORTED_FIELDS = frozenset({
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "stop", "seed", "logprobs", "top_logprobs", "n", "stream", "stream_options", "user",
    "metadata", "store",
})
NOOP_FIELDS: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": ({}, None),
    "response_format": ({"type": "text"}, None),
}
"""Fields accepted only at these values (they change nothing); any other value is refused."""
HINT_FIELDS = frozenset({"prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
                         "service_tier"})
"""OpenAI's documented hints (prompt caching, abuse detection, the processing tier), accepted at any value and
ignored: they change neither the sampling nor the response."""

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class RequestError(DataError):
    """A request the endpoint refuses: ``str()`` is the message, ``param`` the field, ``status`` the HTTP code.

    Args:
        message: what is wrong and what was expected.
        param: the request field (``"messages[2].content"``), or None.
        status: HTTP status (400 bad request, 401 bad key, 404 unknown path, 405 wrong method, 413 body
            too large, 500 a reply that cannot satisfy ``tool_choice``).
        code: OpenAI error code (``"context_length_exceeded"``), or None.
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message, param, status, code)
        self.param, self.status, self.code = param, status, code

    def __str__(self) -> str:
        return str(self.args[0])

    def body(self) -> dict[str, Any]:
        """The OpenAI error body."""
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: "auto", "none", "required" or "function" (then ``name`` is the function to call)."""

    mode: str = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat-completions request.

    Attributes:
        messages: OpenAI-format messages as sent ("developer" read as "system").
        tools: function tools as sent (``{"type": "function", "function": {...}}``).
        tool_choice: see :class:`ToolChoice`.
        parallel_tool_calls: False: at most one tool call per reply.
        temperature / top_p: None when the request did not set them.
        max_tokens: most new tokens (``max_completion_tokens`` or ``max_tokens``); None: the run's.
        stop: stop strings (not part of the returned text).
        seed: sampling seed; None: one per episode turn.
        logprobs: return each sampled token's log-prob.
        n: choices to sample.
        stream: answer with server-sent events as tokens are sampled.
        include_usage: streaming: send a last chunk with token usage.
        model: the model the request named.
        prefill: text the reply starts with (an Anthropic final assistant turn): sent to the policy
            after the generation prompt as context, continued by it; "" for none.
    """

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    prefill: str = ""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"{key} must be a number, got {v!r}", key)
    if v > hi or v < lo or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise RequestError(f"{key}={v} must be in {bound}", key)
    return float(v)


def _int(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        expected = f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")
        raise RequestError(f"{key} must be {expected}, got {v!r}", key)
    return v


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be true or false, got {v!r}", key)
    return v


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body.

    Raises:
        RequestError: an unknown or unsupported field, a wrong type or value (names the field).
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    for key in body:
        if key in SUPPORTED_FIELDS or key in HINT_FIELDS:
            continue
        if key in NOOP_FIELDS:
            if body[key] not in NOOP_FIELDS[key]:
                raise RequestError(f"{key}={body[key]!r} is not supported by this endpoint (the policy is sampled "
                                   f"as it is); omit it or send {NOOP_FIELDS[key][0]!r}", key)
            continue
        raise RequestError(f"{key} is not supported by this endpoint; supported fields: "
                           f"{', '.join(sorted(SUPPORTED_FIELDS))}", key)
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    top = _int(body, "top_logprobs", 0, 20)
    if top:
        raise RequestError(f"top_logprobs={top} is not supported: the engine returns only the sampled token's "
                           "log-prob; use logprobs=true with top_logprobs 0 or omitted", "top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", 1)
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature == 0.0:
        raise RequestError("temperature=0 (greedy decoding) is not supported: RL samples the policy; omit "
                           "temperature (the run's rollout.temperature is used) or set it > 0", "temperature")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise RequestError(f"stream_options supports only include_usage, got {stream_options!r}", "stream_options")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -2**63 <= seed < 2**64):
        raise RequestError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}", "seed")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise RequestError(f"model must be a string, got {model!r}", "model")
    return ChatRequest(
        messages=messages, tools=tools, tool_choice=_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True), temperature=temperature,
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True), max_tokens=max_tokens, stop=_stop(body.get("stop")),
        seed=seed, logprobs=_bool(body, "logprobs", False), n=_int(body, "n", 1, MAX_CHOICES) or 1,
        stream=_bool(body, "stream", False), include_usage=bool(stream_options.get("include_usage", False)),
        model=model,
    )


def _messages(raw: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list of chat messages", "messages")
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise RequestError(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", f"{where}.role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"{where}.content must be a string or a list of content parts", f"{where}.content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise RequestError(f"{where}.content[{j}] is a {kind!r} part; this policy is text-only "
                                       "(text parts only)", f"{where}.content[{j}]")
        if m.get("function_call") is not None:
            raise RequestError(f"{where}.function_call (the legacy functions API) is not supported; use tool_calls",
                               f"{where}.function_call")
        for k, call in enumerate(m.get("tool_calls") or ()):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"{where}.tool_calls[{k}] must be {{'type': 'function', 'function': "
                                   "{'name': ..., 'arguments': ...}}", f"{where}.tool_calls[{k}]")
        call_ids.update(c.get("id") for c in m.get("tool_calls") or () if isinstance(c.get("id"), str))
        if m["role"] == "tool" and m.get("tool_call_id") not in call_ids:
            raise RequestError(f"{where} is a tool result for tool_call_id {m.get('tool_call_id')!r}, which no earlier "
                               f"assistant message's tool_calls has (known ids: {sorted(call_ids)}); a tool message must "
                               "answer a preceding tool call by its id", f"{where}.tool_call_id")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({**m, "role": role})
    return tuple(out)


def _tools(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RequestError("tools must be a list", "tools")
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}",
                               f"tools[{i}]")
    return tuple(raw)


def _tool_choice(raw: Any, tools: tuple[dict[str, Any], ...]) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto")
    if raw in ("auto", "none", "required"):
        if raw == "required" and not tools:
            raise RequestError("tool_choice='required' needs tools", "tool_choice")
        return ToolChoice(raw)
    name = raw.get("function", {}).get("name") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(name, str):
        raise RequestError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                           f"{{'name': ...}}}}, got {raw!r}", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise RequestError(f"tool_choice names function {name!r}, which is not in tools {names}", "tool_choice")
    return ToolChoice("function", name)


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of at most 4, got {raw!r}", "stop")
    return tuple(stops)


# -- response bodies ------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """One sampled answer as the endpoint returns it.

    Attributes:
        content: the text the agent sees (None for a reply that is only tool calls).
        tool_calls: OpenAI tool calls (``arguments`` a JSON string).
        finish_reason: "stop", "length" or "tool_calls".
        tokens / logprobs: [n] the sampled tokens' text and log-probs (``logprobs: true``).
        token_bytes: [n] each token's raw bytes (a token may hold part of a UTF-8 character);
            empty: the UTF-8 of ``tokens``.
        stop_string: the request's stop string that ended the reply (None: it ended otherwise).
    """

    content: str | None
    tool_calls: tuple[dict[str, Any], ...]
    finish_reason: str
    tokens: tuple[str, ...] = ()
    logprobs: tuple[float, ...] = ()
    token_bytes: tuple[bytes, ...] = ()
    stop_string: str | None = None

    def message(self) -> dict[str, Any]:
        """The choice as a chat ``assistant`` message (with ``tool_calls`` when it made calls)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [dict(c) for c in self.tool_calls]
        return msg

    def logprobs_body(self) -> dict[str, Any]:
        """The choice's ``logprobs`` object: per sampled token its text, log-prob and bytes (no top
        log-probs)."""
        raw = self.token_bytes or tuple(t.encode() for t in self.tokens)
        return {"content": [{"token": t, "logprob": lp, "bytes": list(b), "top_logprobs": []}
                            for t, lp, b in zip(self.tokens, self.logprobs, raw, strict=True)], "refusal": None}


@dataclass(frozen=True)
class Answer:
    """All choices of one request plus its token usage."""

    id: str
    model: str
    choices: tuple[Choice, ...]
    prompt_tokens: int
    completion_tokens: int
    logprobs: bool
    created: int = 0

    def usage(self) -> dict[str, int]:
        """The ``usage`` object: prompt, completion and total tokens."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def completion(self) -> dict[str, Any]:
        """The ``chat.completion`` body."""
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": i, "message": c.message(), "finish_reason": c.finish_reason,
                         "logprobs": c.logprobs_body() if self.logprobs else None} for i, c in enumerate(self.choices)],
            "usage": self.usage(),
        }


def chunk(answer_id: str, model: str, created: int, index: int, delta: dict[str, Any],
          finish_reason: str | None = None, logprobs: dict[str, Any] | None = None) -> str:
    """One ``chat.completion.chunk`` server-sent event."""
    body = {"id": answer_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}
    return sse(body)


def final_chunks(answer: Answer, index: int) -> list[str]:
    """The events that end choice ``index`` of a stream: its tool-call deltas, then its finish reason
    (with its log-probs when asked for)."""
    c = answer.choices[index]
    out = []
    for j, call in enumerate(c.tool_calls):
        head = {"index": j, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}
        out.append(chunk(answer.id, answer.model, answer.created, index, {"tool_calls": [head]}))
        args = {"index": j, "function": {"arguments": call["function"]["arguments"]}}
        out.append(chunk(answer.id, answer.model, answer.created, index, {"tool_calls": [args]}))
    out.append(chunk(answer.id, answer.model, answer.created, index, {}, c.finish_reason,
                     c.logprobs_body() if answer.logprobs else None))
    return out


def usage_chunk(answer: Answer) -> str:
    """The closing ``chat.completion.chunk`` that carries only ``usage`` (``stream_options.include_usage``)."""
    return sse({"id": answer.id, "object": "chat.completion.chunk", "created": answer.created, "model": answer.model,
                "choices": [], "usage": answer.usage()})


def sse(body: dict[str, Any]) -> str:
    """``body`` as one server-sent event (``data: <json>`` and a blank line)."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def now_s() -> int:
    """The current Unix time in whole seconds (the ``created`` field)."""
    return int(time.time())


# -- the wire API -----------------------------------------------------------------------------


class ChatCompletionsApi:
    """``POST /v1/chat/completions`` (see :class:`~relax_agent.rollout.proxy.wire.WireApi`): the body is
    the internal request itself; ``Authorization: Bearer <key>``."""

    path = "/v1/chat/completions"

    def api_key(self, headers: Any) -> str:
        """The ``Authorization: Bearer`` key ("" when none)."""
        return (headers.get("authorization") or "").removeprefix("Bearer ").strip()

    def parse(self, body: Any) -> ChatRequest:
        """The internal chat request of a Chat Completions body (already in that shape)."""
        return parse_chat_request(body)

    def response(self, answer: Answer, req: ChatRequest, body: dict[str, Any]) -> dict[str, Any]:
        """The ``chat.completion`` object of ``answer``."""
        return answer.completion()

    def writer(self, req: ChatRequest, body: dict[str, Any], model: str) -> ChatStreamWriter:
        """A :class:`ChatStreamWriter` for ``req`` and ``model``."""
        return ChatStreamWriter(req, model)

    def error(self, exc: RequestError) -> dict[str, Any]:
        """OpenAI's error body of ``exc``."""
        return exc.body()


class ChatStreamWriter:
    """``chat.completion.chunk`` events: a role chunk per choice, content deltas, then per choice its
    tool-call deltas and finish reason (log-probs in its last chunk), the usage chunk when asked
    for, and ``data: [DONE]``."""

    def __init__(self, req: ChatRequest, model: str) -> None:
        import uuid

        self.req, self.model = req, model
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", now_s()

    def start(self, prompt_tokens: int | None = None) -> list[str]:
        """One chunk per choice opening its ``assistant`` message."""
        return [chunk(self.id, self.model, self.created, i, {"role": "assistant", "content": ""})
                for i in range(self.req.n)]

    def text(self, index: int, delta: str) -> list[str]:
        """One chunk carrying ``delta`` for choice ``index``."""
        return [chunk(self.id, self.model, self.created, index, {"content": delta})]

    def finish(self, answer: Answer, rests: list[str]) -> list[str]:
        """Per choice its unsent text and final chunks (tool calls, finish reason), the usage chunk when
        asked for, then ``data: [DONE]``."""
        import dataclasses

        answer = dataclasses.replace(answer, id=self.id, model=self.model, created=self.created)
        out = []
        for i, rest in enumerate(rests):
            if rest:
                out.extend(self.text(i, rest))
            out.extend(final_chunks(answer, i))
        if self.req.include_usage:
            out.append(usage_chunk(answer))
        return out + [SSE_DONE]

    def fail(self, error: RequestError) -> list[str]:
        """One event with OpenAI's error body."""
        return [sse(error.body())]
