"""DatasetToolsEnv: function-calling tasks from your own data, no env class to write.

Each row of a dataset is one task: a prompt, the tool schemas offered, and an answer. The model
answers in one assistant message; a scorer judges it::

    env = gymnasium.make("relax/DatasetTools-v0", data_files="my_calls.jsonl")
    # rows: {"id": "q1", "prompt": "Weather in Paris?", "tools": [<OpenAI tool schema>, ...],
    #        "answer": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}

    env = gymnasium.make("relax/DatasetTools-v0", path="org/fc-dataset", dataset_split="train",
                         columns={"prompt": "messages", "tools": "functions", "answer": "calls"},
                         scorer="my_pkg.scoring:score")

Data: ``data_files`` (a local ``.json``/``.jsonl``/``.parquet``/``.csv`` file, or a list of them;
the ``datasets`` builder comes from the extension) or ``path`` (anything ``datasets.load_dataset``
takes: a hub id, a local folder), not both. Rows are read once per process and cached.

Columns (``columns`` maps each role to a column name; defaults in :data:`DEFAULT_COLUMNS`):
  * ``prompt``: a string (one user message) or a list of ``{"role", "content"}`` messages;
  * ``tools``: a list of OpenAI tool schemas (``{"type": "function", "function": {...}}``) or
    of bare ``{"name", "description", "parameters"}`` docs, or a JSON string of either; an
    empty or missing value offers no tools. (Keys that ``datasets`` fills with null when it
    unifies the rows' schemas are dropped from the tool schemas: store tools as JSON strings
    to keep them byte for byte.)
  * ``answer``: anything; handed to the scorer as ``task["answer"]`` (a JSON string is decoded);
  * ``id`` (optional): the task id; default ``"row<index>"``.

Scorer: ``"module:function"``, called as ``function(message, task, **scorer_kwargs)`` with the
assistant message (``content``, ``tool_calls``, and ``parse_errors`` when some block did not
parse) and the task dict; it returns a reward, or ``(reward, info)``. The default,
:func:`exact_calls`, wants the answer's calls: same names and arguments, order-free.

Splits are by SHA-1 of the task id, as for BFCL (``heldout_fraction`` held out).
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_agent.envs.base import TextEnv
from relax_agent.envs.bfcl.data import check_split_args, split_tasks
from relax_agent.errors import ConfigError, DataError, EnvError

DEFAULT_COLUMNS: dict[str, str] = {"prompt": "prompt", "tools": "tools", "answer": "answer", "id": "id"}
BUILDERS: dict[str, str] = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension -> ``datasets`` builder for ``data_files``."""
DEFAULT_SCORER = "relax_agent.envs.dataset_tools:exact_calls"


def exact_calls(message: dict[str, Any], task: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """1.0 when the message's calls equal the answer's calls (names and arguments, order-free).

    The answer is a list of ``{"name", "arguments"}`` (one dict is a one-call list; an empty list
    means "answer without calling a tool"). A message with a parse error is wrong.

    Returns:
        ``(reward, {"correct", "well_formed", "num_calls", "reason"})``.

    Raises:
        DataError: the answer is not a call list.
    """
    expected = task["answer"]
    expected = [expected] if isinstance(expected, dict) else expected
    if not isinstance(expected, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in expected):
        raise DataError(f"task {task.get('id')!r}: answer {expected!r} is not a list of {{'name', 'arguments'}} calls")
    got = [_call_key(c) for c in message.get("tool_calls") or []]
    errors = list(message.get("parse_errors") or [])
    info: dict[str, Any] = {"num_calls": len(got) + len(errors), "well_formed": float(not errors and None not in got)}
    if errors:
        reason = f"a tool call did not parse: {errors[0]}"
    elif Counter(got) == Counter(_call_key(c) for c in expected):
        reason = "ok"
    elif not got and expected:
        reason = "no tool call"
    else:
        reason = f"calls {sorted(map(str, got))} are not the expected {sorted(str(_call_key(c)) for c in expected)}"
    info.update(correct=float(reason == "ok"), reason=reason)
    return info["correct"], info


def _call_key(call: Any) -> tuple[str, str] | None:
    function = call.get("function", call) if isinstance(call, dict) else {}
    arguments = function.get("arguments", function.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(function.get("name"), str) or not isinstance(arguments, dict):
        return None
    return function["name"], json.dumps(arguments, sort_keys=True)


def load_scorer(spec: str) -> Callable[..., Any]:
    """The callable named by ``"module:function"``.

    Raises:
        ConfigError: not of that form, the module does not import, or it lacks the function.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"scorer={spec!r}; expected 'module:function', e.g. {DEFAULT_SCORER!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise ConfigError(f"scorer={spec!r}: cannot import {module_name!r} ({exc})") from exc
    except AttributeError:
        raise ConfigError(f"scorer={spec!r}: module {module_name!r} has no {attr!r}") from None
    if not callable(fn):
        raise ConfigError(f"scorer={spec!r} is a {type(fn).__name__}, expected a function")
    return fn


@functools.lru_cache(maxsize=16)
def _load_rows(data_files: tuple[str, ...] | None, path: str | None, name: str | None,
               dataset_split: str) -> tuple[dict[str, Any], ...]:
    import datasets

    progress = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if data_files is not None:
            builders = {BUILDERS.get(Path(f).suffix.lower()) for f in data_files}
            if None in builders or len(builders) != 1:
                raise ConfigError(f"data_files={list(data_files)!r}: expected files ending in one of "
                                  f"{sorted(BUILDERS)} (one format)")
            for f in data_files:
                if not Path(f).is_file():
                    raise ConfigError(f"data_files: {f!r} is not a file")
            ds = datasets.load_dataset(builders.pop(), data_files=list(data_files), split=dataset_split)
        else:
            ds = datasets.load_dataset(path, name, split=dataset_split)
    except (ValueError, FileNotFoundError) as exc:  # datasets' own errors for a bad path, split or file
        if isinstance(exc, ConfigError):
            raise
        raise DataError(f"cannot load dataset {path or list(data_files or ())!r} (split {dataset_split!r}): {exc}") from exc
    finally:
        if progress:
            datasets.enable_progress_bars()
    return tuple(ds.to_list())


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 and m.get("role") in ("system", "user", "assistant") for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"{where}: prompt must be a string or a list of {{'role', 'content'}} messages, got {value!r:.200}")


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _tools(value: Any, where: str) -> list[dict[str, Any]]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: tools column holds a string that is not JSON ({exc.msg})") from None
    else:
        value = _drop_nulls(value)
    if not isinstance(value, list):
        raise DataError(f"{where}: tools must be a list of tool schemas, got {type(value).__name__}")
    out = []
    for tool in value:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(f"{where}: tool {tool!r:.200} has no string 'name'")
        out.append({"type": "function", "function": {"name": function["name"],
                                                     "description": function.get("description", ""),
                                                     "parameters": function.get("parameters") or {"type": "object", "properties": {}}}})
    return out


def _answer(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


class DatasetToolsEnv(TextEnv):
    """Function-calling tasks read from a dataset; one assistant turn per episode, judged by a scorer.

    Args:
        data_files: a local data file or a list of them (see the module docstring).
        path: a ``datasets.load_dataset`` path or hub id (instead of ``data_files``).
        name: the dataset configuration name (with ``path``).
        dataset_split: the split of the *source* dataset to read (default "train").
        columns: ``{"prompt"|"tools"|"answer"|"id": column}`` overrides of :data:`DEFAULT_COLUMNS`.
        scorer: ``"module:function"`` judging the answer (default :func:`exact_calls`).
        scorer_kwargs: extra keyword arguments for the scorer.
        split: the split ``reset`` draws from ("train" or "heldout").
        heldout_fraction: share of tasks held out, by SHA-1 of the task id.

    Raises:
        ConfigError: neither or both of ``data_files``/``path``, a bad file, an unknown column
            role, a mapped column the dataset lacks, or a bad scorer, split or fraction.
        DataError: the dataset does not load, or a row's prompt or tools are malformed.
    """

    reward_description = ("The scorer's reward for the assistant's one message (default: 1.0 when its tool calls "
                          "equal the answer's calls, names and arguments, order-free; else 0.0).")

    def __init__(self, data_files: str | list[str] | None = None, path: str | None = None, name: str | None = None,
                 dataset_split: str = "train", columns: dict[str, str] | None = None, scorer: str = DEFAULT_SCORER,
                 scorer_kwargs: dict[str, Any] | None = None, split: str = "train",
                 heldout_fraction: float = 0.2) -> None:
        super().__init__()
        if (data_files is None) == (path is None):
            raise ConfigError("DatasetTools needs exactly one of data_files= (local files) or path= (a datasets "
                              f"path or hub id); got data_files={data_files!r}, path={path!r}")
        check_split_args(split, heldout_fraction)
        unknown = sorted(set(columns or {}) - set(DEFAULT_COLUMNS))
        if unknown:
            raise ConfigError(f"columns={columns!r}: unknown roles {unknown}; expected keys from {sorted(DEFAULT_COLUMNS)}")
        self.columns = {**DEFAULT_COLUMNS, **(columns or {})}
        self._mapped = set(columns or {})
        self.scorer_name, self.scorer = scorer, load_scorer(scorer)
        self.scorer_kwargs = dict(scorer_kwargs or {})
        self.split, self.heldout_fraction = split, heldout_fraction
        files = None if data_files is None else tuple([data_files] if isinstance(data_files, str) else data_files)
        self._all = self._build_tasks(_load_rows(files, path, name, dataset_split))
        self._done = True

    def _build_tasks(self, rows: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
        cols = self.columns
        present = set(rows[0]) if rows else set()
        for role in ("prompt", "answer"):
            if cols[role] not in present:
                raise ConfigError(f"columns: {role} column {cols[role]!r} is not in the dataset; it has {sorted(present)}"
                                  f" (map it with columns={{{role!r}: ...}})")
        if "tools" in self._mapped and cols["tools"] not in present:  # the default tools column is optional
            raise ConfigError(f"columns: tools column {cols['tools']!r} is not in the dataset; it has {sorted(present)}")
        tasks = []
        for index, row in enumerate(rows):
            task_id = str(row[cols["id"]]) if cols["id"] in row and row[cols["id"]] is not None else f"row{index}"
            where = f"row {index} (id {task_id!r})"
            tasks.append({"id": task_id, "prompt": _messages(row[cols["prompt"]], where),
                          "tools": _tools(row.get(cols["tools"]), where), "answer": _answer(row[cols["answer"]])})
        ids = Counter(t["id"] for t in tasks)
        dupes = sorted(i for i, n in ids.items() if n > 1)
        if dupes:
            raise DataError(f"task ids must be unique; repeated: {dupes[:5]} (column {cols['id']!r})")
        return tasks

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Task dicts ``{"id", "prompt", "tools", "answer"}`` of ``split``.

        Raises:
            DataError: unknown split.
        """
        return split_tasks(self._all, split, self.heldout_fraction)

    def _reset_task(self, task: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self._done = False
        return copy.deepcopy(task["prompt"]), {"tools": copy.deepcopy(task["tools"]), "task_id": task["id"]}

    def step(self, action: dict[str, Any]):
        """Judge the assistant message with the scorer; the episode ends here.

        Returns:
            ``([], reward, True, False, info)``: the scorer's reward and info (``reason`` and
            ``correct`` when it gives them).

        Raises:
            EnvError: ``step`` before ``reset`` or after the episode ended, an action that is not
                an assistant message dict, or a scorer that returns no finite number.
        """
        if self.task is None or self._done:
            raise EnvError("DatasetToolsEnv.step() needs a fresh episode: call reset() first")
        if not isinstance(action, dict) or action.get("role", "assistant") != "assistant":
            got = type(action).__name__ if not isinstance(action, dict) else f"role {action.get('role')!r}"
            raise EnvError(f"action must be an assistant message dict, got {got}")
        self._done = True
        out = self.scorer(copy.deepcopy(action), self.task, **self.scorer_kwargs)
        reward, info = out if isinstance(out, tuple) else (out, {})
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EnvError(f"scorer {self.scorer_name!r} returned reward {reward!r}; expected a finite number")
        return [], float(reward), True, False, dict(info)


def register() -> None:
    """Register ``relax/DatasetTools-v0``."""
    from relax_agent.envs import register as register_env

    register_env(id="relax/DatasetTools-v0", entry_point="relax_agent.envs.dataset_tools:DatasetToolsEnv")
