"""BFCL v4 multi-turn tasks and API function docs, read from the ``bfcl-eval`` wheel's data folder.

Four categories (200 tasks each): ``multi_turn_base``, ``multi_turn_miss_func`` (a function's
doc is withheld until a later turn), ``multi_turn_miss_param`` (a request lacks a parameter
value) and ``multi_turn_long_context`` (the APIs start from a much larger state, BFCL's
``long_context=True`` scenarios, so results are long). A task is a dict::

    {"id": "multi_turn_base_0",
     "category": "multi_turn_base",
     "turns": [[{"role": "user", "content": "..."}], ...],   # user messages, one list per turn
     "initial_config": {"GorillaFileSystem": {...}, ...},     # state each API class starts from
     "involved_classes": ["TwitterAPI", "GorillaFileSystem"],
     "missed_functions": {3: ["sort"]},                      # turn -> names whose docs arrive then
     "ground_truth": [["cd(folder='document')", ...], ...],  # one list of call strings per turn
     "long_context": False}                                   # True for multi_turn_long_context

A turn listed in ``missed_functions`` has no user message in BFCL's data; the environment sends
the withheld docs then (see :mod:`relax_agent.envs.bfcl.multi_turn`). A turn whose ground truth
is empty is one the model cannot fulfil (a missing function or parameter); BFCL does not judge it.

Function docs come from ``data/multi_turn_func_doc/<class file>.json`` (one doc per line, one per
public method of the class). Splits reuse :func:`relax_agent.envs.bfcl.data.split_tasks` (SHA-1
of the task id), so they are the same on every machine and run.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from relax_agent.envs.bfcl.data import FILE_PREFIX, data_dir, read_jsonl
from relax_agent.errors import DataError

CATEGORIES: tuple[str, ...] = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
LONG_CONTEXT_CATEGORIES: tuple[str, ...] = ("multi_turn_long_context",)
"""Categories whose API instances load their scenario with ``long_context=True`` (BFCL: many more
files, messages, tweets... in the initial state, for a long context)."""

API_CLASSES: dict[str, tuple[str, str]] = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
"""API class name -> (module under ``bfcl_eval.eval_checker.multi_turn_eval.func_source_code``,
function-doc file). Source: ``bfcl_eval/constants/executable_backend_config.py``."""


def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise DataError(f"unknown BFCL multi-turn category {category!r}; expected one of {list(CATEGORIES)}")


@functools.cache
def _class_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    if class_name not in API_CLASSES:
        raise DataError(f"unknown BFCL API class {class_name!r}; expected one of {sorted(API_CLASSES)}")
    return tuple(read_jsonl(data_dir() / "multi_turn_func_doc" / API_CLASSES[class_name][1]))


def class_docs(class_name: str) -> list[dict[str, Any]]:
    """The BFCL function docs of one API class, in file order (do not mutate them).

    Raises:
        DataError: unknown class, or ``bfcl-eval`` is missing.
    """
    return list(_class_docs(class_name))


_CLASS_PREAMBLE = re.compile(r"^This tool belongs to .*?Tool description: ", re.S)


def compact_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` without the class preamble BFCL repeats in every description ("This tool belongs to
    the Gorilla file system. It is a simple file system ... Tool description: "); ~25% fewer tokens."""
    return {**doc, "description": _CLASS_PREAMBLE.sub("", doc.get("description", ""), count=1)}


def task_docs(task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    """(docs offered from the start, {turn: docs added at that turn}) for a task.

    As BFCL's ``populate_test_cases_with_predefined_functions``: every doc of every involved
    class, minus the ``missed_functions``, which are handed out at their turn.

    Raises:
        DataError: a missed function is not a function of the task's classes.
    """
    docs = [d for c in task["involved_classes"] for d in _class_docs(c)]
    by_name = {d["name"]: d for d in docs}
    added: dict[int, list[dict[str, Any]]] = {}
    for turn, names in task["missed_functions"].items():
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise DataError(f"BFCL task {task['id']!r}: missed functions {unknown} are not in {task['involved_classes']}")
        added[int(turn)] = [by_name[n] for n in names]  # int() also takes a task that went through JSON
    held = {n for names in task["missed_functions"].values() for n in names}
    return [d for d in docs if d["name"] not in held], added


def _task(row: dict[str, Any], ground_truth: list[list[str]], category: str) -> dict[str, Any]:
    task_id = row["id"]
    unknown = [c for c in row["involved_classes"] if c not in API_CLASSES]
    if unknown:
        raise DataError(f"BFCL task {task_id!r} uses API classes {unknown}; supported: {sorted(API_CLASSES)}")
    if len(ground_truth) != len(row["question"]):
        raise DataError(f"BFCL task {task_id!r}: {len(row['question'])} turns but {len(ground_truth)} ground-truth turns")
    if not any(ground_truth):
        raise DataError(f"BFCL task {task_id!r} has no turn with ground-truth calls")
    missed = {int(turn): list(names) for turn, names in (row.get("missed_function") or {}).items()}
    for turn in missed:
        if not 0 < turn < len(row["question"]) or row["question"][turn]:
            raise DataError(f"BFCL task {task_id!r}: missed-function turn {turn} must be a later turn without a user message")
    return {
        "id": task_id,
        "category": category,
        "turns": row["question"],
        "initial_config": row.get("initial_config") or {},
        "involved_classes": list(row["involved_classes"]),
        "missed_functions": missed,
        "ground_truth": ground_truth,
        "long_context": category in LONG_CONTEXT_CATEGORIES,
    }


@functools.cache
def _load(category: str) -> tuple[dict[str, Any], ...]:
    root = data_dir()
    name = f"{FILE_PREFIX}{category}.json"
    answers = {row["id"]: row["ground_truth"] for row in read_jsonl(root / "possible_answer" / name)}
    tasks = []
    for row in read_jsonl(root / name):
        if row["id"] not in answers:
            raise DataError(f"BFCL task {row['id']!r} has no entry in possible_answer/{name}")
        tasks.append(_task(row, answers[row["id"]], category))
    return tuple(tasks)


def load_tasks(category: str) -> list[dict[str, Any]]:
    """All tasks of one multi-turn category, in file order (cached per process; do not mutate them).

    Raises:
        DataError: unknown category, ``bfcl-eval`` missing, or a malformed task.
    """
    _check_category(category)
    return list(_load(category))
