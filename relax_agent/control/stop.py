"""Ctrl-C handling for a run."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any


class StopRequest:
    """Ctrl-C handling for a run: the first SIGINT asks for a clean stop, the second aborts.

    The first SIGINT cancels a running rollout (its envs and sandboxes are closed by the
    cancelled episodes) and lets an update in flight finish, so weights, optimizer and
    policy version never disagree; the controller then saves the last complete step.
    Outside the main thread (no signals there) it does nothing.
    """

    def __init__(self) -> None:
        self.requested = False
        self._cancel: Callable[[], object] | None = None
        self._previous: Any = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, *_: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt  # second Ctrl-C: stop now
        self.requested = True
        if self._cancel is not None:
            self._cancel()

    def check(self) -> None:
        """Raise KeyboardInterrupt when a stop was requested."""
        if self.requested:
            raise KeyboardInterrupt

    def run(self, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        """``asyncio.run(coro_fn())`` that a first Ctrl-C cancels (raising KeyboardInterrupt)."""

        async def main() -> Any:
            loop, task = asyncio.get_running_loop(), asyncio.current_task()
            assert task is not None  # main() runs as asyncio.run's task
            self._cancel = lambda: loop.call_soon_threadsafe(task.cancel)
            return await coro_fn()

        try:
            result = asyncio.run(main())
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None
        finally:
            self._cancel = None
        self.check()
        return result
