"""Shared parts of the built-in media envs: tools that return content parts, procedural splits.

:class:`MediaToolEnv` is a :class:`~relax_agent.envs.ToolEnv` whose tools may return a list of
content parts (text, image, audio): the tool message then carries those parts as its content,
so a zoom or crop tool hands the policy an image; a plain return value is text as usual.
Its ``demonstration(task)`` is the reference final reply a supervised warm-up learns.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any

from relax_agent.envs.bfcl.data import check_split_args, split_tasks
from relax_agent.envs.spaces import is_message
from relax_agent.envs.tool_env import ToolEnv
from relax_agent.errors import ConfigError, DataError

_MEDIA_RESULT = "\ue010media-result:"


class MediaToolEnv(ToolEnv):
    """A ToolEnv with procedural tasks (``make_tasks(difficulty, num_tasks, seed)``) split by id hash,
    whose tools may return content parts.

    Args:
        tools: see :class:`ToolEnv`.
        difficulty: a key of the subclass's ``LEVELS``.
        num_tasks: tasks generated (both splits together).
        seed: task generator seed.
        split: the split ``reset`` draws from when no task is given.
        heldout_fraction: share of tasks held out (by the SHA-1 of the id, so the splits never share a task).

    Raises:
        ConfigError: an argument outside those values.
    """

    LEVELS: dict[int, Any] = {}

    def __init__(self, tools: Sequence[Callable[..., Any]] = (), difficulty: int = 1, num_tasks: int = 500,
                 seed: int = 0, split: str = "train", heldout_fraction: float = 0.2, max_tool_calls_per_turn: int = 2) -> None:
        super().__init__(tools=tools, max_tool_calls_per_turn=max_tool_calls_per_turn)
        if difficulty not in self.LEVELS:
            raise ConfigError(f"difficulty={difficulty!r}; expected one of {sorted(self.LEVELS)}")
        if num_tasks < 1:
            raise ConfigError(f"num_tasks={num_tasks!r}; expected a positive integer")
        check_split_args(split, heldout_fraction)
        self.difficulty, self.num_tasks, self.seed = difficulty, num_tasks, seed
        self.split, self.heldout_fraction = split, heldout_fraction
        self._media_results: list[list[dict[str, Any]]] = []

    def make_tasks(self) -> list[dict[str, Any]]:
        """All tasks (both splits), deterministic in (difficulty, num_tasks, seed)."""
        raise NotImplementedError

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Task dicts of ``split``.

        Raises:
            DataError: unknown split.
        """
        return split_tasks(self.make_tasks(), split, self.heldout_fraction)

    def demonstration(self, task: dict[str, Any]) -> dict[str, Any]:
        """A correct final reply to ``task`` for a supervised warm-up: ``"Answer: <answer>"``, no
        tool call, the form the prompts ask for and every built-in media env's ``score`` reads
        (the integer after ``Answer:``, or the last answer word), so :meth:`step` judges it correct.

        Raises:
            DataError: ``task`` has no ``answer``.
        """
        require(task, ("answer",), type(self).__name__)
        return {"role": "assistant", "content": f"Answer: {task['answer']}"}

    def task_difficulty(self, task: dict[str, Any]) -> int:
        """The difficulty ``task`` was made at (its ``difficulty``, else this env's)."""
        return int(task.get("difficulty", self.difficulty))

    def _result_text(self, name: str, value: Any, error: BaseException | None) -> str:
        if error is None and _is_parts(value):
            self._media_results.append(list(value))
            return f"{_MEDIA_RESULT}{len(self._media_results) - 1}"
        return super()._result_text(name, value, error)

    def _observe(self, results: list[tuple[str, str, str]], action: dict[str, Any], calls: list[Any]):
        obs, reward, terminated, truncated, info = super()._observe(results, action, calls)
        for msg in obs:
            if msg["content"].startswith(_MEDIA_RESULT):
                msg["content"] = self._media_results[int(msg["content"][len(_MEDIA_RESULT):])]
        self._media_results.clear()
        return obs, reward, terminated, truncated, info


def _is_parts(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and is_message({"role": "tool", "content": value})


def task_id(prefix: str, *fields: Any) -> str:
    """``"{prefix}-{sha1 of fields}"``: tasks with the same content get the same id (and split)."""
    return f"{prefix}-" + hashlib.sha1(repr(fields).encode()).hexdigest()[:12]


def require(task: dict[str, Any], keys: Sequence[str], env: str) -> None:
    """DataError naming the missing keys of ``task``."""
    missing = [k for k in keys if k not in task]
    if missing:
        raise DataError(f"{env} task needs {list(keys)}; missing {missing} (got keys {sorted(task)})")


def last_word(text: str, choices: Sequence[str]) -> str | None:
    """The last of ``choices`` named in ``text`` (whole words, case-insensitive); None if none is."""
    found = re.findall(r"\b(" + "|".join(map(re.escape, choices)) + r")\b", text or "", flags=re.I)
    return found[-1].lower() if found else None
