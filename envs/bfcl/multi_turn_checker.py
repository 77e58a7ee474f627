"""BFCL's turn-level check for multi-turn tasks: state equality plus contained results.

Our implementation of ``multi_turn_checker`` (``bfcl_eval/eval_checker/multi_turn_eval/
multi_turn_checker.py`` in bfcl-eval v4). The model's calls run on one :class:`ApiSession`, the
ground-truth calls on another, both loaded from the task's ``initial_config`` and both kept
across turns. After every turn whose ground truth is not empty, the turn is correct when

  * the model made at least one (parsed) call in that turn;
  * every involved instance has the same public attributes (``vars`` without ``_``-names,
    compared with ``==``) as its ground-truth twin;
  * every ground-truth result of that turn appears among the model's results of all turns so
    far (a multiset: each model result matches at most one ground-truth result; order-free).

Turns with an empty ground truth (the request cannot be fulfilled: a missing function or
parameter) are not judged, as in BFCL v4, but their calls still run and count for later turns.
BFCL stops at the first failing turn; here every judged turn gets its own verdict, and the task
is correct exactly when all of them are (BFCL's verdict). BFCL also fails a task whose model was
force-quit in a turn (more than its step limit); :class:`TaskVerdict` takes that as ``forced``.

Decoding, as BFCL's ``_evaluate_single_multi_turn_entry``: a step (one assistant message) with an
entry that does not decode (no string name, arguments that are not a JSON object, or a block the
parser could not read) is dropped whole: none of its calls run (:func:`decodable_step`).

Deliberate difference: BFCL shares each omitted mutable default (``post_tweet(mentions=[])``)
between the model's and the ground truth's instances (one Python default object); we give each
call a fresh copy. ``bfcl_compat=True`` shares them within the task, as BFCL does for a task
judged first in its process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relax_agent.envs.bfcl.multi_turn_api import ApiSession


@dataclass(frozen=True)
class TurnVerdict:
    """Verdict on one judged turn: ``correct``, and ``reason`` ("ok" or why not)."""

    correct: bool
    reason: str


@dataclass(frozen=True)
class TaskVerdict:
    """Verdicts of a whole task.

    Attributes:
        turns: one entry per turn; None for a turn that is not judged (empty ground truth).
        forced: some turn was cut by the per-turn step limit (BFCL then fails the task).
    """

    turns: tuple[TurnVerdict | None, ...]
    forced: bool = False

    @property
    def judged(self) -> int:
        """Turns that got a verdict (None marks a turn not judged)."""
        return sum(v is not None for v in self.turns)

    @property
    def turns_correct(self) -> int:
        """Turns judged correct."""
        return sum(v is not None and v.correct for v in self.turns)

    @property
    def turn_accuracy(self) -> float:
        """Fraction of judged turns that are correct (the environment's reward)."""
        return self.turns_correct / self.judged if self.judged else 0.0

    @property
    def correct(self) -> bool:
        """BFCL's whole-task verdict: every judged turn correct and no forced turn end."""
        return not self.forced and self.judged > 0 and self.turns_correct == self.judged


def state_difference(model: ApiSession, truth: ApiSession) -> str | None:
    """None when every instance of ``model`` has the public state of its twin in ``truth``, else why not."""
    model_state = model.state()
    for class_name, truth_attrs in truth.state().items():
        attrs = model_state.get(class_name, {})
        differ = sorted(k for k, v in truth_attrs.items() if attrs.get(k, _MISSING) != v)
        if differ:
            return f"{class_name} state differs from the ground truth's in {differ}"
    return None


_MISSING = object()


def missing_results(model_results: Sequence[str], truth_results: Sequence[str]) -> list[str]:
    """Ground-truth results not found among ``model_results`` (each model result used once)."""
    left = Counter(model_results)
    missing = []
    for result in truth_results:
        if left[result] > 0:
            left[result] -= 1
        else:
            missing.append(result)
    return missing


class TurnJudge:
    """Runs a task's ground truth turn by turn and judges the model's session against it.

    Args:
        task: a multi-turn task dict (see :mod:`relax_agent.envs.bfcl.multi_turn_data`).
        shared_defaults: the model session's mutable-defaults pool, to share it with the ground
            truth's session (``bfcl_compat``); None gives the truth its own fresh defaults.

    Raises:
        DataError: the task's classes cannot be loaded.
    """

    def __init__(self, task: dict[str, Any], shared_defaults: dict[tuple[str, str, str], Any] | None = None):
        self.task = task
        self.truth = session_for(task, shared_defaults)
        self.model_results: list[str] = []
        self.turn = 0

    def judge(self, model: ApiSession, turn_results: Sequence[str], turn_calls: int) -> TurnVerdict | None:
        """Close the next turn: ``turn_results`` are the results of the model's ``turn_calls`` calls in it.

        Returns:
            The turn's verdict, or None when the turn has no ground truth (not judged).
        """
        expected = self.task["ground_truth"][self.turn]
        self.turn += 1
        self.model_results.extend(turn_results)
        truth_results = [self.truth.call(*self.truth.keyword_call(c)) for c in expected]
        if not expected:
            return None
        if turn_calls == 0:
            return TurnVerdict(False, f"turn {self.turn - 1}: no tool call, expected {len(expected)}")
        difference = state_difference(model, self.truth)
        if difference is not None:
            return TurnVerdict(False, f"turn {self.turn - 1}: {difference}")
        missing = missing_results(self.model_results, truth_results)
        if missing:
            return TurnVerdict(False, f"turn {self.turn - 1}: ground-truth results missing from the model's: {missing}")
        return TurnVerdict(True, "ok")


def session_for(task: dict[str, Any], shared_defaults: dict[tuple[str, str, str], Any] | None = None) -> ApiSession:
    """A fresh :class:`ApiSession` for ``task`` (its classes, initial state and long-context flag)."""
    return ApiSession(task["involved_classes"], task["initial_config"], long_context=task.get("long_context", False),
                      shared_defaults=shared_defaults)


def decodable_step(step: Sequence[Any]) -> bool:
    """True when every call of one assistant message decodes (a string name and a JSON-object of
    arguments, no parse error); BFCL drops a step that does not, all its calls with it."""
    return all(isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)
               and not c.get("error") for c in step)


