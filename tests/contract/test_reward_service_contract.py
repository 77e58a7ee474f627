"""Contract tests for reward services over real HTTP on 127.0.0.1.

The protocol checks run against ``relax-agent serve-reward`` of this file's
``contract_score`` in a subprocess, or against your own service: set
``RELAX_REWARD_CONTRACT_URL`` (and ``RELAX_REWARD_CONTRACT_TOKEN`` if it needs one) and run
``pytest tests/contract/test_reward_service_contract.py -k protocol``.
"""

from __future__ import annotations

import asyncio
import math
import os
import time

import httpx
import pytest

from relax_agent.errors import AuthError
from relax_agent.reward_services import RewardClient, RewardItem, RewardStatus
from relax_agent.reward_services.testing import ServiceProcess, free_port

TOKEN = "contract-token"
THIS = os.path.abspath(__file__)


def contract_score(id: str, metadata: dict) -> dict:
    """The served function: ``metadata`` scripts it (value, raise, sleep_s)."""
    if "raise" in metadata:
        raise RuntimeError(metadata["raise"])
    time.sleep(float(metadata.get("sleep_s", 0.0)))
    return {"reward": float(metadata.get("value", 1.0)), "metrics": {"len_id": len(id)}, "extra": {"pid": os.getpid()}}


async def contract_batch(items: list) -> list:
    """A batched async function: reward = position in the batch."""
    return [float(k) for k in range(len(items))]


@pytest.fixture(scope="module")
def service():
    with ServiceProcess(f"{THIS}:contract_score", "--token-env", "CONTRACT_TOKEN", "--timeout-s", "0.5",
                        env={"CONTRACT_TOKEN": TOKEN}) as svc:
        yield svc


@pytest.fixture(scope="module")
def protocol_target(service):
    """(url, token) of the service under test: yours if RELAX_REWARD_CONTRACT_URL is set."""
    url = os.environ.get("RELAX_REWARD_CONTRACT_URL")
    if url:
        return url.rstrip("/"), os.environ.get("RELAX_REWARD_CONTRACT_TOKEN")
    return service.url, TOKEN


def post(url, body, token):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(url + "/v1/reward", json=body, headers=headers, timeout=30)


