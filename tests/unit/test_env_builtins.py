"""relax/Calculator-v0 and relax/ReasoningGym-v0: tasks, splits, tools, rewards, limits."""

from __future__ import annotations

import ast
import operator

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401
from relax_agent.envs.calculator import LEVELS, CalculatorEnv, make_tasks
from relax_agent.envs.reasoning_gym import ReasoningGymEnv, extract_answer
from relax_agent.envs.testing import tool_call
from relax_agent.errors import ConfigError, DataError

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node):
    """Exact value of an expression tree, independent of the generator's own arithmetic."""
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    return _OPS[type(node.op)](_value(node.left), _value(node.right))


@pytest.mark.parametrize("difficulty", sorted(LEVELS))
def test_calculator_tasks_have_exact_integer_answers(difficulty):
    tasks = make_tasks(difficulty, 300, 0)
    level = LEVELS[difficulty]
    assert len({t["expression"] for t in tasks}) == len(tasks) == 300
    for t in tasks:
        value = _value(ast.parse(t["expression"], mode="eval"))
        assert value == t["answer"] and float(value).is_integer()
        numbers = [n.value for n in ast.walk(ast.parse(t["expression"])) if isinstance(n, ast.Constant)]
        assert 2 <= len(numbers) <= level.operands
        used = {type(n.op) for n in ast.walk(ast.parse(t["expression"])) if isinstance(n, ast.BinOp)}
        assert used <= {k for k, sym in zip(_OPS, "+-*/", strict=True) if sym in level.ops}
    assert make_tasks(difficulty, 300, 0) == tasks and make_tasks(difficulty, 300, 1) != tasks


def test_calculator_difficulty_grows():
    mean_ops = [sum(t["expression"].count(" ") for t in make_tasks(d, 200, 0)) / 200 for d in sorted(LEVELS)]
    assert mean_ops == sorted(mean_ops) and mean_ops[0] == 2 and mean_ops[-1] > 8


def test_calculator_splits_are_disjoint_and_seeded():
    env = CalculatorEnv(difficulty=3, num_tasks=500)
    train, held = env.tasks("train"), env.tasks("heldout")
    assert len(train) + len(held) == 500 and 25 <= len(held) <= 80
    assert not {t["expression"] for t in train} & {t["expression"] for t in held}
    with pytest.raises(DataError):
        env.tasks("test")
    for bad in ({"difficulty": 9}, {"num_tasks": 0}, {"split": "dev"}, {"heldout_fraction": 2}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            CalculatorEnv(**bad)


def test_calculator_episode_with_tools_and_answer():
    env = gymnasium.make("relax/Calculator-v0", difficulty=2)
    task = {"id": "t", "question": "Compute 6 * (3 + 4).", "expression": "6 * (3 + 4)", "answer": 42}
    obs, info = env.reset(options={"task": task})
    assert obs[0]["content"].startswith("Compute 6 * (3 + 4).") and "Answer:" in obs[0]["content"]
    assert [t["function"]["name"] for t in info["tools"]] == ["add", "subtract", "multiply", "divide"]
    obs, reward, terminated, *_ = env.step(tool_call("add", {"a": 3, "b": 4}))
    assert obs[0]["content"] == "7" and (reward, terminated) == (0.0, False)
    obs, *_ = env.step(tool_call("divide", {"a": 1, "b": 0}))
    assert obs[0]["content"] == "error: ZeroDivisionError: division by zero"
    assert env.step(tool_call("divide", {"a": 7, "b": 2}))[0][0]["content"] == "3.5"
    _, reward, terminated, truncated, info = env.step({"role": "assistant", "content": "So the Answer: 42"})
    assert (reward, terminated, truncated, info["correct"], info["tool_calls"]) == (1.0, True, False, 1.0, 3.0)
    env.reset(options={"task": task})
    assert env.step({"role": "assistant", "content": "Answer: 41"})[1] == 0.0


def test_calculator_truncates_at_max_episode_steps():
    env = gymnasium.make("relax/Calculator-v0")
    assert env.spec.max_episode_steps == 8
    env.reset(seed=0)
    for _ in range(7):
        assert env.step(tool_call("add", {"a": 1, "b": 1}))[3] is False
    assert env.step(tool_call("add", {"a": 1, "b": 1}))[3] is True


def test_reasoning_gym_bridge_scores_with_the_dataset():
    env = gymnasium.make("relax/ReasoningGym-v0", dataset="leg_counting", size=60, seed=3, min_animals=2, max_animals=2)
    inner = env.unwrapped
    train, held = inner.tasks("train"), inner.tasks("heldout")
    assert train and held and not {t["id"] for t in train} & {t["id"] for t in held}
    task = train[0]
    entry = inner.dataset[task["index"]]
    assert entry["question"] == task["question"] and len(entry["metadata"]["animals"]) == 2
    obs, info = env.reset(options={"task": task})
    assert obs[0]["content"].startswith(task["question"]) and info["tools"] == []
    _, reward, terminated, _, info = env.step({"role": "assistant", "content": f"so <answer>{task['answer']}</answer>"})
    assert (reward, terminated, info["correct"]) == (1.0, True, 1.0)
    env.reset(options={"task": task})
    assert env.step({"role": "assistant", "content": "I don't know"})[1] == 0.0


def test_reasoning_gym_bad_config_names_the_dataset():
    with pytest.raises(ConfigError, match="'no_such_dataset'"):
        ReasoningGymEnv(dataset="no_such_dataset")
    with pytest.raises(ConfigError, match="bogus"):
        ReasoningGymEnv(dataset="leg_counting", bogus=1)
    env = ReasoningGymEnv(dataset="leg_counting", size=10)
    with pytest.raises(DataError, match="index"):
        env.reset(options={"task": {"id": "x", "question": "q"}})


@pytest.mark.parametrize("text, answer", [
    ("<answer> 12 </answer>", "12"), ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("Answer: blue", "blue"), ("nothing", None)])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer
