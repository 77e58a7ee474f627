"""``relax/Calculator-v0``: procedural arithmetic with four calculator tools.

    env = gymnasium.make("relax/Calculator-v0", difficulty=2)
    messages, info = env.reset(seed=0)         # "Compute 37 - 4 * 12 ..."; info["tools"]: add, subtract, ...
    obs, *_ = env.step({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": {"a": 4, "b": 12}}}]})
    # obs: [{"role": "tool", "tool_call_id": "c1", "name": "multiply", "content": "48"}]
    env.step({"role": "assistant", "content": "Answer: -11"})      # reward 1.0 if right; episode ends

Tasks are random expression trees over integers, generated from ``seed``; the answer is always
an integer (a division's dividend is a multiple of its divisor's value). ``difficulty`` picks the
number of operands, the digits per operand and the operators (see :data:`LEVELS`). A task is held
out when the SHA-1 of its id (the expression's hash) falls below ``heldout_fraction``, so the two
splits never share an expression.
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass
from typing import Any

from relax_agent.envs.bfcl.data import check_split_args, split_tasks
from relax_agent.envs.python_exec import parse_answer
from relax_agent.envs.tool_env import ToolEnv
from relax_agent.errors import ConfigError, DataError

ENV_ID = "relax/Calculator-v0"
INSTRUCTION = "Use the calculator tools for each operation, then reply with a final line 'Answer: <integer>'."


@dataclass(frozen=True)
class Level:
    """One difficulty level: ``operands`` numbers of 1..``max_digits`` digits joined by ``ops``."""

    operands: int
    max_digits: int
    ops: str


LEVELS: dict[int, Level] = {
    1: Level(2, 2, "+-"),
    2: Level(3, 2, "+-*"),
    3: Level(4, 2, "+-*/"),
    4: Level(5, 3, "+-*/"),
    5: Level(6, 4, "+-*/"),
}
"""Difficulty -> level. Operator precedence is the usual one; sub-expressions are parenthesised."""


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return _tidy(a + b)


def subtract(a: float, b: float) -> float:
    """Subtract b from a.

    Args:
        a: The number to subtract from.
        b: The number to subtract.
    """
    return _tidy(a - b)


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return _tidy(a * b)


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor (not zero).
    """
    return _tidy(a / b)


def _tidy(x: float) -> float:
    """Integral floats as ints (``48`` rather than ``48.0``), others rounded to 10 places."""
    return int(x) if float(x).is_integer() else round(x, 10)


TOOLS = (add, subtract, multiply, divide)


def _number(rng: random.Random, max_digits: int) -> int:
    return rng.randint(1, 10 ** rng.randint(1, max_digits) - 1)


def _expression(rng: random.Random, operands: int, level: Level) -> tuple[str, int]:
    """A random expression over ``operands`` integers and its exact integer value."""
    if operands == 1:
        n = _number(rng, level.max_digits)
        return str(n), n
    op = rng.choice(level.ops)
    left_n = 1 if op == "/" else rng.randint(1, operands - 1)
    right, rv = _expression(rng, operands - left_n, level)
    if op == "/" and rv == 0:
        op = "+"
    if op == "/":  # the dividend is a literal multiple of the divisor's value: exact division
        lv = rv * rng.randint(1, 12)
        left = str(lv)
    else:
        left, lv = _expression(rng, left_n, level)
    value = {"+": lv + rv, "-": lv - rv, "*": lv * rv}[op] if op != "/" else lv // rv
    return f"{_wrap(left, left_n)} {op} {_wrap(right, operands - left_n)}", value


def _wrap(text: str, operands: int) -> str:
    return f"({text})" if operands > 1 else text


