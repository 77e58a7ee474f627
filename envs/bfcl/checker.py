"""BFCL single-turn AST checker: are the model's function calls right?

Our own implementation of the rules of BFCL's ``ast_checker`` for Python
(``bfcl_eval/eval_checker/ast_eval/ast_checker.py`` in bfcl-eval, v4) and of its
irrelevance rule (``eval_runner.py``: correct iff the model made no call).

A call set is correct when
  * it has exactly as many calls as the answer, and the calls can be assigned one-to-one
    to the expected calls (order-free; BFCL pairs them greedily, we search for any perfect
    assignment, so a call set BFCL rejects only because of its greedy order is accepted);
  * each call has the expected function name (exact, dots included), every parameter the
    doc marks ``required``, no parameter that is not in both the doc and the answer, and
    every answer parameter whose allowed list lacks ``""`` (``""`` means "may be omitted");
  * each value has the doc's type (exact Python type: bool is not an integer; an int is
    accepted for ``float``; a list for ``array``/``tuple``, and a tuple too, where BFCL
    takes tuples for ``tuple`` only (JSON never yields them); ``any`` is a string) or, as BFCL does for answers that name a variable, the type of the answer's
    first non-``""`` allowed value, in which case the value is compared as is;
  * each value is allowed: strings after :func:`standardize_string` (lower case, no
    spaces or ``,./-_*^``, ``'`` -> ``"``); lists element-wise with their strings
    standardised (an allowed ``""`` stands for ``[]``); dicts key by key (no unknown key,
    each value standardised and in that key's list, each key whose list lacks ``""``
    present); lists of dicts in order, dict by dict; anything else by ``==``.
    Arrays also have their element types checked one level deep, as BFCL does: each
    element must have the doc's ``items`` type or the type of the first value of an
    allowed list (so an int inside a float array passes only when the answer's own list
    starts with an int; the int-for-float allowance applies to top-level values only).

Java and JavaScript tasks (``task["language"]``): every argument must be a string, decoded by
BFCL's rules for the doc's Java/JavaScript type (:mod:`relax_agent.envs.bfcl.languages`) before
the checks above, with that language's type table; no int-for-float allowance.

Relevance tasks (``task["expect"]``): "no_call" (irrelevance, live_irrelevance) is correct when the
turn holds no decodable call, "a_call" (live_relevance) when it holds one. As in BFCL's decoder, a
turn counts as a call only when every entry decodes: a string name and arguments that are a JSON
object; one entry that does not (or a block the parser could not read) makes the whole turn "no
call" (BFCL's ``is_empty_output``).

Deliberate differences from BFCL, and ``bfcl_compat=True``, which reproduces BFCL's verdicts:
  * pairing: BFCL pairs each expected call, in order, with the first model call that fits it
    (greedy), so a call set can fail although a one-to-one assignment exists (``parallel_178``
    reversed). We search for any perfect assignment; compat pairs greedily.
  * tuples: we accept a Python tuple for ``array`` as for ``tuple`` (calls built in Python, not
    JSON); compat accepts it for ``tuple`` only.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from relax_agent.envs.bfcl.languages import NESTED_TYPES, UndecodableValue, decode_value, type_table
from relax_agent.errors import ConfigError, DataError

PYTHON_TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "float": float,
    "boolean": bool,
    "array": list,
    "tuple": list,
    "dict": dict,
    "any": str,
}
_STRIP = re.compile(r"[ ,./\-_*^]")


@dataclass(frozen=True)
class CheckResult:
    """Verdict on one assistant turn's calls.

    correct: the calls pass every rule above.
    well_formed: at least one call, each naming a function of the task with a dict of
        arguments (for irrelevance tasks: no call at all).
    reason: why the calls are wrong, or "ok".
    """

    correct: bool
    well_formed: bool
    reason: str


def standardize_string(text: str) -> str:
    """BFCL's string normalisation: drop spaces and ``,./-_*^``, lower-case, ``'`` -> ``"``."""
    return _STRIP.sub("", text).lower().replace("'", '"')


