"""A custom reward function, ready to serve with ``relax-agent serve-reward``.

The policy must end its answer with ``Answer: <value>``; ``ground_truth`` is the value, or a
task dict holding it under ``"answer"`` (what training sends); the reward is 1 for the right
value, 0 for a wrong or missing one, minus 0.1 for an answer longer than
``metadata["max_chars"]`` (default 2000 characters).
"""

from __future__ import annotations

import re

from relax_agent.reward_services import RewardItem

_ANSWER = re.compile(r"answer\s*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


def score(item: RewardItem) -> dict:
    """Per-item reward: ``{"reward", "metrics", "extra"}``."""
    text = item.response_text()
    found = _ANSWER.findall(text)
    answer = found[-1].strip().rstrip(".") if found else None
    truth = item.ground_truth.get("answer") if isinstance(item.ground_truth, dict) else item.ground_truth
    correct = answer is not None and answer.lower() == str(truth).strip().lower()
    too_long = len(text) > int(item.metadata.get("max_chars", 2000))
    return {
        "reward": float(correct) - 0.1 * too_long,
        "metrics": {"correct": float(correct), "answer_found": float(answer is not None), "too_long": float(too_long)},
        "extra": {"answer": answer},
    }


async def score_batch(items: list[RewardItem]) -> list[dict]:
    """The same reward with the batched signature (one call per request; may be async)."""
    return [score(item) for item in items]
