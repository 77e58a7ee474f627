"""A pool of pre-started sandboxes: warm acquisition, reset between episodes, bounded size.

::

    async with SandboxPool(SandboxConfig(pool=PoolConfig(size=8, max_size=32)).build()) as pool:
        async with pool.sandbox() as sb:          # one episode
            await sb.exec("python3 -c 'print(1)'")

* ``size`` sandboxes are kept started and idle; taking one starts a replacement in the background.
* At most ``max_size`` sandboxes exist at once (idle + in use + starting). ``acquire`` waits up
  to ``acquire_timeout_s`` for one to come free rather than overcommitting the host, then
  raises :class:`~relax_agent.errors.SandboxTimeoutError`.
* On release a sandbox is reset (processes killed, work dir wiped) and reused, or closed and
  replaced (``on_release: replace``, a failed reset, ``max_uses`` reached, half its TTL gone).
* An idle sandbox is health-checked before it is handed out if it sat idle longer than
  ``health_check_idle_s``; a sick one is replaced.
* ``pool.sandbox()`` releases on normal exit, exceptions and cancellation; ``close`` closes
  every sandbox, idle or in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from relax_agent.errors import SandboxError, SandboxTimeoutError
from relax_agent.sandboxes import reaper
from relax_agent.sandboxes.base import ReportsState, Sandbox, SandboxBackend
from relax_agent.sandboxes.config import PoolConfig, SandboxConfig
from relax_agent.sandboxes.portal import portal_loop, run_sync


@dataclass
class PoolStats:
    """Counters of a pool's life (for metrics: ``sandbox/created`` ...)."""

    created: int = 0
    create_failures: int = 0
    reused: int = 0
    replaced: int = 0
    health_failures: int = 0
    acquire_timeouts: int = 0
    acquire_wait_s: float = 0.0
    """Total seconds callers waited in ``acquire``."""


@dataclass
class _Entry:
    sandbox: Sandbox
    uses: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    born: float = field(default_factory=time.monotonic)