# ------------------------------------------------------------------ protocol (any service)
def test_protocol_health_and_noop(protocol_target):
    url, token = protocol_target
    health = httpx.get(url + "/healthz", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert post(url, {"items": []}, token).json() == {"results": []}


def test_protocol_batch_answers_every_id_once_in_order(protocol_target):
    url, token = protocol_target
    items = [{"id": f"item-{k}", "messages": [{"role": "user", "content": "2+2?"}], "response": "4",
              "ground_truth": "4", "metadata": {}} for k in range(20)]
    resp = post(url, {"items": items}, token)
    assert resp.status_code == 200
    results = resp.json()["results"]
    assert [r["id"] for r in results] == [i["id"] for i in items]
    for r in results:
        assert r["status"] in ("ok", "error", "timeout")
        if r["status"] == "ok":
            assert isinstance(r["reward"], (int, float)) and math.isfinite(r["reward"])
        else:
            assert r["reward"] is None


def test_protocol_validation_error_names_the_field(protocol_target):
    url, token = protocol_target
    resp = post(url, {"items": [{"response": "no id"}]}, token)
    assert resp.status_code == 422
    assert ["body", "items", 0, "id"] in [e["loc"] for e in resp.json()["detail"]]


def test_protocol_auth(protocol_target):
    url, token = protocol_target
    if not token:
        pytest.skip("service under test has no token")
    assert post(url, {"items": []}, None).status_code == 401
    assert post(url, {"items": []}, token + "-wrong").status_code == 401


def test_protocol_openapi(protocol_target):
    url, _ = protocol_target
    schema = httpx.get(url + "/openapi.json", timeout=5).json()
    assert "/v1/reward" in schema["paths"]


# ------------------------------------------------------------------ serve-reward behaviour
def test_per_item_errors_and_timeouts_do_not_touch_other_items(service):
    items = [{"id": "ok", "metadata": {"value": 0.25}}, {"id": "err", "metadata": {"raise": "bad input"}},
             {"id": "slow", "metadata": {"sleep_s": 3}}, {"id": "zero", "metadata": {"value": 0.0}}]
    started = time.monotonic()
    results = post(service.url, {"items": items}, TOKEN).json()["results"]
    assert time.monotonic() - started < 2.5  # the slow item is answered at its 0.5 s deadline
    by_id = {r["id"]: r for r in results}
    assert (by_id["ok"]["status"], by_id["ok"]["reward"], by_id["ok"]["metrics"]) == ("ok", 0.25, {"len_id": 2.0})
    assert by_id["err"]["status"] == "error" and "RuntimeError: bad input" in by_id["err"]["extra"]["error"]
    assert by_id["slow"]["status"] == "timeout" and by_id["slow"]["reward"] is None
    assert (by_id["zero"]["status"], by_id["zero"]["reward"]) == ("ok", 0.0)  # a wrong answer is a real 0


def test_client_check_and_score_against_the_service(service):
    async def main():
        good = RewardClient(service.url, token=TOKEN)
        await good.check()
        out = await asyncio.gather(*(good.score([RewardItem(id=f"s{k}", metadata={"value": k})]) for k in range(30)))
        await good.aclose()
        bad = RewardClient(service.url, token="nope", token_env="CONTRACT_TOKEN")
        with pytest.raises(AuthError, match="refused the token from environment variable 'CONTRACT_TOKEN'"):
            await bad.check()
        await bad.aclose()
        return out

    out = asyncio.run(main())
    assert [o[0].reward for o in out] == [float(k) for k in range(30)]


def test_batched_function_with_two_workers():
    with ServiceProcess(f"{THIS}:contract_batch", "--workers", "2") as svc:
        body = {"items": [{"id": c} for c in "abc"]}
        rewards = [r["reward"] for r in post(svc.url, body, None).json()["results"]]
        assert rewards == [0.0, 1.0, 2.0]


def test_module_form_of_the_example_from_the_repository_root():
    root = os.path.dirname(os.path.dirname(os.path.dirname(THIS)))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        svc = ServiceProcess("examples.custom_reward.reward:score").start()
    finally:
        os.chdir(cwd)
    try:
        body = {"items": [{"id": "a", "response": "Answer: 4", "ground_truth": "4"},
                          {"id": "b", "response": "Answer: 5", "ground_truth": "4"}]}
        assert [r["reward"] for r in post(svc.url, body, None).json()["results"]] == [1.0, 0.0]
    finally:
        svc.stop()


def test_bad_target_fails_before_binding(tmp_path):
    svc = ServiceProcess("no_such_module_xyz:score", startup_timeout_s=20)
    with pytest.raises(Exception, match="no module named 'no_such_module_xyz'"):
        svc.start()


# ------------------------------------------------------------------ Ray Serve (one test)
@pytest.mark.slow
def test_ray_serve_deployment_with_replicas(monkeypatch):
    pytest.importorskip("ray")
    import ray

    from relax_agent.reward_services.ray_serve import PATIENT_PROXY_ENV, serve_ray, shutdown

    monkeypatch.setenv("CONTRACT_TOKEN", TOKEN)
    for name in PATIENT_PROXY_ENV:  # unset here, so serve_ray's default applies and is undone after
        monkeypatch.delenv(name, raising=False)
    port = free_port()
    try:
        serve_ray(f"{THIS}:contract_score", port=port, replicas=2, num_cpus=2, token_env="CONTRACT_TOKEN",
                  blocking=False, timeout_s=0.5)
        url = f"http://127.0.0.1:{port}"

        async def main():
            client = RewardClient(url, token=TOKEN, micro_batching=False, max_concurrency=16)
            await client.check()
            batches = [[RewardItem(id=f"r{k}", metadata={"value": k, "sleep_s": 0.05})] for k in range(32)]
            out = await asyncio.gather(*(client.score(b) for b in batches))
            errs = await client.score([RewardItem(id="e", metadata={"raise": "x"}), RewardItem(id="t", metadata={"sleep_s": 2})])
            await client.aclose()
            return out, errs

        out, errs = asyncio.run(main())
        assert [o[0].reward for o in out] == [float(k) for k in range(32)]
        assert len({o[0].extra["pid"] for o in out}) == 2  # both replicas served
        assert [r.status for r in errs] == [RewardStatus.ERROR, RewardStatus.TIMEOUT]
        assert post(url, {"items": []}, "wrong").status_code == 401
        seen = ray.get(ray.remote(num_cpus=0)(lambda: {n: os.environ.get(n) for n in PATIENT_PROXY_ENV}).remote())
        assert seen == PATIENT_PROXY_ENV  # Ray's workers (the Serve controller's kind) got the patient proxy checks
    finally:
        shutdown()
