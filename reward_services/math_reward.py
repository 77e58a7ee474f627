"""Math answer verifier: is the response's final answer equal to the ground truth?

Built on Hugging Face's ``math-verify`` (https://github.com/huggingface/Math-Verify): the
answer is extracted from the response (``\\boxed{}`` first, then LaTeX / plain expressions)
and compared symbolically with the reference, so ``\\frac{1}{2}``, ``0.5`` and ``1/2`` match.

Use it as ``function: relax_agent.reward_services.math_reward:score`` (``source: local``) or
serve it: ``relax-agent serve-reward relax_agent.reward_services.math_reward:score``.
"""

from __future__ import annotations

import logging
from typing import Any

from relax_agent.errors import DataError
from relax_agent.reward_services.protocol import RewardItem

# math-verify warns once that its signal-based timeout is off; it must be off in worker
# threads, and the reward service applies its own per-item timeout instead.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def score(item: RewardItem) -> dict[str, Any]:
    """Reward 1.0 if the response's final answer equals ``ground_truth``, else 0.0.

    ``ground_truth`` is the reference answer: a string (LaTeX with or without ``$``) or a
    number. Metrics: ``correct`` (0/1), ``answer_found`` (0/1: an answer was extracted).
    ``extra["answer"]`` is the extracted answer.

    Raises:
        DataError: ``ground_truth`` is missing or holds no parseable answer (a data bug: the
            item becomes ``status: error``, not a wrong answer).
    """
    from math_verify import parse, verify

    gold = parse(_as_latex(item.ground_truth, item.id), parsing_timeout=None)
    if not gold:
        raise DataError(f"item {item.id!r}: ground_truth {item.ground_truth!r} holds no parseable math answer")
    answer = parse(item.response_text(), parsing_timeout=None)
    correct = bool(answer) and verify(gold, answer, timeout_seconds=None)
    return {
        "reward": 1.0 if correct else 0.0,
        "metrics": {"correct": float(correct), "answer_found": float(bool(answer))},
        "extra": {"answer": answer[-1] if answer else None},
    }


def _as_latex(ground_truth: Any, item_id: str) -> str:
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)) or ground_truth == "":
        raise DataError(f"item {item_id!r}: ground_truth must be an answer string or number, got {ground_truth!r}")
    text = str(ground_truth).strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"