class SandboxPool:
    """Pre-started sandboxes from one backend. Use from a single event loop."""

    def __init__(self, backend: SandboxBackend, config: PoolConfig | None = None):
        self.backend = backend
        self.config = config or backend.config.pool
        self.stats = PoolStats()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._idle: deque[_Entry] = deque()
        self._in_use: dict[int, _Entry] = {}
        self._creating = 0
        self._cond = asyncio.Condition()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # -- sizes -----------------------------------------------------------------------------
    @property
    def alive(self) -> int:
        """Sandboxes idle, in use or starting."""
        return len(self._idle) + len(self._in_use) + self._creating

    @property
    def idle(self) -> int:
        """Sandboxes started and waiting to be acquired."""
        return len(self._idle)

    @property
    def in_use(self) -> int:
        """Sandboxes currently acquired."""
        return len(self._in_use)

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self.loop is None:
            self.loop = loop
        elif self.loop is not loop:
            raise SandboxError("SandboxPool used from a second event loop; use it from the loop that started it "
                               "(from sync code: run_sync(coro, loop=pool.loop))")
        if self._closed:
            raise SandboxError("sandbox pool is closed")

    def _stale(self, entry: _Entry) -> bool:
        return (entry.uses >= self.config.max_uses
                or time.monotonic() - entry.born > self.backend.config.ttl_s / 2)

    # -- filling ---------------------------------------------------------------------------
    async def start(self) -> SandboxPool:
        """Start ``size`` sandboxes and wait until they are ready.

        Raises:
            SandboxError: a sandbox could not be started (the pool is closed again).
        """
        self._bind()
        async with self._cond:
            n = max(0, min(self.config.size - len(self._idle) - self._creating, self.config.max_size - self.alive))
            self._creating += n
        results = await asyncio.gather(*[self._create_idle() for _ in range(n)], return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise SandboxError(f"sandbox pool could not start {len(errors)} of {n} sandboxes: {errors[0]}") from errors[0]
        return self

    async def _create_idle(self) -> None:
        """Create one sandbox for the idle queue (``_creating`` was already counted)."""
        try:
            sb = await self.backend.create()
        except BaseException:
            async with self._cond:
                self._creating -= 1
                self.stats.create_failures += 1
                self._cond.notify_all()
            raise
        async with self._cond:
            self._creating -= 1
            self.stats.created += 1
            if self._closed:
                await sb.close()
            else:
                self._idle.append(_Entry(sb))
            self._cond.notify_all()

    def _refill(self) -> None:
        if self._closed:
            return
        n = max(0, min(self.config.size - len(self._idle) - self._creating, self.config.max_size - self.alive))
        for _ in range(n):
            self._creating += 1
            task = asyncio.ensure_future(self._create_idle())
            self._tasks.add(task)
            task.add_done_callback(self._refill_done)

    def _refill_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # counted in stats.create_failures; the next acquire retries

    # -- acquire / release ---------------------------------------------------------------
    async def acquire(self, timeout_s: float | None = None) -> Sandbox:
        """A ready sandbox, waiting up to ``timeout_s`` (default ``acquire_timeout_s``) for a free slot.

        Raises:
            SandboxTimeoutError: none came free (or could be started) in time.
            SandboxError: the pool is closed, or starting a sandbox failed.
        """
        self._bind()
        timeout_s = self.config.acquire_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        try:
            return await asyncio.wait_for(self._acquire(), timeout_s)
        except asyncio.TimeoutError:
            self.stats.acquire_timeouts += 1
            raise SandboxTimeoutError(
                f"no sandbox free within {timeout_s} s ({self.in_use} in use, pool.max_size={self.config.max_size})"
            ) from None
        finally:
            self.stats.acquire_wait_s += time.monotonic() - t0

    async def _acquire(self) -> Sandbox:
        while True:
            async with self._cond:
                while not self._idle and self.alive >= self.config.max_size:
                    await self._cond.wait()
                if self._closed:
                    raise SandboxError("sandbox pool is closed")
                entry = self._idle.popleft() if self._idle else None
                if entry is None:
                    self._creating += 1
                else:
                    self._in_use[id(entry.sandbox)] = entry  # counted while checked
            if entry is None:
                try:
                    sb = await self.backend.create()
                finally:
                    async with self._cond:
                        self._creating -= 1
                        self._cond.notify_all()
                self.stats.created += 1
                entry = _Entry(sb)
                async with self._cond:
                    self._in_use[id(sb)] = entry
                    self._refill()
                return sb
            if await self._usable(entry):
                self.stats.reused += 1
                async with self._cond:
                    self._refill()
                return entry.sandbox
            await self._discard(entry)

    async def _usable(self, entry: _Entry) -> bool:
        if self._stale(entry):
            return False
        if time.monotonic() - entry.idle_since <= self.config.health_check_idle_s:
            return True
        try:
            ok = await entry.sandbox.health()
        except asyncio.CancelledError:
            await self._discard(entry)
            raise
        if not ok:
            self.stats.health_failures += 1
        return ok

    async def _discard(self, entry: _Entry) -> None:
        """Close an in-use entry's sandbox, free its slot, and start a replacement if below size."""
        try:
            await entry.sandbox.close()
        finally:
            async with self._cond:
                self._in_use.pop(id(entry.sandbox), None)
                self.stats.replaced += 1
                self._refill()
                self._cond.notify_all()

    async def release(self, sandbox: Sandbox, *, discard: bool = False) -> None:
        """Give ``sandbox`` back: reset and reuse it, or close and replace it.

        ``discard=True`` always replaces it (e.g. the episode suspects it is compromised). The
        release completes even if the caller is cancelled meanwhile.

        Raises:
            SandboxError: ``sandbox`` did not come from this pool.
        """
        entry = self._in_use.get(id(sandbox))
        if entry is None or entry.sandbox is not sandbox:
            raise SandboxError(f"{sandbox!r} was not acquired from this pool (or was released twice)")
        task = asyncio.ensure_future(self._release(entry, discard))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(task)

    async def _release(self, entry: _Entry, discard: bool) -> None:
        entry.uses += 1
        sb = entry.sandbox
        keep = not (discard or self._closed or self.config.on_release == "replace" or self._stale(entry)
                    or (isinstance(sb, ReportsState) and bool(sb.closed or sb.broken)))
        if keep:
            try:
                await sb.reset()
            except Exception:  # noqa: BLE001 - any failed reset means: replace it
                keep = False
        if not keep:
            await self._discard(entry)
            return
        async with self._cond:
            self._in_use.pop(id(sb), None)
            entry.idle_since = time.monotonic()
            self._idle.append(entry)
            self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def sandbox(self, timeout_s: float | None = None) -> AsyncIterator[Sandbox]:
        """``async with pool.sandbox() as sb:`` — acquire, and release on exit, error or cancellation."""
        sb = await self.acquire(timeout_s)
        try:
            yield sb
        finally:
            await self.release(sb)

    # -- closing ---------------------------------------------------------------------------
    async def close(self) -> None:
        """Close every sandbox (idle and in use) and stop refilling. Idempotent."""
        self._closed = True
        for task in list(self._tasks):
            if not task.done():
                await asyncio.wait({task}, timeout=30)
        async with self._cond:
            entries = list(self._idle) + list(self._in_use.values())
            self._idle.clear()
            self._in_use.clear()
            self._cond.notify_all()
        await asyncio.gather(*[e.sandbox.close() for e in entries], return_exceptions=True)

    async def __aenter__(self) -> SandboxPool:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"SandboxPool(idle={self.idle}, in_use={self.in_use}, alive={self.alive}, max_size={self.config.max_size})"


_shared_lock = threading.Lock()
_shared: dict[str, SandboxPool] = {}


def shared_pool(config: SandboxConfig) -> SandboxPool:
    """A process-wide pool for ``config``, started on :func:`~relax_agent.sandboxes.portal.portal_loop`.

    For synchronous users (gymnasium envs) that make one env per episode: they share warm
    sandboxes through it with ``run_sync(pool.acquire(), loop=pool.loop)``. Closed at exit.
    """
    key = json.dumps(config.model_dump(mode="json"), sort_keys=True)
    with _shared_lock:
        pool = _shared.get(key)
        if pool is None or pool._closed:
            pool = SandboxPool(config.build(), config.pool)
            run_sync(pool.start(), loop=portal_loop())
            _shared[key] = pool
            reaper.register_cleanup(f"shared-pool:{id(pool)}", lambda p=pool: run_sync(p.close(), loop=p.loop))
        return pool
