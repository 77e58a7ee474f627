"""BFCL function-calling reward: the BFCL AST checker as a reward function.

``ground_truth`` is the BFCL task dict (from :func:`relax_agent.envs.bfcl.data.load_tasks`:
its ``functions`` and ``possible_answer`` are used); ``response`` is the assistant message
with OpenAI-format ``tool_calls`` (and the parser's ``parse_errors`` / ``rejected_calls``). A text
response holds no call (right only for an irrelevance task). The verdict is
:func:`relax_agent.envs.bfcl.decode.judge_message`, the one the single-turn env gives, the
reward :func:`relax_agent.envs.bfcl.checker.reward` (1 correct, ``partial_credit`` for a
well-formed wrong call, 0 otherwise).

Targets: ``relax_agent.reward_services.bfcl_reward:score`` (partial credit 0.1) or
``relax_agent.reward_services.bfcl_reward:BFCLReward`` with ``kwargs: {partial_credit: 0.2}``.
"""

from __future__ import annotations

from typing import Any

from relax_agent.errors import ConfigError, DataError
from relax_agent.reward_services.protocol import RewardItem


class BFCLReward:
    """Scores one item with the BFCL checker.

    Args:
        partial_credit: reward for well-formed but wrong calls, in [0, 1].
        bfcl_compat: judge with BFCL's greedy pairing and tuple rule, as ``BFCLEnv(bfcl_compat=True)``
            does (see :mod:`relax_agent.envs.bfcl.checker`); give it the env's value so both agree.

    Raises:
        ConfigError: ``partial_credit`` outside [0, 1].
    """

    def __init__(self, partial_credit: float = 0.1, bfcl_compat: bool = False):
        if not 0.0 <= partial_credit <= 1.0:
            raise ConfigError(f"partial_credit={partial_credit!r}; expected a number in [0, 1]")
        self.partial_credit = partial_credit
        self.bfcl_compat = bfcl_compat

    def __call__(self, item: RewardItem) -> dict[str, Any]:
        """``{"reward", "metrics": {correct, well_formed, num_calls}, "extra": {"reason"}}``.

        Raises:
            DataError: ``ground_truth`` is not a BFCL task dict (the item becomes status error).
        """
        from relax_agent.envs.bfcl.checker import reward
        from relax_agent.envs.bfcl.decode import judge_message

        task = item.ground_truth
        if not isinstance(task, dict) or "possible_answer" not in task or "functions" not in task:
            got = sorted(task) if isinstance(task, dict) else type(task).__name__
            raise DataError(f"item {item.id!r}: ground_truth must be a BFCL task dict with 'functions' and "
                            f"'possible_answer', got {got}")
        message = item.response if isinstance(item.response, dict) else {"role": "assistant", "content": ""}
        result, num_calls = judge_message(message, task, bfcl_compat=self.bfcl_compat)
        return {
            "reward": reward(result, self.partial_credit),
            "metrics": {"correct": float(result.correct), "well_formed": float(result.well_formed),
                        "num_calls": float(num_calls)},
            "extra": {"reason": result.reason},
        }


score = BFCLReward()
"""The BFCL reward with the default partial credit (0.1)."""