def check_task(task: dict[str, Any], calls: Sequence[Sequence[Sequence[dict[str, Any]]]],
               bfcl_compat: bool = False) -> TaskVerdict:
    """Judge a whole call sequence offline, the way the environment judges an episode.

    Args:
        task: a multi-turn task dict.
        calls: ``calls[turn][step]`` is one assistant message's calls, each
            ``{"name": str, "arguments": dict}``; a turn may have no steps. A step with an entry
            that does not decode is dropped whole (:func:`decodable_step`).
        bfcl_compat: share omitted mutable defaults between the model's and the truth's sessions.

    Raises:
        DataError: ``calls`` has a different number of turns than the task, or the task is malformed.
    """
    from relax_agent.errors import DataError

    if len(calls) != len(task["turns"]):
        raise DataError(f"task {task['id']!r} has {len(task['turns'])} turns, calls cover {len(calls)}")
    pool: dict[tuple[str, str, str], Any] | None = {} if bfcl_compat else None
    model = session_for(task, pool)
    judge = TurnJudge(task, pool)
    verdicts = []
    for steps in calls:
        turn_calls = [c for step in steps if decodable_step(step) for c in step]
        results = [model.call(c["name"], c["arguments"]) for c in turn_calls]
        verdicts.append(judge.judge(model, results, len(turn_calls)))
    return TaskVerdict(tuple(verdicts))


def ground_truth_calls(task: dict[str, Any]) -> list[list[list[dict[str, Any]]]]:
    """The task's ground truth as :func:`check_task` input: one step per turn, keyword arguments.

    Raises:
        DataError: a ground-truth call does not parse or fit its method.
    """
    session = session_for(task)
    out = []
    for turn in task["ground_truth"]:
        keyword = [session.keyword_call(c) for c in turn]
        out.append([[{"name": n, "arguments": a} for n, a in keyword]] if keyword else [])
    return out
