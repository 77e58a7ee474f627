"""BFCL reward: the BFCL checker wrapped as a reward function (ground_truth is the task)."""

import asyncio
import json

import pytest

from relax_agent.errors import ConfigError
from relax_agent.reward_services import LocalReward, RewardItem, RewardStatus
from relax_agent.reward_services.bfcl_reward import BFCLReward, score

TASK = {
    "id": "simple_0", "category": "simple_python",
    "functions": [{"name": "math.factorial", "description": "n!",
                   "parameters": {"type": "dict", "properties": {"number": {"type": "integer"}}, "required": ["number"]}}],
    "possible_answer": [{"math.factorial": {"number": [5]}}],
}


def message(name, arguments):
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


@pytest.mark.parametrize("response, reward, correct, well_formed", [
    (message("math.factorial", {"number": 5}), 1.0, 1.0, 1.0),
    (message("math.factorial", json.dumps({"number": 5})), 1.0, 1.0, 1.0),  # JSON-string arguments
    (message("math.factorial", {"number": 6}), 0.1, 0.0, 1.0),  # well-formed, wrong value
    (message("math.gamma", {"number": 5}), 0.0, 0.0, 0.0),  # unknown function
    ("The factorial of 5 is 120.", 0.0, 0.0, 0.0),  # text only: no call
])
def test_bfcl_reward_matches_the_checker(response, reward, correct, well_formed):
    out = score(RewardItem(id="a", response=response, ground_truth=TASK))
    assert out["reward"] == reward
    assert out["metrics"]["correct"] == correct and out["metrics"]["well_formed"] == well_formed


def test_partial_credit_and_irrelevance():
    wrong = RewardItem(id="a", response=message("math.factorial", {"number": 6}), ground_truth=TASK)
    assert BFCLReward(partial_credit=0.3)(wrong)["reward"] == 0.3
    irrelevant = {**TASK, "possible_answer": []}
    assert score(RewardItem(id="b", response="None of the tools fit.", ground_truth=irrelevant))["reward"] == 1.0
    with pytest.raises(ConfigError, match="partial_credit"):
        BFCLReward(partial_credit=2.0)


def test_served_through_local_reward_with_a_bad_ground_truth_masked():
    reward = LocalReward.from_target("relax_agent.reward_services.bfcl_reward:BFCLReward", {"partial_credit": 0.2})
    out = asyncio.run(reward.score([
        RewardItem(id="ok", response=message("math.factorial", {"number": 5}), ground_truth=TASK),
        RewardItem(id="no-task", response=message("math.factorial", {"number": 5}), ground_truth="simple_0"),
    ]))
    assert out[0].reward == 1.0 and out[0].extra == {"reason": "ok"}
    assert out[1].status is RewardStatus.ERROR and "must be a BFCL task dict" in out[1].extra["error"]
