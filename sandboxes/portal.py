"""Running sandbox coroutines from synchronous code (gymnasium ``step``): one background event loop
on a daemon thread, and :func:`run_sync` that turns Ctrl-C into a cancellation so cleanup still runs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from relax_agent.errors import SandboxError

T = TypeVar("T")

_portal_lock = threading.Lock()
_portal_loop: asyncio.AbstractEventLoop | None = None


def portal_loop() -> asyncio.AbstractEventLoop:
    """The background event loop (daemon thread) that :func:`run_sync` uses by default."""
    global _portal_loop
    with _portal_lock:
        if _portal_loop is None or _portal_loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="relax-sandbox-loop", daemon=True).start()
            _portal_loop = loop
        return _portal_loop


def run_sync(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop | None = None) -> T:
    """Run ``coro`` to completion from synchronous code and return its result.

    The coroutine runs on ``loop`` (default: :func:`portal_loop`). If the caller is interrupted
    (Ctrl-C), the coroutine is cancelled and given 10 s to clean up before the interrupt is
    re-raised, so sandboxes it holds are still closed.

    Raises:
        SandboxError: called from the thread running ``loop`` (use ``await`` there instead).
    """
    loop = loop or portal_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise SandboxError("run_sync called from inside its own event loop; await the coroutine instead")
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result()
    except BaseException:
        if not fut.done():
            fut.cancel()
            try:
                fut.result(timeout=10.0)
            except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError, Exception):
                pass
        raise
