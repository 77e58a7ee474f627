"""Episodes sharing the endpoint under large requests (real HTTP on 127.0.0.1, scripted engines): a
body that cannot fit the token budget is refused before it is tokenized, and large histories in
flight do not hold the threads another episode's small request needs."""

from __future__ import annotations

import os
import threading
import time

import openai
import pytest

from relax_agent.config import ModelConfig
from relax_agent.models import load_tokenizer
from relax_agent.rollout.proxy.admission import max_token_bytes
from relax_agent.rollout.proxy.server import EndpointServer
from relax_agent.rollout.proxy.workers import ByteBudget
from tests.unit.test_endpoint_openai import USER, ScriptedEngine, ids_of, open_session


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


def test_a_body_that_cannot_fit_the_budget_is_refused_before_it_is_tokenized(tok):
    srv = EndpointServer().start()
    try:
        session, client = open_session(srv, ScriptedEngine(ids_of(tok, "x")), tok, max_total_tokens=1024)
        planned: list[int] = []
        plan = session._plan
        session._plan = lambda req: (planned.append(1), plan(req))[1]
        text = "lorem ipsum " * 40_000  # 480 kB: at least 480000 / 162 = 2963 tokens, past 1024
        assert len(text) // max_token_bytes(tok) >= 1024
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
        assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "messages"
        assert "480000 bytes" in err.value.body["message"] and "max_total_tokens=1024" in err.value.body["message"]
        assert planned == []  # neither rendered nor tokenized
        fits = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 100}])
        assert fits.choices[0].message.content == "x" and planned == [1]  # a body that may fit is planned as before
    finally:
        srv.close()


def test_a_small_request_is_answered_while_large_histories_hold_their_own_workers(tok):
    srv = EndpointServer(large_request_bytes=64 * 1024).start()
    try:
        spans: list[tuple[float, float]] = []
        lock = threading.Lock()

        def slow(plan):  # a history whose rendering and tokenization take seconds
            def planned(req):
                start = time.monotonic()
                time.sleep(3.0)
                out = plan(req)
                with lock:
                    spans.append((start, time.monotonic()))
                return out
            return planned

        # more large requests than Python's default thread pool has workers on this machine
        n_large = min(32, (os.cpu_count() or 1) + 4) + 1
        workers = []
        for _ in range(n_large):
            session, client = open_session(srv, ScriptedEngine(ids_of(tok, "x")), tok, max_total_tokens=10**7)
            session._plan = slow(session._plan)
            workers.append(threading.Thread(target=client.chat.completions.create, kwargs=dict(
                model="m", messages=[{"role": "user", "content": "lorem ipsum dolor sit amet, " * 4000}])))
        for w in workers:
            w.start()
        _, small = open_session(srv, ScriptedEngine(ids_of(tok, "fine")), tok)
        deadline = time.monotonic() + 60
        while sum(s.stats.requests for s in srv.sessions.values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # large histories are being planned
        time.sleep(0.5)
        assert small.chat.completions.create(model="m", messages=USER).choices[0].message.content == "fine"
        small_done = time.monotonic()
        for w in workers:
            w.join(300)
        assert len(spans) == n_large
        assert small_done < min(end for _, end in spans), "the small request waited for a large history"
    finally:
        srv.close()


def test_byte_budget_lets_a_burst_in_then_paces_by_bytes():
    budget = ByteBudget(bytes_per_s=1000, burst_s=1.0)
    assert [budget.reserve(500, now_s=0.0), budget.reserve(500, now_s=0.0)] == [0.0, 0.0]  # one second's worth
    assert budget.reserve(500, now_s=0.0) == pytest.approx(0.5)
    assert budget.reserve(1000, now_s=0.0) == pytest.approx(1.5)
    assert budget.waited_s == pytest.approx(2.0)
    assert budget.reserve(2000, now_s=100.0) == pytest.approx(1.0)  # idle refills the bucket, no more than a burst
    for bad in ({"bytes_per_s": 0}, {"bytes_per_s": 10, "burst_s": -1}):
        with pytest.raises(ValueError, match="must be > 0"):
            ByteBudget(**bad)


def test_an_agent_resending_large_histories_waits_for_its_bytes_while_small_requests_do_not(tok):
    # large bodies: over 16 kB, let in at 20 kB/s (one second's burst: 20 kB)
    srv = EndpointServer(large_request_bytes=16 * 1024, large_request_bytes_per_s=20_000).start()
    try:
        _, large = open_session(srv, ScriptedEngine(ids_of(tok, "x")), tok, max_total_tokens=10**7)
        history = [{"role": "user", "content": "lorem ipsum dolor sit amet, " * 1800}]  # ~50 kB of JSON
        large.chat.completions.create(model="m", messages=history)  # ~1.5 s past the burst
        assert srv.large_budget.waited_s > 1.0
        finished: dict[str, float] = {}
        again = threading.Thread(target=lambda: (large.chat.completions.create(model="m", messages=history),
                                                 finished.setdefault("large", time.monotonic())))
        again.start()  # waits ~2.5 s for its bytes before its body is read
        _, small = open_session(srv, ScriptedEngine(ids_of(tok, "fine")), tok)
        assert small.chat.completions.create(model="m", messages=USER).choices[0].message.content == "fine"
        finished["small"] = time.monotonic()
        again.join(60)
        assert finished["small"] < finished["large"], "the small request waited behind a large one's turn"
        assert srv.large_budget.waited_s > 3.0
    finally:
        srv.close()
