"""BFCLEnv: one BFCL single-turn task per episode; one assistant turn, then a verdict.

    env = gymnasium.make("relax/BFCL-simple-v0", partial_credit=0.1)
    messages, info = env.reset(options={"task": task})      # info["tools"]: OpenAI tool schemas
    _, reward, terminated, truncated, info = env.step(
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function",
                         "function": {"name": "math.factorial", "arguments": '{"number": 5}'}}]})
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

from relax_agent.envs.base import TextEnv
from relax_agent.envs.bfcl.checker import check_calls, reward
from relax_agent.envs.bfcl.data import CATEGORIES, check_env_args, load_tasks, split_tasks
from relax_agent.envs.bfcl.decode import judge_message, tool_call_entries
from relax_agent.errors import ConfigError, EnvError


class BFCLEnv(TextEnv):
    """A BFCL v4 single-turn category as a gymnasium environment.

    Args:
        category: one of :data:`~relax_agent.envs.bfcl.data.CATEGORIES` ("simple_python",
            "multiple", "parallel", "parallel_multiple", "irrelevance", "simple_java",
            "simple_javascript", "live_simple", "live_multiple", "live_parallel",
            "live_parallel_multiple", "live_irrelevance", "live_relevance").
        split: the split ``reset`` draws from when no task is given ("train" or "heldout").
        heldout_fraction: share of tasks held out, by SHA-1 of the task id (see ``data``).
        partial_credit: reward for a well-formed but wrong answer, in [0, 1].
        bfcl_compat: judge exactly as BFCL does where our checker deliberately differs
            (greedy pairing of parallel calls, tuples; see :mod:`relax_agent.envs.bfcl.checker`).
        train_categories: more single-turn categories whose train-split tasks (same
            ``heldout_fraction`` cut, by their own ids) join this env's train split, to widen the
            warm-up's and RL's pools; the held-out split stays this category's alone. Each task is
            judged by its own category's rules (its ``expect`` and ``language``), so one env plays all.

    Raises:
        ConfigError: any argument outside the values above.
    """

    reward_description = (
        "1.0 when the assistant's tool calls pass BFCL's AST check (right number of calls, "
        "function names, required and allowed parameters, value types and allowed values, "
        "order-free for parallel tasks; Java/JavaScript values string-encoded and decoded by "
        "BFCL's type rules; for irrelevance tasks: no decodable call, for live_relevance: one); "
        "partial_credit (default 0.1) when the calls are only well-formed (at least one call, "
        "each naming a task function with a JSON-object of arguments); else 0.0. Calls are read as "
        "BFCL's decoder reads them: a block that is not JSON is skipped, one that is JSON but not a "
        "call object makes the turn undecodable (no call)."
    )

    def __init__(
        self,
        category: str = "simple_python",
        split: str = "train",
        heldout_fraction: float = 0.2,
        partial_credit: float = 0.1,
        bfcl_compat: bool = False,
        train_categories: Sequence[str] = (),
    ) -> None:
        super().__init__()
        check_env_args(category, CATEGORIES, split, heldout_fraction)
        if isinstance(train_categories, str) or any(c not in CATEGORIES or c == category for c in train_categories):
            raise ConfigError(f"train_categories={train_categories!r}; expected a list of categories other than "
                              f"{category!r}, each one of {list(CATEGORIES)}")
        if not 0.0 <= partial_credit <= 1.0:
            raise ConfigError(f"partial_credit={partial_credit!r}; expected a number in [0, 1]")
        self.category = category
        self.split = split
        self.heldout_fraction = heldout_fraction
        self.partial_credit = partial_credit
        self.bfcl_compat = bfcl_compat
        self.train_categories = tuple(dict.fromkeys(train_categories))
        self._done = False

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Task dicts of ``split`` (see :mod:`relax_agent.envs.bfcl.data`); "train" also holds the
        train-split tasks of ``train_categories``, after this category's.

        Raises:
            DataError: unknown split, or the bfcl-eval wheel is missing.
        """
        tasks = split_tasks(load_tasks(self.category), split, self.heldout_fraction)
        if split == "train":
            for category in self.train_categories:
                tasks += split_tasks(load_tasks(category), split, self.heldout_fraction)
        return tasks

    def _reset_task(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self._done = False
        messages = copy.deepcopy(task["question"])
        return messages, {"tools": copy.deepcopy(task["tools"]), "task_id": task["id"]}

    def demonstration(self, task: dict[str, Any]) -> dict[str, Any] | None:
        """A correct assistant reply to ``task`` (for a supervised warm-up): the calls of its
        possible answer, each parameter at its first allowed value (a parameter whose first
        allowed value is ``""``, BFCL's "may be omitted", is left out); a plain refusal for
        irrelevance tasks; None where the answer is not a fixed set of calls (live_relevance) or
        where those values do not pass BFCL's check (about 1% of the Python tasks, a quarter of
        Java's), so every demonstration is one :meth:`step` judges correct."""
        if task["expect"] == "no_call":
            return {"role": "assistant", "content": "None of the available functions can help with this request."}
        if not task["possible_answer"]:
            return None
        encode = (lambda v: v) if task.get("language", "python") == "python" else _as_source
        calls = []
        for i, entry in enumerate(task["possible_answer"]):
            (name, params), = entry.items()
            args = {k: encode(_resolve(values[0])) for k, values in params.items() if values and values[0] != ""}
            calls.append({"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}})
        message = {"role": "assistant", "content": "", "tool_calls": calls}
        return message if check_calls(calls_from_message(message), task, bfcl_compat=self.bfcl_compat).correct else None

    def step(self, action: dict[str, Any]):
        """Judge one assistant message; the episode always ends here.

        The calls judged are those BFCL's decoder reads (:func:`relax_agent.envs.bfcl.decode.decoded_calls`):
        ``parse_errors`` (blocks that are not JSON) are skipped, ``rejected_calls`` follow BFCL's rules.

        Returns:
            ``([], reward, True, False, info)`` with info ``{"correct": 0.0|1.0,
            "well_formed": 0.0|1.0, "num_calls": int (tool_calls and rejected_calls entries), "reason": str}``.

        Raises:
            EnvError: ``step`` before ``reset`` or after the episode ended, or an action
                that is not a message dict.
        """
        if self.task is None or self._done:
            raise EnvError("BFCLEnv.step() needs a fresh episode: call reset() first")
        if not isinstance(action, dict) or action.get("role", "assistant") != "assistant":
            got = type(action).__name__ if not isinstance(action, dict) else f"role {action.get('role')!r}"
            raise EnvError(f"action must be an assistant message dict, got {got}")
        if not isinstance(action.get("tool_calls") or [], list):
            raise EnvError(
                "action['tool_calls'] must be a list of {'type': 'function', 'function': {'name', 'arguments'}}, "
                f"got {type(action['tool_calls']).__name__}"
            )
        self._done = True
        result, num_calls = judge_message(action, self.task, bfcl_compat=self.bfcl_compat)
        info = {
            "correct": float(result.correct),
            "well_formed": float(result.well_formed),
            "num_calls": num_calls,
            "reason": result.reason,
        }
        return [], reward(result, self.partial_credit), True, False, info


def _resolve(value: Any) -> Any:
    """One concrete value of a possible answer's value: nested dicts hold lists of allowed values."""
    if isinstance(value, dict):
        return {k: _resolve(v[0]) for k, v in value.items() if isinstance(v, list) and v and v[0] != ""}
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    return value


def _as_source(value: Any) -> str:
    """A Java/JavaScript argument as BFCL expects it: a string holding the value's source text."""
    return value if isinstance(value, str) else json.dumps(value)


def calls_from_message(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as ``[{"name", "arguments"}]`` (see
    :func:`tool_call_entries`); a string ``arguments`` that does not parse is judged not
    well-formed by the checker."""
    return [{"name": name, "arguments": arguments} for _, name, arguments in tool_call_entries(message)]
