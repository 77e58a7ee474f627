"""Reward-service faults over real HTTP on 127.0.0.1: crash and restart, 503 storms, bad tokens.

Invariant checked throughout: every sample gets exactly one result, either its real reward
or a masked failure (status error/timeout, reward None) that the client counts -- none lost,
none double-counted, none turned into a 0.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time

import httpx
import pytest
from fastapi.responses import JSONResponse

from relax_agent.errors import AuthError
from relax_agent.reward_services import (
    LocalReward,
    RetryPolicy,
    RewardClient,
    RewardConfig,
    RewardItem,
    RewardStatus,
    build_reward,
    check_reward,
    create_app,
)
from relax_agent.reward_services import client as rc
from relax_agent.reward_services.testing import ServiceProcess, ThreadServer, free_port

THIS = os.path.abspath(__file__)


def slow_score(metadata: dict) -> float:
    """Served function: 20 ms of work, reward = metadata["k"] / 10."""
    time.sleep(0.02)
    return metadata["k"] / 10


def samples(n: int) -> list[RewardItem]:
    return [RewardItem(id=f"sample-{k}", metadata={"k": k}) for k in range(n)]


async def drive(client: RewardClient, items: list[RewardItem], callers: int, on_progress) -> dict[str, list]:
    """``callers`` rollout workers each score one sample at a time; returns id -> results seen."""
    queue: asyncio.Queue[RewardItem] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    seen: dict[str, list] = {i.id: [] for i in items}

    async def worker():
        while not queue.empty():
            item = queue.get_nowait()
            (result,) = await client.score([item])
            seen[result.id].append(result)
            await on_progress(sum(1 for v in seen.values() if v))

    await asyncio.gather(*(worker() for _ in range(callers)))
    return seen


def test_service_killed_mid_run_and_restarted_loses_nothing():
    port = free_port()
    svc = ServiceProcess(f"{THIS}:slow_score", port=port).start()
    restarted: list[ServiceProcess] = []
    n = 240

    async def on_progress(done: int):
        if done >= n // 3 and not restarted:
            restarted.append(None)  # type: ignore[arg-type]
            svc.kill()  # SIGKILL with requests in flight
            await asyncio.sleep(0.5)
            restarted[0] = await asyncio.to_thread(ServiceProcess(f"{THIS}:slow_score", port=port).start)

    async def main():
        client = RewardClient(svc.url, max_concurrency=8, max_batch_items=8,
                              retry=RetryPolicy(max_attempts=100, backoff_initial_s=0.05, backoff_max_s=0.5, max_elapsed_s=30))
        try:
            return await drive(client, samples(n), callers=32, on_progress=on_progress), client.metrics()
        finally:
            await client.aclose()

    try:
        seen, metrics = asyncio.run(main())
    finally:
        svc.kill()
        if restarted and restarted[0] is not None:
            restarted[0].stop()
    assert restarted, "the service was never killed"
    assert all(len(v) == 1 for v in seen.values())  # every sample exactly once
    assert {k: v[0].reward for k, v in seen.items()} == {f"sample-{k}": k / 10 for k in range(n)}
    assert metrics[rc.ITEMS_OK] == n and metrics[rc.ITEMS_ERROR] == metrics[rc.ITEMS_TIMEOUT] == 0
    assert metrics[rc.RETRIES] >= 1


def test_service_killed_for_good_masks_and_counts_the_rest():
    svc = ServiceProcess(f"{THIS}:slow_score").start()
    n = 120

    async def on_progress(done: int):
        if done >= n // 3:
            svc.kill()

    async def main():
        client = RewardClient(svc.url, max_concurrency=4, max_batch_items=4,
                              retry=RetryPolicy(max_attempts=4, backoff_initial_s=0.02, backoff_max_s=0.05, max_elapsed_s=1))
        try:
            return await drive(client, samples(n), callers=16, on_progress=on_progress), client.metrics()
        finally:
            await client.aclose()

    try:
        seen, metrics = asyncio.run(main())
    finally:
        svc.kill()
    results = [v[0] for v in seen.values()]
    assert all(len(v) == 1 for v in seen.values())
    ok = [r for r in results if r.ok]
    masked = [r for r in results if not r.ok]
    assert len(ok) >= n // 3 and masked, (len(ok), len(masked))
    assert all(r.reward == int(r.id.split("-")[1]) / 10 for r in ok)
    assert all(r.reward is None and r.status in (RewardStatus.ERROR, RewardStatus.TIMEOUT) and r.extra["error"] for r in masked)
    assert metrics[rc.ITEMS_OK] == len(ok)
    assert metrics[rc.ITEMS_ERROR] + metrics[rc.ITEMS_TIMEOUT] == len(masked)


def unavailable_for(app, window_s: float):
    """ASGI wrapper: ``/v1/reward`` answers 503 for ``window_s`` after the first request."""
    state = {"t0": None, "refused": 0}

    async def asgi(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/v1/reward":
            state["t0"] = state["t0"] or time.monotonic()
            if time.monotonic() - state["t0"] < window_s:
                state["refused"] += 1
                await JSONResponse({"detail": "warming up"}, status_code=503)(scope, receive, send)
                return
        await app(scope, receive, send)

    return asgi, state


def run_through_503(window_s: float, retry: RetryPolicy | None) -> tuple[list, dict, dict, float]:
    app, state = unavailable_for(create_app(LocalReward(lambda metadata: metadata["k"] / 10)), window_s)
    with ThreadServer(app) as server:
        async def main():
            client = RewardClient(server.url, retry=retry, max_concurrency=4)
            try:
                started = time.monotonic()
                out = await asyncio.gather(*(client.score([item]) for item in samples(16)))
                return out, client.metrics(), time.monotonic() - started
            finally:
                await client.aclose()

        out, metrics, elapsed = asyncio.run(main())
    return out, metrics, state, elapsed


@pytest.mark.slow
def test_503_for_ten_seconds_is_retried_with_the_default_policy():
    out, metrics, state, elapsed = run_through_503(10.0, retry=None)
    assert [o[0].reward for o in out] == [k / 10 for k in range(16)]
    assert elapsed >= 10.0 and state["refused"] >= 4
    assert metrics[rc.RETRIES] >= 4 and metrics[rc.ITEMS_OK] == 16


def test_503_window_is_retried_then_succeeds():
    out, metrics, state, elapsed = run_through_503(
        1.0, RetryPolicy(backoff_initial_s=0.05, backoff_max_s=0.4, max_elapsed_s=10))
    assert [o[0].reward for o in out] == [k / 10 for k in range(16)]
    assert elapsed >= 1.0 and state["refused"] >= 3 and metrics[rc.ITEMS_OK] == 16


def test_wrong_token_is_a_clear_error_at_start_up(monkeypatch):
    with ServiceProcess("relax_agent.reward_services.math_reward:score", "--token-env", "SERVICE_TOKEN",
                        env={"SERVICE_TOKEN": "right"}) as svc:
        monkeypatch.setenv("TRAINER_TOKEN", "wrong")
        reward = build_reward(RewardConfig(source="remote", url=svc.url, token_env="TRAINER_TOKEN"))
        started = time.monotonic()
        with pytest.raises(AuthError, match=r"refused the token from environment variable 'TRAINER_TOKEN': HTTP 401"):
            asyncio.run(check_reward(reward))
        assert time.monotonic() - started < 2.0  # refused tokens are not retried
        no_token = build_reward(RewardConfig(source="remote", url=svc.url))
        with pytest.raises(AuthError, match=r"refused no token \(set token_env\)"):
            asyncio.run(check_reward(no_token))
        monkeypatch.setenv("TRAINER_TOKEN", "right")
        good = build_reward(RewardConfig(source="remote", url=svc.url, token_env="TRAINER_TOKEN"))

        async def main():
            await check_reward(good)
            out = await good.score([RewardItem(id="a", response="\\boxed{4}", ground_truth="4")])
            await good.aclose()
            return out

        assert asyncio.run(main())[0].reward == 1.0


class Trickler:
    """A TCP server on 127.0.0.1 that answers any request with HTTP headers, then one body byte
    every ``every_s`` seconds, forever: every single read beats the read timeout."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{")
                while not self.stop.wait(self.every_s):
                    conn.sendall(b" ")
            except OSError:
                pass

    def __enter__(self) -> Trickler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def test_a_server_that_trickles_its_answer_is_cut_at_the_request_deadline():
    with Trickler(every_s=0.2) as server:
        async def main():
            client = RewardClient(server.url, request_timeout_s=2.0, request_deadline_s=1.5,
                                  retry=RetryPolicy(max_attempts=2, backoff_initial_s=0.05, backoff_max_s=0.05,
                                                    max_elapsed_s=30))
            try:
                started = time.monotonic()
                # The outer bound only keeps the code before the fix from hanging this test forever.
                out = await asyncio.wait_for(client.score(samples(2)), 120)
                return out, client.metrics(), time.monotonic() - started
            finally:
                await client.aclose()

        out, metrics, elapsed = asyncio.run(main())
    assert [r.status for r in out] == [RewardStatus.TIMEOUT, RewardStatus.TIMEOUT]
    assert all("request_deadline_s=1.5" in r.extra["error"] for r in out)
    assert metrics[rc.RETRIES] == 1 and metrics[rc.ITEMS_TIMEOUT] == 2
    assert elapsed >= 3.0  # two attempts, each held for its full deadline


def exits_on_request(metadata: dict) -> float:
    """Served function: calls ``sys.exit`` or raises KeyboardInterrupt when the item asks for it."""
    if metadata.get("exit"):
        sys.exit(metadata["exit"])
    if metadata.get("interrupt"):
        raise KeyboardInterrupt
    return metadata["k"] / 10


def test_a_reward_function_that_exits_does_not_kill_serve_reward():
    batch = [RewardItem(id="a", metadata={"k": 1}), RewardItem(id="b", metadata={"k": 2, "exit": 3}),
             RewardItem(id="c", metadata={"k": 3, "interrupt": True}), RewardItem(id="d", metadata={"k": 4})]
    with ServiceProcess(f"{THIS}:exits_on_request") as svc:
        async def main():
            client = RewardClient(svc.url, retry=RetryPolicy(max_attempts=2, backoff_initial_s=0.05,
                                                             backoff_max_s=0.05, max_elapsed_s=5))
            try:
                first = await client.score(batch)
                return first, await client.score(samples(3))
            finally:
                await client.aclose()

        first, after = asyncio.run(main())
        alive = svc.proc.poll() is None
    assert [(r.id, r.status, r.reward) for r in first] == [
        ("a", RewardStatus.OK, 0.1), ("b", RewardStatus.ERROR, None), ("c", RewardStatus.ERROR, None),
        ("d", RewardStatus.OK, 0.4)]
    assert "raised SystemExit(3)" in first[1].extra["error"]
    assert "raised KeyboardInterrupt()" in first[2].extra["error"]
    assert alive and [r.reward for r in after] == [0.0, 0.1, 0.2]


def test_serve_reward_refuses_a_body_over_max_body_bytes():
    with ServiceProcess(f"{THIS}:slow_score", "--max-body-bytes", "4096") as svc:
        big = {"items": [{"id": "a", "metadata": {"k": 1, "blob": "x" * 100_000}}]}
        resp = httpx.post(svc.url + "/v1/reward", json=big, timeout=30)
        ok = httpx.post(svc.url + "/v1/reward", json={"items": [{"id": "a", "metadata": {"k": 1}}]}, timeout=30)
    assert resp.status_code == 413 and "over the limit of 4096 bytes (--max-body-bytes)" in resp.json()["message"]
    assert ok.status_code == 200 and ok.json()["results"][0]["reward"] == 0.1
