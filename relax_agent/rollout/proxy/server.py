"""The OpenAI-compatible endpoint agents call: FastAPI on 127.0.0.1, in a thread of the rollout service.

Routes: ``POST /v1/chat/completions``, ``POST /v1/responses`` (OpenAI Responses,
:mod:`~relax_agent.rollout.proxy.responses_api`) and ``POST /v1/messages`` (Anthropic Messages,
:mod:`~relax_agent.rollout.proxy.messages_api`), each JSON or, with ``stream: true``, server-sent
events as tokens are sampled; ``POST /v1/messages/count_tokens`` (the prompt's length, nothing
sampled); ``GET /v1/models``, ``GET /v1/models/{model}``. Every POST route is
one :class:`~relax_agent.rollout.proxy.wire.WireApi` translating to the same internal chat request,
so recording, chains, budgets and seeds are the same whichever API an agent speaks. Each
episode's agent authenticates with its own key (``Authorization: Bearer <key>``; on
``/v1/messages`` also ``x-api-key``), which selects its
:class:`~relax_agent.rollout.proxy.session.AgentSession`; an unknown or ended key gets 401.
Every error status comes with the API's error body (OpenAI's ``{"error": {"message", "type",
"param", "code"}}``, Anthropic's ``{"type": "error", "error": {"type", "message"}}``): refused
requests (400, naming the field), a body over ``max_request_bytes`` (413, checked before
anything is parsed), unknown paths (404) and methods (405).

Delivery: when the agent has hung up before its (non-streamed) answer is ready, or a stream is
closed before its end, the session is told the reply was not delivered (an abandoned request is
never the trained chain, see :meth:`AgentSession.final_reply`); a stream closed while its reply
is still sampled aborts that generation (nothing of it is recorded), and so does a non-streamed
request whose client hung up, ``hangup_grace_s`` later, unless an SDK retry of it waits for the
same answer by then (:class:`~relax_agent.rollout.proxy.inflight.HangUps`). An
``Idempotency-Key`` replays its answer to the same body and gets 422 with another
(:class:`~relax_agent.rollout.proxy.inflight.IdempotencyKeys`).

Isolation: a body whose text cannot fit the episode's token budget is refused before it is
tokenized (:func:`~relax_agent.rollout.proxy.admission.check_fits`); parsing, rendering and
tokenizing run on worker threads, large bodies on a bounded pool of their own
(:mod:`~relax_agent.rollout.proxy.workers`). A ``max_tokens`` lowered to the
episode's budget is announced in the ``x-relax-max-tokens`` header.

The server runs uvicorn on its own event loop in a daemon thread, so it outlives any one
``asyncio.run`` of the control loop; the engine's calls are made from that loop (the HF engine
delivers to whichever loop awaits it). :meth:`EndpointServer.call` runs a coroutine there.

Streaming: content deltas are sent as the reply's text grows, held back where it could still be
part of a tool call or a stop string (:class:`~relax_agent.rollout.proxy.streaming.ContentStreamer`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import json
import os
import socket
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from relax_agent.errors import EngineError
from relax_agent.rollout.proxy.admission import check_fits
from relax_agent.rollout.proxy.inflight import HangUps, IdempotencyKeys
from relax_agent.rollout.proxy.messages_api import THREAD_UNSUPPORTED, MessagesApi
from relax_agent.rollout.proxy.openai_api import Answer, ChatCompletionsApi, ChatRequest, RequestError
from relax_agent.rollout.proxy.session import AgentSession
from relax_agent.rollout.proxy.streaming import ContentStreamer
from relax_agent.rollout.proxy.wire import StreamWriter, WireApi, bearer
from relax_agent.rollout.proxy.workers import ByteBudget, RequestWorkers, sized

T = TypeVar("T")

_START_TIMEOUT_S = 30.0


class EndpointServer:
    """Serves the sessions of one rollout driver on ``http://127.0.0.1:{port}/v1``.

    Args:
        port: TCP port on 127.0.0.1; 0 picks a free one.
        model_name: the model id ``/v1/models`` lists.
        max_request_bytes: largest request body read; larger ones get 413.
        large_request_bytes: bodies over this size are parsed, rendered and tokenized on a pool of
            ``large_workers`` threads of their own (see :mod:`~relax_agent.rollout.proxy.workers`).
        large_workers: threads for large requests.
        large_request_bytes_per_s: how fast large bodies are let in, together: a large request
            waits its turn before its body is read (see :class:`~relax_agent.rollout.proxy.workers.ByteBudget`).
        hangup_grace_s: seconds a non-streamed request whose client hung up keeps sampling for the
            SDK's retry to come back before it is aborted (see :class:`~relax_agent.rollout.proxy.inflight.HangUps`).
        unix_path: also serve on a Unix socket at this path (mode 0666; jailed agents reach the
            endpoint through it, see :mod:`~relax_agent.rollout.agent_jail`); None: TCP only.

    Attributes:
        base_url: ``http://127.0.0.1:{port}/v1`` (what agents get as ``OPENAI_BASE_URL``).
        root_url: ``http://127.0.0.1:{port}`` (what agents get as ``ANTHROPIC_BASE_URL``: the
            ``anthropic`` SDK adds ``/v1/messages`` itself).
    """

    def __init__(self, port: int = 0, model_name: str = "policy", max_request_bytes: int = 4 * 1024 * 1024,
                 large_request_bytes: int = 256 * 1024, large_workers: int = 2,
                 large_request_bytes_per_s: float = 8 * 1024 * 1024, hangup_grace_s: float = 10.0,
                 unix_path: str | None = None) -> None:
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.workers = RequestWorkers(large_request_bytes, large_workers)
        self.large_budget = ByteBudget(large_request_bytes_per_s)
        self.idempotency = IdempotencyKeys()
        self.hang_ups = HangUps(hangup_grace_s)
        self.refused: collections.deque[tuple[str, str]] = collections.deque(maxlen=256)
        """(API key as sent, message) of the latest refused requests (4xx), for ``relax-agent agent check``."""
        self.sessions: dict[str, AgentSession] = {}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(("127.0.0.1", port))
        except OSError as exc:
            self._sock.close()
            from relax_agent.errors import ConfigError

            raise ConfigError(f"rollout.agent.port={port}: cannot listen on 127.0.0.1:{port} ({exc}); "
                              "choose a free port or 0") from exc
        self.port = self._sock.getsockname()[1]
        self._sockets = [self._sock]
        if unix_path is not None:
            self._sockets.append(_unix_listener(unix_path))
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.root_url}/v1"
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> EndpointServer:
        """Start serving (returns once the socket accepts requests). Idempotent."""
        if self._thread is not None:
            return self
        import uvicorn

        config = uvicorn.Config(build_app(self), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        ready = threading.Event()
        self.loop = loop = asyncio.new_event_loop()
        loop.set_default_executor(self.workers)

        def serve() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_until_complete(self._server.serve(sockets=self._sockets))

        self._thread = threading.Thread(target=serve, name="agent-endpoint", daemon=True)
        self._thread.start()
        ready.wait(_START_TIMEOUT_S)
        self.call_sync(_until_started(self._server), _START_TIMEOUT_S)
        return self

    def close(self) -> None:
        """End every session (aborting their generations) and stop the server. Idempotent."""
        if self._thread is None:
            for sock in self._sockets:
                sock.close()
            return
        try:
            self.call_sync(self._close_sessions(), 30.0)
        except Exception:  # closing must not fail on a session that already broke
            pass
        self._server.should_exit = True
        self._thread.join(30.0)
        self._thread = None
        for sock in self._sockets:
            sock.close()
        self.workers.shutdown(wait=False, cancel_futures=True)

    async def _close_sessions(self) -> None:
        sessions, self.sessions = list(self.sessions.values()), {}
        await asyncio.gather(*(s.aclose() for s in sessions), return_exceptions=True)

    def call_sync(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the server's loop from another thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._started_loop()).result(timeout_s)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` run on the server's loop (from any other loop)."""
        fut: concurrent.futures.Future = asyncio.run_coroutine_threadsafe(coro, self._started_loop())
        return await asyncio.wrap_future(fut)

    def _started_loop(self) -> asyncio.AbstractEventLoop:
        """The server's loop; RuntimeError before :meth:`start`."""
        if self.loop is None:
            raise RuntimeError("the endpoint server is not started (call start() first)")
        return self.loop

    # -- sessions -------------------------------------------------------------------------
    def open(self, session: AgentSession) -> None:
        """Accept requests with ``session.key`` from now on."""
        self.sessions[session.key] = session

    async def end(self, session: AgentSession) -> None:
        """Revoke the session's key and abort its running generations (on the server's loop)."""
        async def end_here() -> None:
            self.sessions.pop(session.key, None)
            self.idempotency.forget(session.key)
            await session.aclose()

        await self.call(end_here())

    def session_of(self, key: str) -> AgentSession:
        """The open session of API key ``key``.

        Raises:
            RequestError: 401, no open session has that key.
        """
        session = self.sessions.get(key)
        if session is None:
            raise RequestError("unknown API key: each episode's agent must use the OPENAI_API_KEY it was started "
                               "with, while its episode runs", status=401, code="invalid_api_key")
        return session


