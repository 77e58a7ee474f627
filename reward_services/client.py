"""Client for remote reward services: makes a reward over HTTP as dependable as a local one.

One :class:`RewardClient` holds one long-lived ``httpx.AsyncClient`` (explicit timeouts,
connection limits) for one service. It

- retries with exponential backoff and jitter only on transport errors, 429 and 5xx
  (:class:`RetryPolicy`; ``Retry-After`` is honoured up to ``backoff_max_s``);
- caps requests in flight at ``max_concurrency``, and bounds each attempt in total wall time
  (``request_deadline_s``: a server that trickles its answer byte by byte cannot hold a call
  forever, though every single read beats ``request_timeout_s``);
- micro-batches concurrent ``score`` calls: a fixed set of senders takes everything queued
  when it becomes free (up to ``max_batch_items``), so a lone caller pays no extra latency
  and many callers share few requests;
- marks items whose reward could not be obtained (retries exhausted, malformed answer)
  ``status: error`` / ``timeout`` with ``reward: None`` -- never a reward of 0 -- and counts
  them in :meth:`RewardClient.metrics`;
- raises :class:`AuthError` on 401/403 (every later call would fail too), and
  :class:`RewardServiceError` on other 4xx answers (a protocol bug, not bad luck).

Call :meth:`RewardClient.check` at start-up: it hits ``/healthz`` and an authenticated no-op
so a wrong URL or token fails before the first rollout, not mid-run.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import httpx

from relax_agent.errors import AuthError, ConfigError, DataError, RewardServiceError
from relax_agent.reward_services.protocol import (
    HEALTH_PATH,
    REWARD_PATH,
    RewardItem,
    RewardRequest,
    RewardResult,
    RewardStatus,
    invalid_fields,
)

log = logging.getLogger("relax_agent.reward_services")

# Metric keys of RewardClient.metrics().
REQUESTS = "reward_client/requests"
RETRIES = "reward_client/retries"
ITEMS_SENT = "reward_client/items_sent"
ITEMS_OK = "reward_client/items_ok"
ITEMS_ERROR = "reward_client/items_error"
ITEMS_TIMEOUT = "reward_client/items_timeout"
UNEXPECTED_RESULTS = "reward_client/unexpected_results"
"""Results whose id was not asked for, or came twice (never taken: an id answered twice is an
error result, since which answer is right cannot be known)."""


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to wait before resending a request.

    Retries happen only after a transport error (connect, read, timeout), 429 or 5xx. The
    wait before retry ``n`` (0-based) is "equal jitter" backoff (Brooker, "Exponential
    Backoff And Jitter", AWS Architecture Blog, 2015): ``c/2 + uniform(0, c/2)`` with
    ``c = min(backoff_max_s, backoff_initial_s * 2**n)``, at least the server's
    ``Retry-After`` (capped at ``backoff_max_s``).

    Attributes:
        max_attempts: tries per request, first included.
        backoff_initial_s: base of the exponential backoff, seconds.
        backoff_max_s: cap of one wait, seconds.
        max_elapsed_s: no retry starts after this many seconds since the first try.
    """

    max_attempts: int = 20
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 4.0
    max_elapsed_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not (0 < self.backoff_initial_s <= self.backoff_max_s):
            raise ConfigError(f"need 0 < backoff_initial_s <= backoff_max_s, got {self.backoff_initial_s}, {self.backoff_max_s}")
        if self.max_elapsed_s < 0:
            raise ConfigError(f"max_elapsed_s must be >= 0 seconds, got {self.max_elapsed_s}")

    @staticmethod
    def retryable(status_code: int) -> bool:
        """True for 429 and every 5xx."""
        return status_code == 429 or status_code >= 500

    def delay_s(self, retry_index: int, rng: random.Random, retry_after_s: float | None = None) -> float:
        """Seconds to wait before retry ``retry_index`` (0 for the first retry)."""
        cap = min(self.backoff_max_s, self.backoff_initial_s * 2.0**retry_index)
        delay = cap / 2 + rng.uniform(0.0, cap / 2)
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, self.backoff_max_s))
        return delay


