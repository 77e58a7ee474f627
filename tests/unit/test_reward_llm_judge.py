"""LLM judge against a fake OpenAI-compatible server on 127.0.0.1."""

import asyncio
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from relax_agent.errors import ConfigError
from relax_agent.reward_services import LocalReward, RewardItem, RewardStatus
from relax_agent.reward_services.llm_judge import LLMJudge, parse_score
from relax_agent.reward_services.testing import ThreadServer


def fake_openai(seen: list) -> FastAPI:
    """Grades 'Paris' 9/10, anything else 2/10; 'mute' gets a reply without a score; 'crash' a 500."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append({**body, "auth": request.headers.get("authorization")})
        graded = body["messages"][-1]["content"].split("## Response to grade")[1]
        if "crash" in graded:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        text = "No opinion." if "mute" in graded else f"Reasoning here.\nScore: {9 if 'Paris' in graded else 2}"
        return {"id": "c1", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return app


@pytest.fixture(scope="module")
def judge_server():
    seen: list = []
    with ThreadServer(fake_openai(seen)) as server:
        yield server, seen


def test_judge_scores_and_masks_failures(judge_server, monkeypatch):
    server, seen = judge_server
    monkeypatch.setenv("JUDGE_KEY", "k-123")
    judge = LLMJudge(base_url=server.url + "/v1", model="judge-m", api_key_env="JUDGE_KEY", max_retries=0,
                     completion_kwargs={"seed": 7})
    reward = LocalReward(judge, timeout_s=10)
    question = [{"role": "user", "content": "Capital of France?"}]
    items = [RewardItem(id="good", messages=question, response="It is Paris.", ground_truth="Paris"),
             RewardItem(id="bad", messages=question, response="Lyon."),
             RewardItem(id="mute", messages=question, response="mute"),
             RewardItem(id="crash", messages=question, response="crash")]

    async def main():
        try:
            return await reward.score(items)
        finally:
            await reward.aclose()

    out = asyncio.run(main())
    assert [(r.status.value, r.reward) for r in out[:2]] == [("ok", 0.9), ("ok", 0.2)]
    assert out[0].metrics == {"judge_score": 9.0} and "Score: 9" in out[0].extra["judgement"]
    assert out[2].status is RewardStatus.ERROR and "no 'Score: N'" in out[2].extra["error"]
    assert out[3].status is RewardStatus.ERROR and "RewardServiceError" in out[3].extra["error"]
    req = next(r for r in seen if "It is Paris" in r["messages"][-1]["content"])
    assert req["model"] == "judge-m" and req["temperature"] == 0.0 and req["seed"] == 7
    assert req["auth"] == "Bearer k-123"
    assert "from 0\n(useless or wrong) to 10" in req["messages"][0]["content"]
    assert "## Reference answer\n\nParis" in req["messages"][1]["content"]
    assert "user: Capital of France?" in req["messages"][1]["content"]


def test_judge_as_a_factory_target(judge_server):
    server, _ = judge_server
    reward = LocalReward.from_target("relax_agent.reward_services.llm_judge:LLMJudge",
                                     {"base_url": server.url + "/v1", "model": "m"})
    out = asyncio.run(reward.score([RewardItem(id="a", response="Paris")]))
    assert out[0].ok and out[0].reward == pytest.approx(0.9)

@pytest.mark.parametrize("text, score", [("Score: 7", 7.0), ("score = 3.5\n", 3.5), ("Score: **8**", 8.0),
                                         ("Score: 4/5", 8.0), ("Score: 1\nrevised. Score: 6", 6.0)])
def test_parse_score(text, score):
    assert parse_score(text, 10.0) == score


def test_parse_score_errors_and_bad_config(monkeypatch):
    with pytest.raises(ValueError, match="no 'Score: N'"):
        parse_score("great answer", 10)
    with pytest.raises(ValueError, match="outside"):
        parse_score("Score: 11", 10)
    monkeypatch.delenv("NOPE_KEY", raising=False)
    with pytest.raises(ConfigError, match="NOPE_KEY"):
        LLMJudge(base_url="http://127.0.0.1:1/v1", model="m", api_key_env="NOPE_KEY")


def test_judge_survives_asyncio_run_per_step(judge_server):
    server, _ = judge_server
    reward = LocalReward(LLMJudge(base_url=server.url + "/v1", model="m"), max_concurrency=2)
    for _ in range(2):
        out = asyncio.run(reward.score([RewardItem(id=str(k), response="Paris") for k in range(4)]))
        assert [r.reward for r in out] == [0.9] * 4
