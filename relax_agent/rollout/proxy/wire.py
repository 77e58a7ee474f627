"""What the endpoint's server needs of one wire API (OpenAI chat completions, OpenAI Responses,
Anthropic Messages): each translates its request body to the one internal
:class:`~relax_agent.rollout.proxy.openai_api.ChatRequest` and an
:class:`~relax_agent.rollout.proxy.openai_api.Answer` back to its own response, stream events and
error bodies. The session (token-in/token-out records, chains, budgets, seeds) never sees which
API a request came in by.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from relax_agent.rollout.proxy.openai_api import Answer, ChatRequest, RequestError


class StreamWriter(Protocol):
    """The server-sent events of one streamed answer, in order: :meth:`start`, :meth:`text` per
    content delta, then :meth:`finish` (or :meth:`fail`)."""

    def start(self, prompt_tokens: int | None) -> list[str]:
        """Events sent before anything is sampled (``prompt_tokens``: the prompt's length, None when
        not known yet: a retry answered from the record)."""

    def text(self, index: int, delta: str) -> list[str]:
        """Events carrying ``delta``, new content of choice ``index``."""

    def finish(self, answer: Answer, rests: list[str]) -> list[str]:
        """The closing events: ``rests[i]`` is the content of choice ``i`` not sent yet, then its
        tool calls, finish reason and usage."""

    def fail(self, error: RequestError) -> list[str]:
        """The event telling the client the answer failed after the stream had started."""


class WireApi(Protocol):
    """One wire API served on ``path``."""

    path: str

    def api_key(self, headers: Mapping[str, str]) -> str:
        """The key the request authenticates with ("" when none)."""

    def parse(self, body: Any) -> ChatRequest:
        """The internal chat request of a decoded JSON body.

        Raises:
            RequestError: the body is not a valid request of this API (names the field).
        """

    def response(self, answer: Answer, req: ChatRequest, body: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed response body (``body``: the request as sent)."""

    def writer(self, req: ChatRequest, body: dict[str, Any], model: str) -> StreamWriter:
        """The event writer of one streamed answer."""

    def error(self, exc: RequestError) -> dict[str, Any]:
        """The error body of ``exc`` (its HTTP status is ``exc.status``)."""


def bearer(headers: Mapping[str, str]) -> str:
    """The key of an ``Authorization: Bearer <key>`` header ("" when none)."""
    return (headers.get("authorization") or "").removeprefix("Bearer ").strip()


def sse_event(event: str, body: dict[str, Any]) -> str:
    """One named server-sent event (``event:`` line, then its JSON ``data:``)."""
    return f"event: {event}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def check_fields(body: Any, route: str, supported: frozenset[str], noop: Mapping[str, tuple[Any, ...]],
                 refused: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``body`` as a dict whose every field this endpoint can honour; returns it.

    ``supported``: fields translated; ``noop``: fields accepted only at the listed values (they change
    nothing; the last is the one to send); ``refused``: fields refused whatever their value (but None),
    with the reason.

    Raises:
        RequestError: not a JSON object, or a field outside the above (named, with what to do).
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    refused = refused or {}
    for key, value in body.items():
        if key in refused and value is not None:
            raise RequestError(f"{key} is not supported: {refused[key]}", key)
        if key in noop and value not in noop[key]:
            raise RequestError(f"{key}={value!r} is not supported by this endpoint (the policy is sampled as it "
                               f"is); omit it or send {noop[key][-1]!r}", key)
        if key not in supported and key not in noop and key not in refused:
            raise RequestError(f"{key} is not supported by {route}; supported fields: "
                               f"{', '.join(sorted(supported))}", key)
    return body