def reward(result: CheckResult, partial_credit: float = 0.1) -> float:
    """1.0 if correct, ``partial_credit`` if only well-formed, else 0.0.

    Raises:
        ConfigError: ``partial_credit`` outside [0, 1].
    """
    if not 0.0 <= partial_credit <= 1.0:
        raise ConfigError(f"partial_credit={partial_credit!r}; expected a number in [0, 1]")
    if result.correct:
        return 1.0
    return float(partial_credit) if result.well_formed else 0.0


def check_calls(calls: list[dict[str, Any]], task: dict[str, Any], bfcl_compat: bool = False) -> CheckResult:
    """Judge ``calls`` (each ``{"name": str, "arguments": dict}``) against a BFCL task.

    ``task`` is a dict from :func:`relax_agent.envs.bfcl.data.load_tasks` (uses its
    ``functions``, ``possible_answer``, ``expect`` and ``language``; a task without ``expect``
    expects no call when its answer is empty). A call the parser could not read is an entry
    ``{"name": None, "arguments": None, "error": why}``. ``bfcl_compat``: BFCL's greedy pairing
    and tuple rule (module docstring).

    Raises:
        DataError: the task's answer names a function its docs lack, or a doc uses an
            unknown type.
    """
    expected = task["possible_answer"]
    expect = task.get("expect") or ("calls" if expected else "no_call")
    if expect != "calls":
        return _relevance(calls, expect)
    functions = {f["name"]: f for f in task["functions"]}
    form_error = _form_error(calls, functions)
    well_formed = form_error is None
    if len(calls) != len(expected):
        return CheckResult(False, well_formed, form_error or f"expected {len(expected)} calls, got {len(calls)}")
    language = task.get("language", "python")
    errors = [[_call_error(call, exp, functions, language, bfcl_compat) for call in calls] for exp in expected]
    fits = [[e is None for e in row] for row in errors]
    if (_greedy_matching if bfcl_compat else _has_perfect_matching)(fits):
        return CheckResult(True, well_formed, "ok")
    reason = _mismatch_reason(errors, expected)
    if bfcl_compat and reason.startswith("calls match"):
        reason = "no greedy pairing (BFCL's rule, bfcl_compat) of the calls with the expected calls"
    return CheckResult(False, well_formed, form_error or reason)


def has_decoded_call(calls: list[Any]) -> bool:
    """BFCL's decoder view of a turn: at least one call, and every entry a name (a string, or any
    other JSON scalar: BFCL reads ``{"name": 7, ...}`` as a call) with a JSON-object of arguments
    (otherwise BFCL's ``is_empty_output`` sees no call at all)."""
    return bool(calls) and all(
        isinstance(c, dict) and isinstance(c.get("name"), Hashable) and isinstance(c.get("arguments"), dict)
        and "error" not in c for c in calls
    )


def _relevance(calls: list[Any], expect: str) -> CheckResult:
    called = has_decoded_call(calls)
    if expect == "no_call":
        if called:
            return CheckResult(False, False, f"expected no call (irrelevance), got {len(calls)}")
        return CheckResult(True, True, "ok" if not calls else "ok (the calls do not decode, so they count as no call)")
    if expect == "a_call":
        if called:
            return CheckResult(True, True, "ok")
        why = "no tool call" if not calls else "the calls do not decode (a name and JSON-object arguments each)"
        return CheckResult(False, False, f"expected a call (relevance): {why}")
    raise DataError(f"task expect={expect!r}; expected 'calls', 'no_call' or 'a_call'")


def _form_error(calls: list[Any], functions: dict[str, Any]) -> str | None:
    if not calls:
        return "no tool call"
    for i, call in enumerate(calls):
        if isinstance(call, dict) and call.get("error"):
            return f"call {i} did not parse: {call['error']}"
        name = call.get("name") if isinstance(call, dict) else None
        if name not in functions:
            return f"call {i} names unknown function {name!r}; expected one of {sorted(functions)}"
        if not isinstance(call.get("arguments"), dict):
            kind = type(call.get("arguments")).__name__
            return f"call {i} ({name}): arguments are {kind}, expected a JSON object"
    return None


