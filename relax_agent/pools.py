"""Disjoint task pools: the warm-up's demonstrations, RL's tasks and the held-out tasks.

An env gives two splits, "train" and "heldout". By default the supervised warm-up
(``trainer.sft_warmup_steps``) and RL both draw from the whole train split, so RL's first tasks
can be exactly the demonstrations the warm-up just showed (both orders are seeded permutations).
With ``env.warmup_fraction > 0`` the train split is cut in two: a task's demonstration is shown
only when it falls in the warm-up pool, and RL draws only from the rest. With
``env.near_duplicate_jaccard > 0`` near-duplicates are also kept apart: a train task that is a
near-duplicate of a held-out task is dropped from both pools, and near-duplicate train tasks
always land in the same pool (a cluster is assigned as a whole).

Two tasks are near-duplicates (:func:`near_duplicate`) when they offer the same set of functions
(task field ``functions``, by ``name``; tasks without it compare as having none) and the word
sets of their questions (the text of the task's ``question`` messages, or its ``question`` or
``prompt`` string) have a Jaccard similarity of at least the threshold. BFCL's own
near-duplicates are caught at 0.5: ``simple_python_11`` ("What is the area of a triangle with
base of 10 units and height of 5 units?") and ``simple_python_0`` (0.80), ``simple_python_97``
("Calculate the factorial of the number 5") and ``simple_python_1`` (0.56).

Assignment is deterministic and independent of ``run.seed``: a cluster goes to the warm-up pool
when the SHA-1 of its smallest task id (salted ``"warmup:"``), read as a number in [0, 1), is
below ``warmup_fraction``; so the pools are the same on every machine and every run.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Task = dict[str, Any]

_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class TaskPools:
    """The train split cut into the warm-up's pool and RL's pool.

    Attributes:
        warmup: tasks whose demonstrations the supervised warm-up may show.
        rl: tasks RL draws its groups from (disjoint from ``warmup`` unless no split is configured,
            then both are the whole, possibly de-duplicated, train split).
        dropped: ids of train tasks dropped as near-duplicates of a held-out task.
    """

    warmup: list[Task]
    rl: list[Task]
    dropped: list[str] = field(default_factory=list)


def task_words(task: Task) -> frozenset[str]:
    """Lower-case alphanumeric words of a task's question (its ``question`` messages' text, or a
    ``question`` / ``prompt`` string)."""
    question = task.get("question", task.get("prompt", ""))
    if isinstance(question, list):
        text = " ".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in question)
    else:
        text = str(question)
    return frozenset(_WORD.findall(text.lower()))


def task_functions(task: Task) -> frozenset[str]:
    """Names of the functions a task offers (its ``functions`` docs; empty without them)."""
    return frozenset(str(f.get("name")) for f in task.get("functions") or () if isinstance(f, dict))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    """|a & b| / |a | b| (1.0 for two empty sets)."""
    union = len(a | b)
    return 1.0 if union == 0 else len(a & b) / union


def near_duplicate(a: Task, b: Task, threshold: float) -> bool:
    """Whether ``a`` and ``b`` offer the same functions and their questions' word sets have a
    Jaccard similarity >= ``threshold`` (see the module docstring)."""
    return task_functions(a) == task_functions(b) and jaccard(task_words(a), task_words(b)) >= threshold


def _unit(text: str) -> float:
    digest = hashlib.sha1(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_pools(train: Sequence[Task], heldout: Sequence[Task], warmup_fraction: float = 0.0,
                near_duplicate_jaccard: float = 0.0) -> TaskPools:
    """Cut ``train`` into a warm-up pool and an RL pool (see the module docstring).

    Args:
        train: the env's train split (task dicts with unique ``id``).
        heldout: the env's held-out split (only read for the near-duplicate check).
        warmup_fraction: share of the train clusters kept for the warm-up, in [0, 1); 0 keeps
            one pool: both the warm-up and RL get the whole train split.
        near_duplicate_jaccard: in [0, 1]; 0 turns the near-duplicate check off.

    Returns:
        The pools, each in the train split's order.

    Raises:
        ConfigError: a fraction or threshold outside its range.
    """
    from relax_agent.errors import ConfigError

    if not 0.0 <= warmup_fraction < 1.0:
        raise ConfigError(f"env.warmup_fraction={warmup_fraction!r}; expected a number in [0, 1)")
    if not 0.0 <= near_duplicate_jaccard <= 1.0:
        raise ConfigError(f"env.near_duplicate_jaccard={near_duplicate_jaccard!r}; expected a number in [0, 1]")
    keep = list(train)
    dropped: list[str] = []
    cluster = {str(t["id"]): str(t["id"]) for t in keep}
    if near_duplicate_jaccard > 0.0:
        keep, dropped = _drop_heldout_duplicates(keep, heldout, near_duplicate_jaccard)
        cluster = _clusters(keep, near_duplicate_jaccard)
    if warmup_fraction == 0.0:
        return TaskPools(list(keep), list(keep), dropped)
    to_warmup = {root: _unit(f"warmup:{root}") < warmup_fraction for root in set(cluster.values())}
    warmup = [t for t in keep if to_warmup[cluster[str(t["id"])]]]
    rl = [t for t in keep if not to_warmup[cluster[str(t["id"])]]]
    return TaskPools(warmup, rl, dropped)


def _by_functions(tasks: Sequence[Task]) -> dict[frozenset[str], list[tuple[Task, frozenset[str]]]]:
    out: dict[frozenset[str], list[tuple[Task, frozenset[str]]]] = {}
    for t in tasks:
        out.setdefault(task_functions(t), []).append((t, task_words(t)))
    return out


def _drop_heldout_duplicates(train: list[Task], heldout: Sequence[Task],
                             threshold: float) -> tuple[list[Task], list[str]]:
    """``train`` without its near-duplicates of any held-out task, and the dropped ids."""
    held = _by_functions(heldout)
    keep, dropped = [], []
    for t in train:
        words = task_words(t)
        if any(jaccard(words, w) >= threshold for _, w in held.get(task_functions(t), ())):
            dropped.append(str(t["id"]))
        else:
            keep.append(t)
    return keep, dropped


def _clusters(tasks: list[Task], threshold: float) -> dict[str, str]:
    """Task id -> the smallest id of its near-duplicate cluster (transitive closure, union-find)."""
    parent = {str(t["id"]): str(t["id"]) for t in tasks}

    def root(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for group in _by_functions(tasks).values():
        for i, (a, wa) in enumerate(group):
            for b, wb in group[i + 1:]:
                if jaccard(wa, wb) >= threshold:
                    ra, rb = root(str(a["id"])), root(str(b["id"]))
                    if ra != rb:
                        parent[max(ra, rb)] = min(ra, rb)
    return {x: root(x) for x in parent}
