"""Reward protocol models: status/reward coupling, id rules, masking helpers."""

import math

import pytest
from pydantic import ValidationError

from relax_agent.reward_services import (
    RewardItem,
    RewardRequest,
    RewardResult,
    RewardStatus,
    reward_metrics,
    rewards_and_mask,
)


def test_ok_result_needs_a_finite_reward():
    with pytest.raises(ValidationError, match="finite number"):
        RewardResult(id="a")
    with pytest.raises(ValidationError, match="finite in float32"):
        RewardResult(id="a", reward=math.inf)
    assert RewardResult(id="a", reward=0).reward == 0.0


def test_failed_result_carries_no_reward():
    r = RewardResult(id="a", reward=0.0, status="error")
    assert r.reward is None and not r.ok
    f = RewardResult.failed("b", RewardStatus.TIMEOUT, "too slow")
    assert f.model_dump(mode="json") == {"id": "b", "reward": None, "status": "timeout", "metrics": {}, "extra": {"error": "too slow"}}


def test_request_refuses_duplicate_ids_and_unknown_fields():
    with pytest.raises(ValidationError, match="duplicate item id 'x'"):
        RewardRequest.model_validate({"items": [{"id": "x"}, {"id": "x"}]})
    with pytest.raises(ValidationError, match="reward_hint"):
        RewardItem.model_validate({"id": "x", "reward_hint": 1})
    with pytest.raises(ValidationError, match="id"):
        RewardItem.model_validate({"id": ""})


def test_response_text_and_tool_calls():
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    msg = RewardItem(id="a", response={"role": "assistant", "content": [{"type": "text", "text": "hi"}], "tool_calls": [call]})
    assert msg.response_text() == "hi" and msg.tool_calls() == [call]
    assert RewardItem(id="b", response="plain").response_text() == "plain"
    assert RewardItem(id="b", response="plain").tool_calls() == []


def test_rewards_and_mask_never_turn_failures_into_zero():
    results = [RewardResult(id="a", reward=0.0), RewardResult.failed("b", RewardStatus.ERROR, "x"),
               RewardResult(id="c", reward=1.0)]
    rewards, mask = rewards_and_mask(results)
    assert rewards[0] == 0.0 and math.isnan(rewards[1]) and rewards[2] == 1.0
    assert mask == [True, False, True]
    m = reward_metrics(results + [RewardResult.failed("d", RewardStatus.TIMEOUT, "x")])
    assert m == {"reward/status/ok": 2.0, "reward/status/error": 1.0, "reward/status/timeout": 1.0, "reward/mean_ok": 0.5}
