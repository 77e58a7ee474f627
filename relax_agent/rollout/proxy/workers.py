"""Where the endpoint's blocking request work runs: parsing bodies, matching, rendering and tokenizing
histories. Small requests use one thread pool; requests whose body is over ``large_request_bytes``
use a pool of their own of ``large_workers`` threads, so several large histories in flight queue
behind each other and never hold the threads a small request (another episode's 1-token turn)
needs. Large bodies are also let in at a bounded rate (:class:`ByteBudget`), before they are read.

:class:`RequestWorkers` is installed as the endpoint loop's default executor, so every
``asyncio.to_thread`` of a request handler (and of the session it calls) goes through it; the
handler states its request's size with :func:`sized` first (a context variable, private to the
handler's task).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import os
import time
from collections.abc import Callable
from typing import Any

REQUEST_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("relax_agent_request_bytes", default=0)
"""Size in bytes of the body of the request the current task answers (0: none, a small request)."""


def sized(num_bytes: int) -> None:
    """Declare that the current task's blocking work is for a request body of ``num_bytes`` bytes."""
    REQUEST_BYTES.set(num_bytes)


class ByteBudget:
    """How fast large request bodies are let in: at most ``bytes_per_s`` on average, ``burst_s``
    seconds' worth at once (a token bucket kept as a virtual clock, GCRA). A large request waits its
    turn *before* its body is read, so while it waits its bytes stay in the socket and cost nothing:
    agents that resend multi-MB histories again and again slow themselves, not the endpoint's event
    loop, its threads and the policy's sampling that every other episode waits on. Turns go in
    arrival order.

    Raises:
        ValueError: ``bytes_per_s`` <= 0 or ``burst_s`` < 0.
    """

    def __init__(self, bytes_per_s: float, burst_s: float = 1.0) -> None:
        if bytes_per_s <= 0 or burst_s < 0:
            raise ValueError(f"large_request_bytes_per_s={bytes_per_s} must be > 0 and burst_s={burst_s} >= 0")
        self.bytes_per_s, self.burst_s = float(bytes_per_s), float(burst_s)
        self._clock = float("-inf")  # when the bucket is full again (the bytes let in so far paid for)
        self.waited_s = 0.0
        """Seconds large requests waited for their turn, in all."""

    def reserve(self, num_bytes: int, now_s: float | None = None) -> float:
        """Book ``num_bytes``; returns the seconds to wait before reading them (0: at once)."""
        now_s = time.monotonic() if now_s is None else now_s
        self._clock = max(self._clock, now_s) + num_bytes / self.bytes_per_s
        wait_s = max(0.0, self._clock - self.burst_s - now_s)
        self.waited_s += wait_s
        return wait_s


class RequestWorkers(concurrent.futures.ThreadPoolExecutor):
    """The thread pool of small requests, handing work of large ones to a bounded pool of its own.

    Args:
        large_request_bytes: bodies over this many bytes are large.
        large_workers: threads for large requests (at least 1); more large requests queue.
        small_workers: threads for the others (default: Python's, ``min(32, cpus + 4)``).

    Raises:
        ValueError: ``large_workers`` < 1.
    """

    def __init__(self, large_request_bytes: int = 256 * 1024, large_workers: int = 2,
                 small_workers: int | None = None) -> None:
        if large_workers < 1:
            raise ValueError(f"large_workers={large_workers} must be at least 1")
        super().__init__(small_workers or min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="endpoint-small")
        self.large_request_bytes = large_request_bytes
        self.large = concurrent.futures.ThreadPoolExecutor(large_workers, thread_name_prefix="endpoint-large")

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Run ``fn`` on the large pool when the calling task's request is large (see :func:`sized`),
        else on this one."""
        if REQUEST_BYTES.get() > self.large_request_bytes:
            return self.large.submit(fn, *args, **kwargs)
        return super().submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Shut both pools down."""
        self.large.shutdown(wait, cancel_futures=cancel_futures)
        super().shutdown(wait, cancel_futures=cancel_futures)
