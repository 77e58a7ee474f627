"""RewardClient against scripted transports: retries, masking, auth, micro-batching, limits."""

import asyncio
import json
import random
import time

import httpx
import pytest

from relax_agent.errors import AuthError, DataError, RewardServiceError
from relax_agent.reward_services import LocalReward, RetryPolicy, RewardClient, RewardItem, RewardStatus, create_app
from relax_agent.reward_services import client as rc

FAST = RetryPolicy(max_attempts=5, backoff_initial_s=0.001, backoff_max_s=0.01, max_elapsed_s=5.0)


def items(n, prefix="s"):
    return [RewardItem(id=f"{prefix}{k}", response=str(k)) for k in range(n)]


def ok_body(request):
    body = json.loads(request.content)
    return {"results": [{"id": i["id"], "reward": float(i["response"] or 0), "status": "ok"} for i in body["items"]]}


class Script:
    """An async MockTransport handler: answers from a list of outcomes, then ok."""

    def __init__(self, *outcomes, delay_s=0.0):
        self.outcomes = list(outcomes)
        self.requests: list[list[str]] = []
        self.delay_s = delay_s
        self.in_flight = self.max_in_flight = 0

    async def __call__(self, request):
        ids = [i["id"] for i in json.loads(request.content)["items"]] if request.content else []
        self.requests.append(ids)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            outcome = self.outcomes.pop(0) if self.outcomes else "ok"
            if isinstance(outcome, Exception):
                raise outcome
            if isinstance(outcome, httpx.Response):
                return outcome
            return httpx.Response(200, json=ok_body(request))
        finally:
            self.in_flight -= 1


def client(handler, **kw):
    kw.setdefault("retry", FAST)
    return RewardClient("http://127.0.0.1:9", transport=httpx.MockTransport(handler), seed=0, **kw)


def run(coro):
    return asyncio.run(coro)


async def score_and_close(c, batch):
    try:
        return await c.score(batch)
    finally:
        await c.aclose()


def test_retries_5xx_and_transport_errors_then_succeeds():
    script = Script(httpx.Response(503), httpx.ConnectError("refused"), httpx.Response(500), httpx.Response(502))
    c = client(script)
    out = run(score_and_close(c, items(3)))
    assert [r.reward for r in out] == [0.0, 1.0, 2.0] and all(r.ok for r in out)
    m = c.metrics()
    assert m[rc.REQUESTS] == 5 and m[rc.RETRIES] == 4 and m[rc.ITEMS_OK] == 3


def test_429_honours_retry_after():
    script = Script(httpx.Response(429, headers={"Retry-After": "0.3"}))
    c = client(script, retry=RetryPolicy(backoff_initial_s=0.001, backoff_max_s=1.0))
    started = time.monotonic()
    assert run(score_and_close(c, items(1)))[0].ok
    assert time.monotonic() - started >= 0.3


def test_client_errors_are_not_retried():
    script = Script(httpx.Response(422, json={"message": "items.0.id: Field required"}))
    c = client(script)
    with pytest.raises(RewardServiceError, match="HTTP 422 items.0.id: Field required"):
        run(score_and_close(c, items(2)))
    assert len(script.requests) == 1


def test_refused_token_raises_auth_error():
    c = client(Script(httpx.Response(401, json={"detail": "missing or wrong bearer token"})), token="x",
               token_env="REWARD_TOKEN")
    with pytest.raises(AuthError, match="'REWARD_TOKEN'.*HTTP 401"):
        run(score_and_close(c, items(1)))


def test_exhausted_retries_mask_items_and_count_them():
    c = client(Script(*[httpx.Response(503)] * 5))
    out = run(score_and_close(c, items(3)))
    assert all(r.status is RewardStatus.ERROR and r.reward is None for r in out)
    assert "HTTP 503" in out[0].extra["error"]
    assert c.metrics()[rc.ITEMS_ERROR] == 3 and c.metrics()[rc.REQUESTS] == 5

    c = client(Script(*[httpx.ReadTimeout("slow")] * 5))
    out = run(score_and_close(c, items(2)))
    assert all(r.status is RewardStatus.TIMEOUT and r.reward is None for r in out)
    assert c.metrics()[rc.ITEMS_TIMEOUT] == 2


def test_max_elapsed_bounds_the_retries():
    policy = RetryPolicy(max_attempts=100, backoff_initial_s=0.05, backoff_max_s=0.05, max_elapsed_s=0.3)
    script = Script(*[httpx.Response(503)] * 100)
    out = run(score_and_close(client(script, retry=policy), items(1)))
    assert out[0].status is RewardStatus.ERROR
    # No retry starts after 0.3 s and each waits >= 0.025 s (equal jitter on 0.05 s): at most 12 retries,
    # however slow the machine (on busy cores fewer fit); without the bound all 100 attempts are made.
    assert 1 <= len(script.requests) <= 13


def test_missing_and_unexpected_results():
    async def handler(request):
        body = json.loads(request.content)
        ids = [i["id"] for i in body["items"]]
        results = [{"id": ids[0], "reward": 1.0}, {"id": ids[0], "reward": 5.0}, {"id": "stranger", "reward": 1.0},
                   {"id": ids[2], "reward": "not a number"}]
        return httpx.Response(200, json={"results": results})

    c = client(handler)
    out = run(score_and_close(c, items(3)))
    # An id answered twice is neither answer (which one is right cannot be known), and is not double-counted.
    assert out[0].status is RewardStatus.ERROR and "more than one result for this id" in out[0].extra["error"]
    assert out[1].status is RewardStatus.ERROR and "no result for this id" in out[1].extra["error"]
    assert out[2].status is RewardStatus.ERROR and "malformed result: reward: reward must be a number" in out[2].extra["error"]
    assert "http://127.0.0.1:9" in out[2].extra["error"]
    assert c.metrics()[rc.UNEXPECTED_RESULTS] == 2


