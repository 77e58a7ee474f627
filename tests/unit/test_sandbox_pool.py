"""SandboxPool on the fake backend: warm acquisition, reset/replace, health, bounds, cleanup."""

from __future__ import annotations

import asyncio

import pytest

from relax_agent.errors import SandboxError, SandboxTimeoutError
from relax_agent.sandboxes import FakeBackend, PoolConfig, SandboxConfig, SandboxPool


def make(size=2, max_size=4, **pool_kw):
    backend = FakeBackend(SandboxConfig(backend="fake"))
    return backend, SandboxPool(backend, PoolConfig(size=size, max_size=max_size, **pool_kw))


def test_start_prestarts_size_and_acquire_is_warm():
    async def body():
        backend, pool = make(size=3, max_size=5)
        async with pool:
            assert len(backend.created) == 3 and pool.idle == 3
            sb = await pool.acquire()
            assert sb in backend.created[:3] and pool.in_use == 1
            await asyncio.sleep(0)  # let the background refill run
            await asyncio.sleep(0)
            assert pool.idle == 3 and len(backend.created) == 4, "a replacement keeps `size` idle"
            await pool.release(sb)
        assert all(s.closed for s in backend.created)

    asyncio.run(body())


def test_release_resets_and_reuses():
    async def body():
        backend, pool = make(size=1, max_size=1)
        async with pool:
            async with pool.sandbox() as sb:
                await sb.write_file("secret.txt", "episode 1")
            async with pool.sandbox() as sb2:
                assert sb2 is sb and sb.reset_count == 1
                r = await sb2.exec(["cat", "secret.txt"])
                assert r.exit_code != 0, "files of the previous episode are gone"
            assert pool.stats.reused == 2 and pool.stats.created == 1

    asyncio.run(body())


def test_replace_mode_and_max_uses_replace_sandboxes():
    async def body():
        backend, pool = make(size=1, max_size=2, on_release="replace")
        async with pool:
            sb = await pool.acquire()
            await pool.release(sb)
            assert sb.closed and sb.reset_count == 0
            sb2 = await pool.acquire()
            assert sb2 is not sb
            await pool.release(sb2)

        backend, pool = make(size=1, max_size=1, max_uses=2)
        async with pool:
            first = await pool.acquire()
            await pool.release(first)
            assert not first.closed
            assert await pool.acquire() is first
            await pool.release(first)
            assert first.closed, "replaced after max_uses episodes"

    asyncio.run(body())


def test_failed_reset_and_discard_replace():
    async def body():
        backend, pool = make(size=1, max_size=2)
        async with pool:
            sb = await pool.acquire()

            async def broken_reset():
                raise SandboxError("reset failed")

            sb.reset = broken_reset
            await pool.release(sb)
            assert sb.closed and pool.stats.replaced == 1
            sb2 = await pool.acquire()
            await pool.release(sb2, discard=True)
            assert sb2.closed

    asyncio.run(body())


def test_unhealthy_idle_sandbox_is_replaced():
    async def body():
        backend, pool = make(size=1, max_size=2, health_check_idle_s=0.0)
        async with pool:
            sick = backend.created[0]
            sick.healthy = False
            await asyncio.sleep(0.01)
            sb = await pool.acquire()
            assert sb is not sick and sick.closed
            assert pool.stats.health_failures == 1
            await pool.release(sb)

    asyncio.run(body())


def test_acquire_waits_for_a_release_then_times_out():
    async def body():
        backend, pool = make(size=0, max_size=2)
        async with pool:
            a, b = await pool.acquire(), await pool.acquire()
            waiter = asyncio.ensure_future(pool.acquire(timeout_s=5))
            await asyncio.sleep(0.05)
            assert not waiter.done(), "a third acquire waits instead of overcommitting"
            await pool.release(a)
            assert await waiter is a
            with pytest.raises(SandboxTimeoutError, match="max_size=2"):
                await pool.acquire(timeout_s=0.1)
            assert pool.stats.acquire_timeouts == 1
            assert len(backend.created) == 2
            await pool.release(a)
            await pool.release(b)

    asyncio.run(body())


def test_alive_never_exceeds_max_size_under_load():
    async def body():
        backend, pool = make(size=3, max_size=4)
        backend.create_delay_s = 0.005
        peak = 0

        async def episode(i):
            nonlocal peak
            async with pool.sandbox(timeout_s=10) as sb:
                peak = max(peak, pool.alive)
                r = await sb.exec(f"echo {i}")
                assert r.stdout == f"{i}\n"
                await asyncio.sleep(0.01)

        async with pool:
            await asyncio.gather(*[episode(i) for i in range(40)])
            assert pool.in_use == 0
        assert peak <= 4 and len(backend.created) <= 8
        assert all(s.closed for s in backend.created)

    asyncio.run(body())


def test_sandbox_context_releases_on_error_and_cancellation():
    async def body():
        backend, pool = make(size=1, max_size=1)
        async with pool:
            with pytest.raises(RuntimeError, match="episode crashed"):
                async with pool.sandbox():
                    raise RuntimeError("episode crashed")
            assert pool.in_use == 0 and pool.idle == 1

            entered = asyncio.Event()

            async def episode():
                async with pool.sandbox() as sb:
                    entered.set()
                    await sb.exec(["sleep", "30"], timeout_s=60)

            task = asyncio.ensure_future(episode())
            await entered.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.01)
            assert pool.in_use == 0 and pool.idle == 1

    asyncio.run(body())


def test_close_closes_sandboxes_in_use_and_refuses_more():
    async def body():
        backend, pool = make(size=2, max_size=3)
        await pool.start()
        held = await pool.acquire()
        await pool.close()
        assert held.closed and all(s.closed for s in backend.created)
        with pytest.raises(SandboxError, match="closed"):
            await pool.acquire()
        await pool.close()  # idempotent

    asyncio.run(body())


def test_start_failure_closes_what_started():
    async def body():
        backend = FakeBackend(SandboxConfig(backend="fake"), fail_creates=1)
        pool = SandboxPool(backend, PoolConfig(size=3, max_size=3))
        with pytest.raises(SandboxError, match="could not start 1 of 3"):
            await pool.start()
        assert len(backend.created) == 2 and all(s.closed for s in backend.created)

    asyncio.run(body())


def test_release_of_foreign_sandbox_raises_and_config_bounds():
    async def body():
        _, pool = make(size=0, max_size=1)
        other = await FakeBackend().create()
        async with pool:
            with pytest.raises(SandboxError, match="not acquired from this pool"):
                await pool.release(other)

    asyncio.run(body())
    with pytest.raises(ValueError, match="pool.size=5 exceeds pool.max_size=2"):
        PoolConfig(size=5, max_size=2)


def test_pool_refuses_a_second_event_loop():
    _, pool = make(size=0, max_size=1)
    asyncio.run(pool.start())
    with pytest.raises(SandboxError, match="second event loop"):
        asyncio.run(pool.acquire())
