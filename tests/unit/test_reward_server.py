"""The FastAPI reward app, in process: routes, auth, validation errors, per-item failures."""

import asyncio

import httpx
import pytest

from relax_agent.reward_services import LocalReward, create_app


def score_fn(id, metadata):
    if metadata.get("raise"):
        raise ValueError("bad metadata")
    return float(metadata.get("value", 1.0))


async def call(app, method, path, token=None, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return await c.request(method, path, headers=headers, **kw)


@pytest.fixture
def app():
    return create_app(LocalReward(score_fn, timeout_s=1.0), token="s3cret", max_items=3)


def post(app, body, token="s3cret"):
    return asyncio.run(call(app, "POST", "/v1/reward", token=token, json=body))


def test_batch_scored_in_order_with_per_item_errors(app):
    body = {"items": [{"id": "a", "metadata": {"value": 0.25}}, {"id": "b", "metadata": {"raise": True}},
                      {"id": "c"}]}
    resp = post(app, body)
    assert resp.status_code == 200
    results = resp.json()["results"]
    assert [(r["id"], r["status"], r["reward"]) for r in results] == [("a", "ok", 0.25), ("b", "error", None), ("c", "ok", 1.0)]
    assert "ValueError: bad metadata" in results[1]["extra"]["error"]


def test_empty_batch_is_the_authenticated_noop(app):
    assert post(app, {"items": []}).json() == {"results": []}
    assert post(app, {"items": []}, token=None).status_code == 401
    resp = post(app, {"items": []}, token="wrong")
    assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"


def test_healthz_needs_no_token(app):
    resp = asyncio.run(call(app, "GET", "/healthz"))
    assert resp.status_code == 200 and resp.json() == {"status": "ok", "api_version": "v1"}


@pytest.mark.parametrize("body, field", [
    ({"items": [{"response": "x"}]}, "items.0.id: Field required"),
    ({"items": [{"id": "a", "metadata": 3}]}, "items.0.metadata: Input should be a valid dictionary"),
    ({"items": [{"id": "a", "score": 3}]}, "items.0.score: Extra inputs are not permitted"),
    ({"itms": []}, "items: Field required"),
    ({"items": [{"id": "a"}, {"id": "a"}]}, "items: Value error, duplicate item id 'a'"),
    ({"items": [{"id": str(i)} for i in range(4)]}, "items: at most 3 items per request, got 4"),
])
def test_validation_errors_name_the_field(app, body, field):
    resp = post(app, body)
    assert resp.status_code == 422
    assert field in resp.json()["message"]
    assert resp.json()["detail"]  # the standard FastAPI list stays


def test_openapi_schema_describes_the_protocol(app):
    schema = asyncio.run(call(app, "GET", "/openapi.json")).json()
    assert set(schema["paths"]) == {"/v1/reward", "/healthz"}
    item = schema["components"]["schemas"]["RewardItem"]
    assert set(item["properties"]) == {"id", "messages", "response", "ground_truth", "metadata"}
    result = schema["components"]["schemas"]["RewardResult"]
    assert set(result["properties"]) == {"id", "reward", "status", "metrics", "extra"}
    assert "HTTPBearer" in schema["components"]["securitySchemes"]


def test_no_token_means_open_service():
    open_app = create_app(LocalReward(score_fn))
    assert post(open_app, {"items": [{"id": "a"}]}, token=None).json()["results"][0]["reward"] == 1.0