class RewardClient:
    """A :class:`RewardFunction` backed by a reward service over HTTP.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8001"`` (no path; ``/v1/reward`` is added).
        token: bearer token, or None for a service without auth.
        request_timeout_s: read/write/pool timeout of one request; keep it above the
            service's per-item timeout.
        connect_timeout_s: TCP connect timeout.
        request_deadline_s: most seconds one attempt may take in all (connect, send, and the
            whole answer); past it the attempt counts as a timeout and is retried under the
            retry policy. None: ``2 * request_timeout_s + connect_timeout_s``.
        retry: the retry policy.
        max_concurrency: requests in flight at once (also the connection-pool size).
        max_batch_items: most items in one request.
        micro_batching: merge concurrent ``score`` calls into shared requests.
        batch_wait_s: with micro-batching, how long a free sender waits for more items
            after the first; 0 sends at once (batches still form while senders are busy).
        transport: an ``httpx.AsyncBaseTransport`` to use instead of the network (tests).
        token_env: name of the variable the token came from (named in auth errors).
        seed: seed of the jitter RNG.
    """

    def __init__(self, base_url: str, *, token: str | None = None, request_timeout_s: float = 60.0,
                 connect_timeout_s: float = 5.0, request_deadline_s: float | None = None,
                 retry: RetryPolicy | None = None, max_concurrency: int = 16,
                 max_batch_items: int = 64, micro_batching: bool = True, batch_wait_s: float = 0.0,
                 transport: httpx.AsyncBaseTransport | None = None, token_env: str | None = None,
                 seed: int | None = None):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"reward service url must start with http:// or https://, got {base_url!r}")
        if max_concurrency < 1 or max_batch_items < 1:
            raise ConfigError(f"max_concurrency and max_batch_items must be >= 1, got {max_concurrency}, {max_batch_items}")
        if request_deadline_s is None:
            request_deadline_s = 2 * request_timeout_s + connect_timeout_s
        if not 0 < request_deadline_s < math.inf:
            raise ConfigError(f"request_deadline_s must be a finite number of seconds > 0, got {request_deadline_s!r}")
        self.request_deadline_s = request_deadline_s
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.max_batch_items = max_batch_items
        self._token_env = token_env
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        self._timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        self._limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._transport = transport
        self._max_concurrency = max_concurrency
        self._rng = random.Random(seed)
        self._micro_batching, self._batch_wait_s = micro_batching, batch_wait_s
        self._pool: LoopBound[_LoopState] = LoopBound(self._open_state, _LoopState.aclose)
        self._counts = dict.fromkeys((REQUESTS, RETRIES, ITEMS_SENT, ITEMS_OK, ITEMS_ERROR, ITEMS_TIMEOUT, UNEXPECTED_RESULTS), 0)

    def _open_state(self) -> _LoopState:
        http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout,
                                 limits=self._limits, transport=self._transport)
        batcher = (_MicroBatcher(self._send, self.max_batch_items, self._batch_wait_s, self._max_concurrency)
                   if self._micro_batching else None)
        return _LoopState(http, asyncio.Semaphore(self._max_concurrency), batcher)

    async def check(self) -> None:
        """Start-up check: ``/healthz`` answers ok and the token is accepted.

        Connection failures are retried under the retry policy (the service may be starting).

        Raises:
            AuthError: the service refused the token (or a token is needed and none was given).
            RewardServiceError: the service is unreachable, unhealthy, or not a v1 reward service.
        """
        resp, error = await self._request("GET", HEALTH_PATH, None, log_level=logging.WARNING)
        if resp is None or resp.status_code != 200:
            raise RewardServiceError(f"reward service at {self.base_url} is not healthy: {_describe(resp, error)}")
        resp, error = await self._request("POST", REWARD_PATH, b'{"items":[]}')
        if resp is not None and resp.status_code in (401, 403):
            raise AuthError(self._auth_message(resp))
        if resp is None or resp.status_code != 200:
            raise RewardServiceError(f"reward service at {self.base_url} failed the no-op {REWARD_PATH} call: "
                                     f"{_describe(resp, error)}; is it a relax-agent v1 reward service?")

    def _auth_message(self, resp: httpx.Response) -> str:
        where = f"the token from environment variable {self._token_env!r}" if self._token_env else (
            "the token given" if "Authorization" in self._headers else "no token (set token_env)")
        return f"reward service at {self.base_url} refused {where}: HTTP {resp.status_code} {_body_message(resp)}"

    async def score(self, items: list[RewardItem]) -> list[RewardResult]:
        """One result per item, in order; unobtainable rewards are error/timeout results.

        Raises:
            DataError: two items share an id.
            AuthError: the service refused the token.
            RewardServiceError: the service rejected the request as malformed (4xx other than 429).
        """
        _check_unique(items)
        if not items:
            return []
        state = await self._pool.get()
        if state.batcher is not None:
            return await state.batcher.submit(items)
        chunks = [items[i:i + self.max_batch_items] for i in range(0, len(items), self.max_batch_items)]
        parts = await asyncio.gather(*(self._send(c) for c in chunks))
        return [r for part in parts for r in part]

    async def _send(self, items: list[RewardItem]) -> list[RewardResult]:
        """POST one batch with retries; results in item order."""
        body = RewardRequest.model_construct(items=items).model_dump_json().encode()
        started = time.monotonic()
        resp, error = await self._request("POST", REWARD_PATH, body)
        if resp is not None and resp.status_code in (401, 403):
            raise AuthError(self._auth_message(resp))
        if resp is not None and resp.status_code != 200 and not RetryPolicy.retryable(resp.status_code):
            raise RewardServiceError(f"reward service at {self.base_url} rejected a request of {len(items)} items: "
                                     f"HTTP {resp.status_code} {_body_message(resp)}")
        if resp is not None and resp.status_code == 200:
            results = self._parse(resp, items)
        else:
            results = self._unobtained(items, resp, error, time.monotonic() - started)
        self._count(items, results)
        return results

    async def _request(self, method: str, path: str, body: bytes | None,
                       log_level: int = logging.INFO) -> tuple[httpx.Response | None, Exception | None]:
        """Send with retries: the final response (any status), or ``(None, error)`` after a
        final transport error."""
        state = await self._pool.get()
        started = time.monotonic()
        for attempt in range(self.retry.max_attempts):
            resp, error, retry_after = None, None, None
            async with state.sem:
                self._counts[REQUESTS] += 1
                try:
                    resp = await asyncio.wait_for(state.http.request(method, path, content=body), self.request_deadline_s)
                except httpx.TransportError as exc:
                    error = exc
                except httpx.RequestError as exc:  # not a transport failure (bad redirect, decoding): no retry
                    return None, exc
                except asyncio.TimeoutError:
                    error = httpx.TimeoutException(f"no complete answer within request_deadline_s={self.request_deadline_s:g}")
            if resp is not None:
                if not RetryPolicy.retryable(resp.status_code):
                    return resp, None
                retry_after = _retry_after_s(resp)
            delay = self.retry.delay_s(attempt, self._rng, retry_after)
            if attempt + 1 >= self.retry.max_attempts or time.monotonic() - started + delay > self.retry.max_elapsed_s:
                return resp, error
            self._counts[RETRIES] += 1
            log.log(log_level, "reward service %s: %s; retry %d in %.2fs (retrying for up to %gs)", self.base_url,
                    _describe(resp, error), attempt + 1, delay, self.retry.max_elapsed_s)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable: the loop returns on its last attempt")

    def _unobtained(self, items: list[RewardItem], resp: httpx.Response | None, exc: Exception | None,
                    elapsed_s: float) -> list[RewardResult]:
        timed_out = isinstance(exc, httpx.TimeoutException) or (resp is not None and resp.status_code == 504)
        status = RewardStatus.TIMEOUT if timed_out else RewardStatus.ERROR
        cause = f"reward service at {self.base_url} unavailable after {elapsed_s:.1f}s of retries: {_describe(resp, exc)}"
        log.warning("%s (%d items masked)", cause, len(items))
        return [RewardResult.failed(i.id, status, cause) for i in items]

    def _parse(self, resp: httpx.Response, items: list[RewardItem]) -> list[RewardResult]:
        """Results aligned to ``items`` by id; a missing or malformed result marks its item error."""
        try:
            raw = resp.json()["results"]
        except (ValueError, KeyError, TypeError):
            raw = None
        if not isinstance(raw, list):
            cause = f"reward service at {self.base_url} sent a body without a 'results' list: {resp.text[:200]!r}"
            return [RewardResult.failed(i.id, RewardStatus.ERROR, cause) for i in items]
        wanted = {i.id for i in items}
        by_id: dict[str, RewardResult] = {}
        twice: set[str] = set()
        for entry in raw:
            rid = entry.get("id") if isinstance(entry, dict) else None
            if not isinstance(rid, str) or rid not in wanted or rid in by_id:
                self._counts[UNEXPECTED_RESULTS] += 1
                if isinstance(rid, str) and rid in by_id:
                    twice.add(rid)
                continue
            try:
                by_id[rid] = RewardResult.model_validate(entry)
            except ValueError as exc:
                cause = f"reward service at {self.base_url} sent a malformed result: {invalid_fields(exc)}"
                by_id[rid] = RewardResult.failed(rid, RewardStatus.ERROR, cause)
        for rid in twice:
            cause = f"reward service at {self.base_url} returned more than one result for this id"
            by_id[rid] = RewardResult.failed(rid, RewardStatus.ERROR, cause)
        missing = f"reward service at {self.base_url} returned no result for this id"
        return [by_id.get(i.id) or RewardResult.failed(i.id, RewardStatus.ERROR, missing) for i in items]

    def _count(self, items: list[RewardItem], results: list[RewardResult]) -> None:
        self._counts[ITEMS_SENT] += len(items)
        for r in results:
            key = {RewardStatus.OK: ITEMS_OK, RewardStatus.ERROR: ITEMS_ERROR, RewardStatus.TIMEOUT: ITEMS_TIMEOUT}[r.status]
            self._counts[key] += 1

    def metrics(self) -> dict[str, float]:
        """Cumulative counters since construction (keys are this module's constants)."""
        return {k: float(v) for k, v in self._counts.items()}

    async def aclose(self) -> None:
        """Stop the senders and close the connection pool of the running event loop."""
        await self._pool.aclose()


