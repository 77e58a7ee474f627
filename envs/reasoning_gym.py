"""``relax/ReasoningGym-v0``: any `reasoning-gym <https://github.com/open-thought/reasoning-gym>`_
dataset as a single-answer environment.

    env = gymnasium.make("relax/ReasoningGym-v0", dataset="leg_counting", size=500, seed=0)
    messages, info = env.reset(seed=0)                        # the dataset's question
    env.step({"role": "assistant", "content": "... <answer>42</answer>"})   # reward: score_answer

The dataset is built with ``reasoning_gym.create_dataset(dataset, size=size, seed=seed, **config)``
(extra keyword arguments are the dataset's config, e.g. ``min_animals=3``). The answer is the text
inside the last ``<answer>...</answer>`` of the final message (else after the last ``Answer:``);
the reward is the dataset's own ``score_answer`` (in [0, 1], partial credit where the dataset
gives it). A task is held out when the SHA-1 of its question falls below ``heldout_fraction``;
repeated questions are dropped, so the splits are disjoint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from typing import Any

from relax_agent.envs.bfcl.data import check_split_args, split_tasks
from relax_agent.envs.tool_env import ToolEnv
from relax_agent.errors import ConfigError, DataError

ENV_ID = "relax/ReasoningGym-v0"
INSTRUCTION = "Think it through, then give only the final answer inside <answer></answer> tags."


@functools.lru_cache(maxsize=8)
def _build(dataset: str, size: int, seed: int, config_json: str) -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ConfigError(f"{ENV_ID} needs the reasoning-gym package: pip install 'relax-agent[reasoning]' ({exc})") from exc
    try:
        return reasoning_gym.create_dataset(dataset, size=size, seed=seed, **json.loads(config_json))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"reasoning-gym dataset {dataset!r} with config {config_json}: {exc}") from exc


def extract_answer(text: str) -> str | None:
    """The last ``<answer>...</answer>`` content of ``text``, else what follows the last ``Answer:``."""
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S | re.I)
    if tagged:
        return tagged[-1].strip()
    plain = re.findall(r"answer\s*:\s*(.+)", text, flags=re.I)
    return plain[-1].strip() if plain else None


class ReasoningGymEnv(ToolEnv):
    """One reasoning-gym dataset entry per episode; one answer, scored by the dataset.

    Args:
        dataset: a reasoning-gym dataset name (``reasoning_gym.factory.DATASETS``).
        size: entries generated (both splits together, before dropping repeated questions).
        seed: generator seed of the dataset.
        split: the split ``reset`` draws from when no task is given ("train" or "heldout").
        heldout_fraction: share of tasks held out, in [0, 1].
        **config: the dataset's config fields.

    Raises:
        ConfigError: unknown dataset, a config field the dataset does not take, or an
            argument outside the values above.
    """

    reward_description = (
        "the dataset's score_answer(answer, entry) in [0, 1] (1.0 for the exact answer; some datasets "
        "give partial credit), where the answer is the last <answer>...</answer> of the final message "
        "(else the text after the last 'Answer:'); 0.0 without an answer."
    )

    def __init__(self, dataset: str = "basic_arithmetic", size: int = 500, seed: int = 0, split: str = "train",
                 heldout_fraction: float = 0.2, **config: Any) -> None:
        super().__init__(tools=())
        if size < 1:
            raise ConfigError(f"size={size!r}; expected a positive integer")
        check_split_args(split, heldout_fraction)
        self.dataset_name, self.split, self.heldout_fraction = dataset, split, heldout_fraction
        self.dataset = _build(dataset, size, seed, json.dumps(config, sort_keys=True))
        self._tasks = self._make_tasks()

    def _make_tasks(self) -> list[dict[str, Any]]:
        tasks, seen = [], set()
        for index in range(len(self.dataset)):
            entry = self.dataset[index]
            digest = hashlib.sha1(entry["question"].encode()).hexdigest()[:12]
            if digest in seen:
                continue
            seen.add(digest)
            tasks.append({"id": f"{self.dataset_name}-{digest}", "index": index, "question": entry["question"],
                          "answer": None if entry["answer"] is None else str(entry["answer"])})
        return tasks

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """``{"id", "index", "question", "answer"}`` dicts of ``split``.

        Raises:
            DataError: unknown split.
        """
        return split_tasks(self._tasks, split, self.heldout_fraction)

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The user message: the dataset entry's question and the answer-format instruction.

        Raises:
            DataError: the task's ``index`` is missing or outside the dataset.
        """
        if not isinstance(task.get("index"), int) or not 0 <= task["index"] < len(self.dataset):
            raise DataError(f"ReasoningGym task needs an 'index' into the {len(self.dataset)}-entry dataset, got {task.get('index')!r}")
        return [{"role": "user", "content": f"{task['question']}\n\n{INSTRUCTION}"}]

    def score(self, message: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """The dataset's own score of the extracted answer (0.0 when not finite); info ``correct`` (score 1.0)
        and ``answered``."""
        answer = extract_answer(message.get("content") or "")
        score = float(self.dataset.score_answer(answer, self.dataset[self.task["index"]]))
        score = score if math.isfinite(score) else 0.0
        return score, {"correct": float(score == 1.0), "answered": float(answer is not None)}


def available() -> list[str]:
    """Every reasoning-gym dataset name (``env.id: "reasoning_gym:<name>"``).

    Raises:
        ConfigError: reasoning-gym is not installed (naming the extra).
    """
    from relax_agent.envs.bridges import require

    require("reasoning_gym")
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def register() -> None:
    """Register ``relax/ReasoningGym-v0`` (default dataset ``basic_arithmetic``)."""
    from relax_agent.envs import register as register_env

    register_env(id=ENV_ID, entry_point="relax_agent.envs.reasoning_gym:ReasoningGymEnv")
