"""Custom environments registered from outside the package.

``examples/Units-v0`` is the one to copy: a multi-turn tool env built on
:class:`relax_agent.envs.ToolEnv`, where the tool is a plain Python function (its JSON schema
comes from the type hints and the docstring). ``examples/Echo-v0`` is the smallest possible
:class:`relax_agent.envs.TextEnv` (single turn, no tools; the CLI smoke tests train on it).

Use them with ``env.id: examples.custom_env:examples/Units-v0`` in a run config (the module is
imported, from the working directory too, before the id is looked up; see
``examples/custom_env.yaml``), or ``import examples.custom_env`` and
``gymnasium.make("examples/Units-v0")``. Check your own env with the contract suite::

    from relax_agent.envs.testing import run_contract
    assert run_contract(lambda: gymnasium.make("examples/Units-v0")) == {}
"""

from __future__ import annotations

import difflib
import hashlib
import random
import re

import numpy as np

from relax_agent.envs import TextEnv, ToolEnv, register

# ---------------------------------------------------------------- examples/Units-v0
TO_BASE = {  # unit -> (dimension, size in the dimension's base unit)
    "m": ("length", 1.0), "km": ("length", 1000.0), "ft": ("length", 0.3048), "mi": ("length", 1609.344),
    "in": ("length", 0.0254), "kg": ("mass", 1.0), "g": ("mass", 0.001), "lb": ("mass", 0.45359237),
    "oz": ("mass", 0.028349523125), "s": ("time", 1.0), "min": ("time", 60.0), "h": ("time", 3600.0),
    "day": ("time", 86400.0),
}


def convert(value: float, from_unit: str, to_unit: str) -> float:
    """Convert a quantity between units of the same dimension (length, mass or time).

    Args:
        value: The quantity in from_unit.
        from_unit: One of m, km, ft, mi, in, kg, g, lb, oz, s, min, h, day.
        to_unit: The unit to convert to (same dimension as from_unit).
    """
    (dim_a, size_a), (dim_b, size_b) = TO_BASE[from_unit], TO_BASE[to_unit]  # KeyError -> tool error message
    if dim_a != dim_b:
        raise ValueError(f"cannot convert {dim_a} ({from_unit}) to {dim_b} ({to_unit})")
    return round(value * size_a / size_b, 6)


class UnitsEnv(ToolEnv):
    """Questions like "How many ft are in 3.5 km?" with a ``convert`` tool; reward by relative error of the answer.

    Args:
        num_tasks: tasks generated from a fixed seed (one in five held out, by task id).
        tool_timeout_s: see :class:`ToolEnv`.
    """

    reward_description = ("1.0 when the final answer ('Answer: <number>') is within 0.5% of the exact "
                          "conversion, 0.1 for any other number, 0.0 without a number")

    def __init__(self, num_tasks: int = 400, tool_timeout_s: float = 2.0):
        super().__init__(tools=[convert], max_tool_calls_per_turn=2, max_observation_chars=200,
                         tool_timeout_s=tool_timeout_s)
        rng, self._tasks = random.Random(7), []
        for _ in range(num_tasks):
            dimension = rng.choice(["length", "mass", "time"])
            a, b = rng.sample([u for u, (dim, _) in TO_BASE.items() if dim == dimension], 2)
            value = round(rng.uniform(0.5, 500.0), 1)
            question = f"How many {b} are in {value} {a}?"
            task_id = "units-" + hashlib.sha1(question.encode()).hexdigest()[:10]
            self._tasks.append({"id": task_id, "question": question, "answer": convert(value, a, b)})

    def tasks(self, split: str = "train") -> list[dict]:
        held = [t for t in self._tasks if int(t["id"][-2:], 16) % 5 == 0]
        return held if split == "heldout" else [t for t in self._tasks if t not in held]

    def prompt(self, task):
        return [{"role": "user", "content": f"{task['question']} Use the convert tool, then reply 'Answer: <number>'."}]

    def score(self, message):
        found = re.findall(r"-?\d+(?:\.\d+)?", message.get("content") or "")
        if not found:
            return 0.0, {"correct": 0.0}
        exact = self.task["answer"]
        correct = abs(float(found[-1]) - exact) <= 0.005 * abs(exact)
        return (1.0 if correct else 0.1), {"correct": float(correct)}


register(id="examples/Units-v0", entry_point=UnitsEnv, max_episode_steps=4)


# ---------------------------------------------------------------- examples/Echo-v0

WORDS = ["apple", "river", "orange", "planet", "garden", "silver", "window", "yellow",
         "forest", "rocket", "candle", "pencil", "bridge", "island", "mirror", "button"]


class EchoEnv(TextEnv):
    """Single-turn: "Repeat exactly: WORD" -> reward = similarity(reply, WORD)."""

    reward_description = "difflib similarity ratio between the reply and the requested word, in [0, 1]"

    def __init__(self, num_tasks: int = 64):
        super().__init__()
        rng = np.random.default_rng(1234)
        self._tasks = [{"id": f"echo-{i}", "word": str(rng.choice(WORDS))} for i in range(num_tasks)]

    def tasks(self, split: str = "train") -> list[dict]:
        cut = len(self._tasks) * 3 // 4
        return self._tasks[:cut] if split == "train" else self._tasks[cut:]

    def _reset_task(self, task):
        return [{"role": "user", "content": f"Repeat exactly: {task['word']}"}], {"tools": []}

    def step(self, action):
        reply = (action.get("content") or "").strip().lower()
        score = difflib.SequenceMatcher(None, reply, self.task["word"]).ratio()
        return [], score, True, False, {"correct": float(reply == self.task["word"])}


register(id="examples/Echo-v0", entry_point=EchoEnv)