@dataclass
class _LoopState:
    """What a client holds per event loop: connections, the in-flight limit, the senders."""

    http: httpx.AsyncClient
    sem: asyncio.Semaphore
    batcher: _MicroBatcher | None

    async def aclose(self) -> None:
        if self.batcher is not None:
            await self.batcher.aclose()
        await self.http.aclose()


T = TypeVar("T")


class LoopBound(Generic[T]):
    """A resource made for the running event loop and closed when that loop shuts down.

    Callers may run each step in its own ``asyncio.run``: the first :meth:`get` in a new loop
    makes a fresh resource, and ``asyncio.run``'s shutdown closes the old one in its own loop
    (an async generator parked in the loop is finalised by ``loop.shutdown_asyncgens``),
    so no connection outlives its loop.

    Raises (from :meth:`get`):
        RewardServiceError: used from a second event loop while the first is still open.
    """

    def __init__(self, make: Callable[[], T], close: Callable[[T], Awaitable[None]]):
        self._make, self._close = make, close
        self._loop: asyncio.AbstractEventLoop | None = None
        self._value: T | None = None
        self._guard: AsyncIterator[None] | None = None

    async def get(self) -> T:
        """The resource of the running event loop, made on first use in that loop (and closed when it shuts
        down).

        Raises:
            RewardServiceError: the resource belongs to another event loop that is still open.
        """
        loop = asyncio.get_running_loop()
        if self._value is not None and loop is self._loop:
            return self._value
        if self._value is not None and self._loop is not None and not self._loop.is_closed():
            raise RewardServiceError("a reward client is in use by another open event loop; build one per loop")
        value = self._make()
        self._loop, self._value = loop, value
        self._guard = self._close_with_loop(value)
        await self._guard.__anext__()  # registers the generator with this loop
        return value

    async def _close_with_loop(self, value: T) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if self._value is value:
                self._value = None
            await self._close(value)

    async def aclose(self) -> None:
        """Close the resource now (when it belongs to the running loop)."""
        guard, self._guard = self._guard, None
        if guard is not None and self._loop is asyncio.get_running_loop():
            await guard.aclose()  # type: ignore[attr-defined]
        self._value = None


def _check_unique(items: list[RewardItem]) -> None:
    seen: set[str] = set()
    for item in items:
        if item.id in seen:
            raise DataError(f"item id {item.id!r} appears twice in one score() call; ids must be unique")
        seen.add(item.id)


def _retry_after_s(resp: httpx.Response) -> float | None:
    try:
        return max(0.0, float(resp.headers["Retry-After"]))
    except (KeyError, ValueError):
        return None


def _body_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(body, dict):
        return str(body.get("message") or body.get("detail") or body)[:300]
    return str(body)[:300]


def _describe(resp: httpx.Response | None, exc: BaseException | None = None) -> str:
    if resp is not None:
        return f"HTTP {resp.status_code} {_body_message(resp)}".strip()
    return f"{type(exc).__name__}: {exc}" if exc is not None else "no response"


class _MicroBatcher:
    """Merges concurrent submissions into batches sent by ``senders`` long-lived tasks.

    Each sender waits for one queued item, takes whatever else is queued (up to
    ``max_items``, waiting up to ``wait_s`` for more), and sends it. Items with the same id
    never share a batch.
    """

    def __init__(self, send: Callable[[list[RewardItem]], Awaitable[list[RewardResult]]], max_items: int,
                 wait_s: float, senders: int):
        self._send, self._max_items, self._wait_s, self._n_senders = send, max_items, wait_s, senders
        self._queue: asyncio.Queue[tuple[RewardItem, asyncio.Future[RewardResult]]] | None = None
        self._carry: deque[tuple[RewardItem, asyncio.Future[RewardResult]]] = deque()
        self._senders: list[asyncio.Task[None]] = []

    async def submit(self, items: list[RewardItem]) -> list[RewardResult]:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._senders = [asyncio.create_task(self._sender()) for _ in range(self._n_senders)]
        loop = asyncio.get_running_loop()
        futures = []
        for item in items:
            fut: asyncio.Future[RewardResult] = loop.create_future()
            self._queue.put_nowait((item, fut))
            futures.append(fut)
        return list(await asyncio.gather(*futures))

    async def _next(self) -> tuple[RewardItem, asyncio.Future[RewardResult]]:
        assert self._queue is not None
        return self._carry.popleft() if self._carry else await self._queue.get()

    async def _sender(self) -> None:
        while True:
            batch = [await self._next()]
            try:
                await self._fill(batch)
                await self._dispatch(batch)
            except BaseException as exc:  # the callers must hear of it, whatever it is
                failure = exc if isinstance(exc, Exception) else RewardServiceError("reward client closed mid-request")
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(failure)
                if not isinstance(exc, Exception):
                    raise

    async def _dispatch(self, batch: list[tuple[RewardItem, asyncio.Future[RewardResult]]]) -> None:
        live = [(item, fut) for item, fut in batch if not fut.done()]  # drop cancelled callers
        if not live:
            return
        results = await self._send([item for item, _ in live])
        for (_, fut), result in zip(live, results, strict=True):
            if not fut.done():
                fut.set_result(result)

    async def _fill(self, batch: list[tuple[RewardItem, asyncio.Future[RewardResult]]]) -> None:
        assert self._queue is not None
        ids = {batch[0][0].id}
        deadline = time.monotonic() + self._wait_s
        while len(batch) < self._max_items:
            if self._carry:
                entry = self._carry.popleft()
            elif not self._queue.empty():
                entry = self._queue.get_nowait()
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                try:
                    entry = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:
                    return
            if entry[0].id in ids:
                self._carry.append(entry)
                return
            ids.add(entry[0].id)
            batch.append(entry)

    async def aclose(self) -> None:
        for task in self._senders:
            task.cancel()
        await asyncio.gather(*self._senders, return_exceptions=True)
        self._senders = []
        closed = RewardServiceError("reward client closed before this item was sent")
        pending = list(self._carry)
        self._carry.clear()
        while self._queue is not None and not self._queue.empty():
            pending.append(self._queue.get_nowait())
        for _, fut in pending:
            if not fut.done():
                fut.set_exception(closed)
        self._queue = None