def _mismatch_reason(errors: list[list[str | None]], expected: list[dict[str, Any]]) -> str:
    for i, row in enumerate(errors):
        if all(e is not None for e in row):
            name = next(iter(expected[i]))
            best = next((e for e in row if e is not None and not e.startswith("function name")), row[0])
            return f"no call matches expected call {i} ({name}): {best}"
    return "calls match expected calls individually but not one-to-one"


def _has_perfect_matching(ok: list[list[bool]]) -> bool:
    """Kuhn's augmenting-path bipartite matching; ``ok[i][j]``: call j satisfies expected call i."""
    owner = [-1] * (len(ok[0]) if ok else 0)

    def augment(i: int, seen: set[int]) -> bool:
        for j, fits in enumerate(ok[i]):
            if fits and j not in seen:
                seen.add(j)
                if owner[j] < 0 or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(augment(i, set()) for i in range(len(ok)))


def _greedy_matching(ok: list[list[bool]]) -> bool:
    """BFCL's pairing: each expected call, in order, takes the first unused call that fits it."""
    used: set[int] = set()
    for row in ok:
        j = next((j for j, fits in enumerate(row) if fits and j not in used), None)
        if j is None:
            return False
        used.add(j)
    return True


def _call_error(call: Any, expected_call: dict[str, Any], functions: dict[str, Any], language: str = "python",
                bfcl_compat: bool = False) -> str | None:
    """None when ``call`` satisfies ``expected_call`` ({func_name: {param: allowed}}), else why not."""
    ((name, allowed_params),) = expected_call.items()
    if name not in functions:
        raise DataError(f"BFCL answer names function {name!r}, which the task's docs lack")
    got = call.get("name") if isinstance(call, dict) else None
    if got != name:
        return f"function name {got!r} is not the expected {name!r}"
    args = call.get("arguments")
    if not isinstance(args, dict):
        return f"arguments are {type(args).__name__}, expected a JSON object"
    doc = functions[name]["parameters"]
    properties = doc.get("properties", {})
    for param in doc.get("required", []):
        if param not in args:
            return f"missing required parameter {param!r}"
    for param, value in args.items():
        if param not in properties or param not in allowed_params:
            return f"unexpected parameter {param!r}"
        error = _value_error(param, value, properties[param], allowed_params[param], language, bfcl_compat)
        if error is not None:
            return error
    for param, allowed in allowed_params.items():
        if param not in args and "" not in allowed:
            return f"missing parameter {param!r} (the answer needs one of {allowed!r})"
    return None


def _python_type(bfcl_type: Any, table: dict[str, type] = PYTHON_TYPES) -> type:
    try:
        return table[bfcl_type]
    except (KeyError, TypeError):
        raise DataError(f"unknown BFCL parameter type {bfcl_type!r}; expected one of {sorted(table)}") from None


def _answer_type(allowed: list[Any]) -> type | None:
    """Type of the first non-optional allowed value (BFCL's ``get_possible_answer_type``)."""
    return next((type(a) for a in allowed if a != ""), None)


_NESTED = {"python": ("array", "tuple"), "java": NESTED_TYPES, "javascript": NESTED_TYPES}


def _value_error(param: str, value: Any, schema: dict[str, Any], allowed: list[Any], language: str = "python",
                 bfcl_compat: bool = False) -> str | None:
    doc_type = schema.get("type")
    table = type_table(language)
    expected_type = _python_type(doc_type, table)
    nested = schema["items"].get("type") if doc_type in _NESTED[language] and "items" in schema else None
    item_type = None if nested is None else _python_type(nested, table)
    if language != "python":
        if type(value) is not str:
            return (f"parameter {param!r}: expected a string holding a {language} {doc_type} value, "
                    f"got {type(value).__name__} ({value!r})")
        try:
            value = decode_value(value, doc_type, language, nested)
        except UndecodableValue as exc:
            return f"parameter {param!r}: {exc}"
    else:
        if isinstance(value, tuple) and (doc_type == "tuple" or not bfcl_compat):
            value = list(value)
        if doc_type == "float" and type(value) is int:
            value = float(value)
    answer_type = _answer_type(allowed)
    if type(value) is expected_type:
        if not _items_typed(value, item_type, allowed):
            return f"parameter {param!r}: expected {doc_type} of {nested}, got {value!r}"
        if answer_type is None or answer_type is expected_type:
            return _allowed_error(param, value, item_type, allowed)
    elif type(value) is not answer_type:
        return f"parameter {param!r}: expected type {doc_type}, got {type(value).__name__} ({value!r})"
    if value not in allowed:
        return f"parameter {param!r}: {value!r} is not one of {allowed!r}"
    return None


