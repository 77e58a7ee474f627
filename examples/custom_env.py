"""A custom environment registered from outside the package.

Use it with ``env.id: examples.custom_env:examples/Echo-v0`` (gymnasium imports the module
before the lookup), or ``import examples.custom_env`` and ``gymnasium.make("examples/Echo-v0")``.

The task: the user asks the policy to repeat a word; the reward is the character-level
similarity of the reply to that word (difflib ratio in [0, 1]), so even an untrained policy
gets a graded signal.
"""

from __future__ import annotations

import difflib

import numpy as np

from relax_agent.envs import TextEnv, register

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