def test_micro_batching_merges_concurrent_calls():
    script = Script(delay_s=0.02)
    c = client(script, max_concurrency=2, max_batch_items=16)

    async def main():
        outs = await asyncio.gather(*(c.score([RewardItem(id=f"s{k}", response=str(k))]) for k in range(40)))
        await c.aclose()
        return outs

    outs = run(main())
    assert [o[0].reward for o in outs] == [float(k) for k in range(40)]
    assert len(script.requests) <= 6  # 40 single-item calls, 2 senders, up to 16 items each
    assert sorted(i for r in script.requests for i in r) == sorted(f"s{k}" for k in range(40))
    assert max(len(r) for r in script.requests) <= 16 and script.max_in_flight <= 2


def test_without_micro_batching_each_call_is_a_request_and_concurrency_is_capped():
    script = Script(delay_s=0.01)
    c = client(script, max_concurrency=3, micro_batching=False, max_batch_items=4)

    async def main():
        outs = await asyncio.gather(*(c.score([RewardItem(id=f"s{k}", response="1")]) for k in range(12)))
        big = await c.score(items(10, "b"))
        await c.aclose()
        return outs, big

    outs, big = run(main())
    assert all(o[0].reward == 1.0 for o in outs)
    assert [r.reward for r in big] == [float(k) for k in range(10)]
    assert len(script.requests) == 12 + 3  # 10 items in chunks of 4
    assert script.max_in_flight == 3


def test_same_id_never_shares_a_batch():
    async def handler(request):
        ids = [i["id"] for i in json.loads(request.content)["items"]]
        assert len(ids) == len(set(ids))
        await asyncio.sleep(0.01)
        return httpx.Response(200, json=ok_body(request))

    c = client(handler, max_concurrency=1)

    async def main():
        outs = await asyncio.gather(*(c.score([RewardItem(id="dup", response=str(k))]) for k in range(5)))
        await c.aclose()
        return outs

    assert sorted(o[0].reward for o in run(main())) == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(DataError, match="'x' appears twice"):
        run(client(handler).score([RewardItem(id="x"), RewardItem(id="x")]))


def test_check_passes_and_names_failures():
    app = create_app(LocalReward(lambda id: 1.0), token="good")
    good = RewardClient("http://t", token="good", transport=httpx.ASGITransport(app=app))
    run(good.check())
    bad = RewardClient("http://t", token="bad", token_env="MY_TOKEN", transport=httpx.ASGITransport(app=app))
    with pytest.raises(AuthError, match="refused the token from environment variable 'MY_TOKEN'"):
        run(bad.check())
    down = client(Script(*[httpx.ConnectError("refused")] * 5))
    with pytest.raises(RewardServiceError, match="not healthy: ConnectError: refused"):
        run(down.check())
    not_ours = client(Script(httpx.Response(200, json={"status": "ok"}), httpx.Response(404, json={"detail": "Not Found"})))
    with pytest.raises(RewardServiceError, match="is it a relax-agent v1 reward service"):
        run(not_ours.check())


def test_client_against_the_real_app_in_process():
    def fn(id, response):
        if id == "boom":
            raise RuntimeError("boom")
        return len(response)

    app = create_app(LocalReward(fn))
    c = RewardClient("http://t", transport=httpx.ASGITransport(app=app))
    batch = [RewardItem(id="a", response="xy"), RewardItem(id="boom"), RewardItem(id="c", response="xyz")]
    out = run(score_and_close(c, batch))
    assert [(r.id, r.status.value, r.reward) for r in out] == [("a", "ok", 2.0), ("boom", "error", None), ("c", "ok", 3.0)]


def test_equal_jitter_backoff_bounds():
    policy = RetryPolicy(backoff_initial_s=0.5, backoff_max_s=4.0)
    rng = random.Random(0)
    for n, cap in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (10, 4.0)]:
        delays = [policy.delay_s(n, rng) for _ in range(200)]
        assert cap / 2 <= min(delays) and max(delays) <= cap
    assert policy.delay_s(0, rng, retry_after_s=3.0) == 3.0
    assert policy.delay_s(0, rng, retry_after_s=60.0) == 4.0  # capped
    assert RetryPolicy.retryable(429) and RetryPolicy.retryable(503) and not RetryPolicy.retryable(404)


def test_one_client_serves_successive_event_loops():
    from relax_agent.reward_services.testing import ThreadServer

    def fn(id):
        return 1.0

    with ThreadServer(create_app(LocalReward(fn, max_concurrency=1))) as server:
        for micro_batching in (True, False):
            c = RewardClient(server.url, max_concurrency=2, micro_batching=micro_batching)
            for _ in range(3):  # a training loop that calls asyncio.run once per step
                async def step(client):
                    return await asyncio.gather(*(client.score([i]) for i in items(6)))

                assert [o[0].reward for o in asyncio.run(step(c))] == [1.0] * 6
            asyncio.run(c.aclose())
            assert c.metrics()[rc.ITEMS_OK] == 18


def test_aclose_mid_flight_fails_waiting_callers_instead_of_hanging():
    c = client(Script(delay_s=5.0), max_concurrency=1, batch_wait_s=0.0)

    async def main():
        calls = [asyncio.create_task(c.score([RewardItem(id=f"s{k}", response="1")])) for k in range(3)]
        await asyncio.sleep(0.05)
        await c.aclose()
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 1.0)

    outs = asyncio.run(main())
    assert all(isinstance(o, RewardServiceError) and "closed" in str(o) for o in outs)
