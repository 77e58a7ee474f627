"""Math answer verifier on math-verify."""

import asyncio

import pytest

from relax_agent.errors import DataError
from relax_agent.reward_services import LocalReward, RewardItem, RewardStatus
from relax_agent.reward_services.math_reward import score


@pytest.mark.parametrize("response, truth, reward", [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so x = 1/2", "\\frac{1}{2}", 1.0),
    ("We get $\\sqrt{18}$.", "3\\sqrt{2}", 1.0),
    ("Final answer: $1 + x^2$", "x^2+1", 1.0),
    ("Final answer: 41", 42, 0.0),
    ("I do not know", "42", 0.0),
])
def test_equivalent_answers_match(response, truth, reward):
    out = score(RewardItem(id="a", response=response, ground_truth=truth))
    assert out["reward"] == reward and out["metrics"]["correct"] == reward


def test_reads_the_assistant_message_content():
    out = score(RewardItem(id="a", response={"role": "assistant", "content": "\\boxed{7}"}, ground_truth="7"))
    assert out["reward"] == 1.0 and out["extra"]["answer"] == "7"


def test_no_answer_found_is_a_wrong_answer_not_an_error():
    out = score(RewardItem(id="a", response="no idea", ground_truth="7"))
    assert out["reward"] == 0.0 and out["metrics"]["answer_found"] == 0.0


def test_bad_ground_truth_is_a_data_error_and_masks_the_item():
    with pytest.raises(DataError, match="ground_truth must be an answer"):
        score(RewardItem(id="a", response="1", ground_truth=None))
    out = asyncio.run(LocalReward(score).score([RewardItem(id="a", response="1", ground_truth={"x": 1})]))
    assert out[0].status is RewardStatus.ERROR and "DataError" in out[0].extra["error"]


def test_runs_in_worker_threads_of_the_service():
    reward = LocalReward.from_target("relax_agent.reward_services.math_reward:score")
    items = [RewardItem(id=str(k), response=f"\\boxed{{{k}}}", ground_truth=str(k % 3)) for k in range(6)]
    out = asyncio.run(reward.score(items))
    assert [r.reward for r in out] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