def _unix_listener(path: str) -> socket.socket:
    """A stream socket bound at ``path`` that any user may connect to."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o666)
    return sock


async def _until_started(server: Any) -> None:
    while not server.started:
        await asyncio.sleep(0.01)


def _error(exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers=headers)


async def _read_body(request: Request, endpoint: EndpointServer) -> bytes:
    """The request body, refused with 413 past ``max_request_bytes`` (by its Content-Length before
    reading, else as it arrives). A large body (over ``large_request_bytes``) waits for its turn in
    the endpoint's byte budget before it is read (a chunked one, with no length, after)."""
    limit = endpoint.max_request_bytes
    too_big = RequestError(f"the request body is larger than this endpoint's limit of {limit} bytes "
                           "(rollout.agent.max_request_bytes); send less history or raise the limit",
                           status=413, code="request_too_large")
    length = request.headers.get("content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    if declared is not None and declared > limit:
        raise too_big
    if declared is not None and declared > endpoint.workers.large_request_bytes:
        await asyncio.sleep(endpoint.large_budget.reserve(declared))
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_big
        parts.append(part)
    if declared is None and size > endpoint.workers.large_request_bytes:
        endpoint.large_budget.reserve(size)  # read already: the next large request pays for it
    return b"".join(parts)


def build_app(endpoint: EndpointServer) -> Any:
    """The FastAPI app of ``endpoint``."""
    app = FastAPI(title="relax-agent policy endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"unknown path {request.url.path}: this endpoint serves /v1/chat/completions, /v1/responses, "
                        "/v1/messages and /v1/models",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        error = RequestError(message, status=exc.status_code, code=code)
        api = next((a for a in apis() if request.url.path.startswith(a.path)), ChatCompletionsApi())
        return JSONResponse(api.error(error), error.status, headers=dict(exc.headers or {}))

    def model_card(model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 0, "owned_by": "relax-agent"}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        try:
            endpoint.session_of(bearer(request.headers) or request.headers.get("x-api-key", "").strip())
        except RequestError as exc:
            return _error(exc)
        return {"object": "list", "data": [model_card(endpoint.model_name)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> Any:
        """Any model id: the policy answers requests naming any model."""
        try:
            endpoint.session_of(bearer(request.headers) or request.headers.get("x-api-key", "").strip())
        except RequestError as exc:
            return _error(exc)
        return model_card(model)

    app.post("/v1/messages/count_tokens")(_count_route(endpoint, MessagesApi()))
    for api in apis():
        app.post(api.path)(_route(endpoint, api))
    return app


def apis() -> list[WireApi]:
    """The wire APIs served: chat completions, Responses, Anthropic Messages."""
    from relax_agent.rollout.proxy.responses_api import ResponsesApi

    return [ChatCompletionsApi(), ResponsesApi(), MessagesApi()]


def _route(endpoint: EndpointServer, api: WireApi) -> Any:
    """The handler of ``api``'s path: authenticate, read and translate the body (off the shared loop),
    answer through the session, reply in ``api``'s format."""

    async def handle(request: Request) -> Any:
        notes: dict[str, str] = {}
        key = api.api_key(request.headers)
        idem = request.headers.get("idempotency-key") or None
        claimed = accepted = False
        try:
            session = endpoint.session_of(key)
            req, body, body_hash = await _read_request(endpoint, api, request, session)
            body_key = f"idem:{idem}" if idem else body_hash
            claimed = idem is not None and endpoint.idempotency.claim(key, idem, body_hash)
            replay = idem is not None or _retry_count(request.headers.get("x-stainless-retry-count")) > 0
            if req.stream:
                writer = api.writer(req, body, req.model or session.model_name)
                events = await _start_stream(session, req, writer, body_key, replay, notes)
                return StreamingResponse(events, media_type="text/event-stream", headers=notes)
            fut = await session.submit(req, body_key, replay, notes=notes)
            accepted = True
            answer = await endpoint.hang_ups.wait(request.receive, session, body_key, fut)
        except RequestError as exc:
            if claimed and not accepted:
                endpoint.idempotency.release(key, idem or "")
            if exc.status < 500 and exc.code != THREAD_UNSUPPORTED:  # the SDK's fallback is no refusal
                endpoint.refused.append((key, f"{exc.status}: {exc}"))
            return JSONResponse(api.error(exc), exc.status)
        except EngineError as exc:
            return JSONResponse(api.error(RequestError(f"the policy engine failed: {exc}", status=500)), 500)
        except asyncio.CancelledError:
            if session.closed:
                return JSONResponse(api.error(RequestError("the episode ended while this request was answered",
                                                           status=503)), 503)
            raise
        if answer is None:  # the client hung up: nobody reads this
            return Response(status_code=499)
        session.delivered(answer.id, not await request.is_disconnected())
        return JSONResponse(api.response(answer, req, body), headers=notes)

    handle.__name__ = f"post_{api.path.strip('/').replace('/', '_')}"
    return handle


def _count_route(endpoint: EndpointServer, api: MessagesApi) -> Any:
    """The handler of ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the length of the
    prompt ``/v1/messages`` would sample from for the same body (nothing is sampled or recorded)."""

    async def count_tokens(request: Request) -> Any:
        try:
            session = endpoint.session_of(api.api_key(request.headers))
            raw = await _read_body(request, endpoint)
            sized(len(raw))
            req = await asyncio.to_thread(lambda: api.parse_count(_json(raw)))
            return {"input_tokens": await asyncio.to_thread(session.prompt_tokens, req)}
        except RequestError as exc:
            return JSONResponse(api.error(exc), exc.status)

    return count_tokens


async def _read_request(endpoint: EndpointServer, api: WireApi, request: Request,
                        session: AgentSession) -> tuple[ChatRequest, dict[str, Any], str]:
    """Read, parse and translate a request body (on the worker pool its size calls for); refuse one
    whose text cannot fit the episode's token budget before anything is tokenized.

    Raises:
        RequestError: 413 past ``max_request_bytes``; 400 a body that is not a valid request or
            cannot fit the budget.
    """
    raw = await _read_body(request, endpoint)
    sized(len(raw))
    return await asyncio.to_thread(_parse_body, api, raw, session)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from exc


def _parse_body(api: WireApi, raw: bytes, session: AgentSession) -> tuple[ChatRequest, dict[str, Any], str]:
    """The translated request, the body as sent and its hash (with the API's path); a request that
    cannot fit the session's token budget is refused before it is hashed (and tokenized)."""
    body = _json(raw)
    req = api.parse(body)
    check_fits(req, session.renderer.tokenizer, session.spec.max_total_tokens)
    return req, body, hashlib.sha256(json.dumps([api.path, body], sort_keys=True).encode()).hexdigest()


def _retry_count(header: str | None) -> int:
    try:
        return int(header) if header else 0
    except ValueError:
        return 0


async def _start_stream(session: AgentSession, req: ChatRequest, writer: StreamWriter, body_key: str, replay: bool,
                        notes: dict[str, str]) -> AsyncIterator[str]:
    """Submit a streamed request and return its server-sent events. The request is submitted before
    the response starts, so a refused one still gets a plain 400."""
    queue: asyncio.Queue = asyncio.Queue()
    streamers = [ContentStreamer(session.parser, parse=bool(req.tools) and req.tool_choice.mode != "none",
                                 stops=req.stop, prefix=req.prefill) for _ in range(req.n)]

    def on_text(index: int, text: str) -> None:
        delta = streamers[index].update(text)
        if delta:
            queue.put_nowait((index, delta))

    info: dict[str, int] = {}
    fut = await session.submit(req, body_key, replay, on_text, notes, info)
    fut.add_done_callback(lambda _: queue.put_nowait(None))
    return _events(session, writer, fut, streamers, queue, body_key, info.get("prompt_tokens"))


async def _events(session: AgentSession, writer: StreamWriter, fut: asyncio.Future,
                  streamers: list[ContentStreamer], queue: asyncio.Queue, body_key: str,
                  prompt_tokens: int | None) -> AsyncIterator[str]:
    answer_id, finished = None, False
    try:
        for event in writer.start(prompt_tokens):
            yield event
        while (item := await queue.get()) is not None:
            for event in writer.text(*item):
                yield event
        if fut.cancelled() or fut.exception() is not None:
            error = "the episode ended while this request was answered" if fut.cancelled() else str(fut.exception())
            for event in writer.fail(RequestError(error, status=500)):
                yield event
            return
        answer: Answer = fut.result()
        answer_id = answer.id
        rests = [streamers[i].finish(c.content) for i, c in enumerate(answer.choices)]
        for event in writer.finish(answer, rests):
            yield event
        finished = True
    finally:  # the stream was closed before its end: the agent never got this reply
        if answer_id is None and fut.done() and not fut.cancelled() and fut.exception() is None:
            answer_id = fut.result().id
        if answer_id is not None:
            session.delivered(answer_id, finished)
        elif not fut.done():  # still sampling: abort the generation, the agent will never read it
            session.abandon(body_key)
