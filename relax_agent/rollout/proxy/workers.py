"""Where the endpoint's blocking request work runs: parsing bodies, matching, rendering and tokenizing
histories. Small requests use one thread pool; requests whose body is over ``large_request_bytes``
use a pool of their own of ``large_workers`` threads, so several large histories in flight queue
behind each other and never hold the threads a small request (another episode's 1-token turn)
needs.

:class:`RequestWorkers` is installed as the endpoint loop's default executor, so every
``asyncio.to_thread`` of a request handler (and of the session it calls) goes through it; the
handler states its request's size with :func:`sized` first (a context variable, private to the
handler's task).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import os
from collections.abc import Callable
from typing import Any

REQUEST_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("relax_agent_request_bytes", default=0)
"""Size in bytes of the body of the request the current task answers (0: none, a small request)."""


def sized(num_bytes: int) -> None:
    """Declare that the current task's blocking work is for a request body of ``num_bytes`` bytes."""
    REQUEST_BYTES.set(num_bytes)


class RequestWorkers(concurrent.futures.ThreadPoolExecutor):
    """The thread pool of small requests, handing work of large ones to a bounded pool of its own.

    Args:
        large_request_bytes: bodies over this many bytes are large.
        large_workers: threads for large requests (at least 1); more large requests queue.
        small_workers: threads for the others (default: Python's, ``min(32, cpus + 4)``).
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
