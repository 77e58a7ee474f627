"""BFCL v4 single-turn tasks, read from the ``bfcl-eval`` wheel's data folder.

The wheel's ``bfcl_eval/__init__`` chain can pull heavy dependencies, so the package is
located with :func:`importlib.util.find_spec` and nothing from ``bfcl_eval`` is imported.
Install it without dependencies: ``pip install --no-deps bfcl-eval``.

The JSON-lines files are loaded with the ``datasets`` library (:func:`read_jsonl`), each line
as one row of its ``text`` builder, decoded with ``json.loads``. (Its ``json`` builder unifies
the rows' nested schemas into one Arrow type: it adds missing keys as nulls and changes the
answers of simple_python, multiple, parallel, live_multiple, multi-turn tasks..., so it cannot
carry BFCL's heterogeneous function docs and answers unchanged.)

A task is a dict::

    {"id": "simple_python_1",
     "category": "simple_python",
     "question": [{"role": "user", "content": "..."}],      # first (only) turn of BFCL's question
     "functions": [<BFCL function doc>, ...],
     "tools": [<OpenAI tool schema>, ...],                  # schema.to_openai_tool of each doc
     "possible_answer": [{"math.factorial": {"number": [5]}}, ...],   # [] for (ir)relevance
     "expect": "calls",          # "no_call" (irrelevance, live_irrelevance), "a_call" (live_relevance)
     "language": "python"}       # "java" / "javascript": string-encoded values (see ``languages``)

``possible_answer`` holds one entry per expected call; each lists, per parameter, the
allowed values (``""`` among them means the parameter may be omitted).

Splits: a task is held out when the SHA-1 of its id, read as a number in [0, 1), falls
below ``heldout_fraction``. The split is the same on every machine and run, and the two
sides are disjoint.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

from relax_agent.envs.bfcl.languages import language_doc, language_of
from relax_agent.envs.bfcl.schema import to_openai_tool
from relax_agent.errors import ConfigError, DataError

CATEGORIES: tuple[str, ...] = (
    "simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance",
    "simple_java", "simple_javascript",
    "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple", "live_irrelevance", "live_relevance",
)
EXPECT: dict[str, str] = {"irrelevance": "no_call", "live_irrelevance": "no_call", "live_relevance": "a_call"}
"""Categories judged by relevance (BFCL's ``relevance_file_runner``); every other one by the AST check."""
SPLITS: tuple[str, ...] = ("train", "heldout")
FILE_PREFIX = "BFCL_v4_"
_INSTALL_HINT = "pip install --no-deps bfcl-eval"


def data_dir() -> Path:
    """The ``data`` folder of the installed ``bfcl-eval`` wheel (without importing it).

    Raises:
        DataError: ``bfcl-eval`` is not installed, or its data folder is missing.
    """
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"BFCL data needs the bfcl-eval wheel: {_INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / "data"
    if not path.is_dir():
        raise DataError(f"bfcl-eval is installed but has no data folder at {path}; reinstall: {_INSTALL_HINT}")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a BFCL JSON-lines file, loaded through ``datasets`` (one row per line, decoded as is).

    Raises:
        DataError: the file is missing or a line is not JSON.
    """
    if not path.is_file():
        raise DataError(f"BFCL file {path} is missing; reinstall the wheel: {_INSTALL_HINT}")
    import datasets

    progress = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        lines = datasets.load_dataset("text", data_files=str(path), split="train")["text"]
    finally:
        if progress:
            datasets.enable_progress_bars()
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number} is not a JSON line ({exc.msg}); reinstall: {_INSTALL_HINT}") from None
    return rows


def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise DataError(f"unknown BFCL category {category!r}; expected one of {list(CATEGORIES)}")


@functools.cache
def _load(category: str) -> tuple[dict[str, Any], ...]:
    root = data_dir()
    name = f"{FILE_PREFIX}{category}.json"
    rows = read_jsonl(root / name)
    expect = EXPECT.get(category, "calls")
    answers: dict[str, list] = {}
    if expect == "calls":
        answers = {row["id"]: row["ground_truth"] for row in read_jsonl(root / "possible_answer" / name)}
    language = language_of(category)
    tasks = []
    for row in rows:
        if expect == "calls" and row["id"] not in answers:
            raise DataError(f"BFCL task {row['id']!r} has no entry in possible_answer/{name}")
        tasks.append(
            {
                "id": row["id"],
                "category": category,
                "question": row["question"][0],
                "functions": row["function"],
                "tools": [to_openai_tool(language_doc(f, language)) for f in row["function"]],
                "possible_answer": answers.get(row["id"], []),
                "expect": expect,
                "language": language,
            }
        )
    return tuple(tasks)


def load_tasks(category: str) -> list[dict[str, Any]]:
    """All tasks of one BFCL category, in file order (cached per process; do not mutate them).

    Raises:
        DataError: unknown category, ``bfcl-eval`` missing, or a task without an answer.
    """
    _check_category(category)
    return list(_load(category))


def heldout_score(task_id: str) -> float:
    """A stable number in [0, 1) from the SHA-1 of ``task_id`` (the split key)."""
    digest = hashlib.sha1(task_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def check_env_args(category: str, categories: tuple[str, ...] | list[str], split: str,
                   heldout_fraction: float) -> None:
    """Validate a BFCL env's ``category`` (one of ``categories``), ``split`` and ``heldout_fraction``.

    Raises:
        ConfigError: naming the bad argument and what was expected.
    """
    if category not in categories:
        raise ConfigError(f"category={category!r}; expected one of {list(categories)}")
    check_split_args(split, heldout_fraction)


def check_split_args(split: str, heldout_fraction: float) -> None:
    """Validate an env's ``split`` (one of :data:`SPLITS`) and ``heldout_fraction`` (in [0, 1]).

    Raises:
        ConfigError: naming the bad argument and what was expected.
    """
    if split not in SPLITS:
        raise ConfigError(f"split={split!r}; expected one of {list(SPLITS)}")
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ConfigError(f"heldout_fraction={heldout_fraction!r}; expected a number in [0, 1]")


def split_tasks(tasks: list[dict[str, Any]], split: str, heldout_fraction: float = 0.2) -> list[dict[str, Any]]:
    """The tasks of ``split``: "heldout" when ``heldout_score(id) < heldout_fraction``, else "train".

    Raises:
        DataError: unknown split, or ``heldout_fraction`` outside [0, 1].
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    if not 0.0 <= heldout_fraction <= 1.0:
        raise DataError(f"heldout_fraction={heldout_fraction!r}; expected a number in [0, 1]")
    want_heldout = split == "heldout"
    return [t for t in tasks if (heldout_score(t["id"]) < heldout_fraction) == want_heldout]