@functools.lru_cache(maxsize=16)
def make_tasks(difficulty: int, num_tasks: int, seed: int) -> tuple[dict[str, Any], ...]:
    """``num_tasks`` distinct tasks ``{"id", "question", "expression", "answer", "difficulty"}``.

    Deterministic in ``(difficulty, num_tasks, seed)``; cached (do not mutate the dicts).
    """
    level, rng = LEVELS[difficulty], random.Random(f"calculator-{difficulty}-{seed}")
    tasks: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(num_tasks * 20):
        if len(tasks) == num_tasks:
            break
        text, value = _expression(rng, level.operands, level)
        if text in seen:
            continue
        seen.add(text)
        digest = hashlib.sha1(text.encode()).hexdigest()[:12]
        tasks.append({"id": f"calc-{difficulty}-{digest}", "question": f"Compute {text}.", "expression": text,
                      "answer": value, "difficulty": difficulty})
    return tuple(tasks)


class CalculatorEnv(ToolEnv):
    """Arithmetic with ``add``/``subtract``/``multiply``/``divide`` tools; reward 1 for the right integer.

    Args:
        difficulty: 1..5, see :data:`LEVELS`.
        num_tasks: tasks generated (both splits together; fewer when the level has fewer
            distinct expressions).
        seed: seed of the task generator (episodes are seeded through ``reset(seed=...)``).
        split: the split ``reset`` draws from when no task is given ("train" or "heldout").
        heldout_fraction: share of tasks held out, in [0, 1].
        max_tool_calls_per_turn / max_observation_chars / tool_timeout_s: see :class:`ToolEnv`.

    Raises:
        ConfigError: an argument outside the values above.
    """

    reward_description = (
        "1.0 when the final assistant message (one without tool calls) states the expression's "
        "integer value ('Answer: N', else \\boxed{N}, else the last integer in the message); else 0.0. "
        "Tool calls earn nothing by themselves; a failing tool call returns an 'error: ...' tool message."
    )

    def __init__(self, difficulty: int = 1, num_tasks: int = 1000, seed: int = 0, split: str = "train",
                 heldout_fraction: float = 0.1, max_tool_calls_per_turn: int = 4,
                 max_observation_chars: int = 200, tool_timeout_s: float = 5.0) -> None:
        super().__init__(tools=TOOLS, max_tool_calls_per_turn=max_tool_calls_per_turn,
                         max_observation_chars=max_observation_chars, tool_timeout_s=tool_timeout_s)
        if difficulty not in LEVELS:
            raise ConfigError(f"difficulty={difficulty!r}; expected one of {sorted(LEVELS)}")
        if num_tasks < 1:
            raise ConfigError(f"num_tasks={num_tasks!r}; expected a positive integer")
        check_split_args(split, heldout_fraction)
        self.difficulty, self.num_tasks, self.seed = difficulty, num_tasks, seed
        self.split, self.heldout_fraction = split, heldout_fraction

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Task dicts of ``split`` (see :func:`make_tasks`).

        Raises:
            DataError: unknown split.
        """
        return split_tasks(list(make_tasks(self.difficulty, self.num_tasks, self.seed)), split, self.heldout_fraction)

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The user message: the question and the tool-use instruction.

        Raises:
            DataError: the task lacks ``question`` or ``answer``.
        """
        if "question" not in task or "answer" not in task:
            raise DataError(f"Calculator task needs 'question' and 'answer', got keys {sorted(task)}")
        return [{"role": "user", "content": f"{task['question']}\n{INSTRUCTION}"}]

    def score(self, message: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """Reward 1.0 when the reply's integer (:func:`parse_answer`) equals the task's answer; info ``correct``
        and ``answered``."""
        answer = parse_answer(message.get("content") or "")
        correct = answer is not None and answer == int(self.task["answer"])
        return float(correct), {"correct": float(correct), "answered": float(answer is not None)}


def register() -> None:
    """Register ``relax/Calculator-v0`` (at most 8 steps per episode, then truncated)."""
    from relax_agent.envs import register as register_env

    register_env(id=ENV_ID, entry_point="relax_agent.envs.calculator:CalculatorEnv", max_episode_steps=8)