def _items_typed(value: Any, item_type: type | None, allowed: list[Any]) -> bool:
    """BFCL's one-level element type check for arrays: some allowed value is not a list, or
    every element has the ``items`` type or the type of that allowed list's first value."""
    if item_type is None:
        return True
    for candidate in allowed:
        if not isinstance(candidate, list):
            return True
        candidate_type = _answer_type(candidate)
        if all(type(v) is item_type or type(v) is candidate_type for v in value):
            return True
    return False


def _allowed_error(param: str, value: Any, item_type: type | None, allowed: list[Any]) -> str | None:
    """Membership of a correctly typed value, compared the way BFCL does for its type."""
    if isinstance(value, dict):
        return _dict_error(param, value, allowed)
    if isinstance(value, list) and item_type is dict:
        return _list_of_dicts_error(param, value, allowed)
    if isinstance(value, str):
        if standardize_string(value) in [standardize_string(a) for a in allowed if isinstance(a, str)]:
            return None
        return f"parameter {param!r}: {value!r} is not one of {allowed!r} (case and punctuation ignored)"
    if isinstance(value, list):
        if _standardize_list(value) in [_standardize_list([] if a == "" else a) for a in allowed]:
            return None
        return f"parameter {param!r}: {value!r} is not one of {allowed!r}"
    if value in allowed:
        return None
    return f"parameter {param!r}: {value!r} is not one of {allowed!r}"


def _standardize_list(items: Any) -> Any:
    if not isinstance(items, list):
        return None
    return [standardize_string(v) if isinstance(v, str) else v for v in items]


def _standardize(value: Any) -> Any:
    return standardize_string(value) if isinstance(value, str) else value


def _dict_error(param: str, value: Any, allowed: list[Any]) -> str | None:
    """``value`` must fit one allowed dict ({key: [allowed values]}); ``""`` entries are skipped."""
    if not isinstance(value, dict):
        return f"parameter {param!r}: expected an object, got {type(value).__name__}"
    error: str | None = f"parameter {param!r}: {value!r} fits no allowed object {allowed!r}"
    for candidate in allowed:
        if candidate == "" or not isinstance(candidate, dict):
            continue
        error = _dict_candidate_error(param, value, candidate)
        if error is None:
            return None
    return error


def _dict_candidate_error(param: str, value: dict[str, Any], candidate: dict[str, list[Any]]) -> str | None:
    for key, item in value.items():
        if key not in candidate:
            return f"parameter {param!r}: unexpected key {key!r}"
        if _standardize(item) not in [_standardize(a) for a in candidate[key]]:
            return f"parameter {param!r}: key {key!r} = {item!r} is not one of {candidate[key]!r}"
    for key, options in candidate.items():
        if key not in value and "" not in options:
            return f"parameter {param!r}: missing key {key!r}"
    return None


def _list_of_dicts_error(param: str, value: list[Any], allowed: list[Any]) -> str | None:
    """``value`` must equal one allowed list of dicts, dict by dict in order."""
    error: str | None = f"parameter {param!r}: {value!r} fits no allowed list {allowed!r}"
    for candidate in allowed:
        candidate = [] if candidate == "" else candidate
        if not isinstance(candidate, list):
            continue
        if len(candidate) != len(value):
            error = f"parameter {param!r}: expected {len(candidate)} objects, got {len(value)}"
            continue
        errors = (_dict_error(param, v, [c]) for v, c in zip(value, candidate, strict=True))
        error = next((e for e in errors if e is not None), None)
        if error is None:
            return None
    return error
