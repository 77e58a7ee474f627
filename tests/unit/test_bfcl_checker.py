"""BFCL AST checker: hand-written rules, and every shipped task against BFCL's own checker.

BFCL's ``ast_checker.py`` imports ``MODEL_CONFIG_MAPPING`` from
``bfcl_eval.constants.model_config``, which imports every model handler (openai, google,
boto3, ...). The ``bfcl_reference`` fixture loads ``ast_checker.py`` from the wheel as a
private module with only that one module stubbed (a mapping whose models keep dots in
function names); its other imports (enums, type mappings, Java/JS converters) are plain
modules of the wheel. The stub lives in ``sys.modules`` only while the file executes.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from relax_agent.envs.bfcl.checker import CheckResult, check_calls, reward, standardize_string
from relax_agent.envs.bfcl.data import data_dir, load_tasks
from relax_agent.errors import ConfigError

SCORED = ["simple_python", "multiple", "parallel", "parallel_multiple"]
"""The non-live Python AST categories; the other categories are checked in test_bfcl_categories.py."""


# ---------------------------------------------------------------- BFCL's own checker
@pytest.fixture(scope="module")
def bfcl_reference():
    """BFCL's ``ast_checker`` function, or skip when the wheel's file is absent."""
    path = data_dir().parent / "eval_checker" / "ast_eval" / "ast_checker.py"
    if not path.is_file():
        pytest.skip(f"{path} not in the installed bfcl-eval")
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = _KeepDots()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "bfcl_eval.constants.model_config", stub)
        spec = importlib.util.spec_from_file_location("_bfcl_reference_ast_checker", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    from bfcl_eval.constants.enums import Language

    def verdict(calls: list[dict[str, Any]], task: dict[str, Any]) -> bool:
        output = [{c["name"]: c["arguments"]} for c in copy.deepcopy(calls)]
        result = module.ast_checker(
            copy.deepcopy(task["functions"]),
            output,
            copy.deepcopy(task["possible_answer"]),
            Language.PYTHON,
            task["category"],
            "stub-model",
        )
        return bool(result["valid"])

    return verdict


class _KeepDots(dict):
    def __missing__(self, key):
        return types.SimpleNamespace(underscore_to_dot=False)


# ---------------------------------------------------------------- ground truth and corruptions
def _first(allowed: list[Any]) -> Any:
    return next(a for a in allowed if a != "")


def _build(value: Any, schema: dict[str, Any]) -> Any:
    """Turn an allowed value into a concrete one (nested answers hold lists of allowed values)."""
    if schema.get("type") == "dict" and isinstance(value, dict):
        return {k: _first(v) for k, v in value.items() if any(x != "" for x in v)}
    if schema.get("items", {}).get("type") == "dict" and isinstance(value, list):
        return [_build(v, schema["items"]) for v in value]
    return value


def ground_truth_calls(task: dict[str, Any]) -> list[dict[str, Any]]:
    """First allowed value of every parameter; parameters whose only allowed value is ""
    are left out, and so are the two optional ones the answers list but the docs lack
    (``permeability`` in parallel_multiple_12, ``type`` in parallel_multiple_26)."""
    docs = {f["name"]: f for f in task["functions"]}
    calls = []
    for expected in task["possible_answer"]:
        ((name, params),) = expected.items()
        props = docs[name]["parameters"]["properties"]
        args = {
            p: _build(_first(allowed), props[p])
            for p, allowed in params.items()
            if any(a != "" for a in allowed) and (p in props or "" not in allowed)
        }
        calls.append({"name": name, "arguments": args})
    return calls


def _outside(value: Any, allowed: list[Any]) -> Any:
    """A value of the same type as ``value`` that ``allowed`` does not admit, or None."""
    if isinstance(value, bool):
        candidate = not value
        return None if candidate in allowed else candidate
    if isinstance(value, (int, float)):
        return value + 1000003
    if isinstance(value, str):
        return value + " qzx"
    if isinstance(value, list) and value and not isinstance(value[0], (dict, list)):
        return value + [value[0]]
    return None


def corruptions(task: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Named wrong versions of the ground-truth ``calls`` (a kind is absent when the task has no spot for it)."""
    docs = {f["name"]: f for f in task["functions"]}
    out = {}
    bad = copy.deepcopy(calls)
    bad[0]["name"] += "_wrong"
    out["wrong_name"] = bad
    out["extra_call"] = copy.deepcopy(calls) + [copy.deepcopy(calls[0])]
    for i, call in enumerate(calls):
        doc = docs[call["name"]]["parameters"]
        required = [p for p in doc["required"] if p in call["arguments"]]
        if required and "missing_required" not in out:
            bad = copy.deepcopy(calls)
            del bad[i]["arguments"][required[0]]
            out["missing_required"] = bad
        for param, value in call["arguments"].items():
            allowed = task["possible_answer"][i][call["name"]][param]
            if "wrong_type" not in out:
                bad = copy.deepcopy(calls)
                wrong = "not an object" if doc["properties"][param]["type"] == "dict" else {"wrong": 1}
                bad[i]["arguments"][param] = wrong
                out["wrong_type"] = bad
            new = _outside(value, allowed)
            if "not_allowed" not in out and new is not None:
                bad = copy.deepcopy(calls)
                bad[i]["arguments"][param] = new
                out["not_allowed"] = bad
    return out


@pytest.fixture(scope="module")
def all_tasks():
    return {c: load_tasks(c) for c in [*SCORED, "irrelevance"]}


# ---------------------------------------------------------------- every shipped task
@pytest.mark.parametrize("category", SCORED)
def test_ground_truth_is_correct_and_corruptions_are_not(category, all_tasks):
    kinds_seen = {"wrong_name": 0, "extra_call": 0, "missing_required": 0, "wrong_type": 0, "not_allowed": 0}
    for task in all_tasks[category]:
        calls = ground_truth_calls(task)
        result = check_calls(calls, task)
        assert result == CheckResult(True, True, "ok"), (task["id"], calls, result)
        for kind, bad in corruptions(task, calls).items():
            kinds_seen[kind] += 1
            result = check_calls(bad, task)
            assert not result.correct, (task["id"], kind, bad)
            assert result.well_formed == (kind != "wrong_name"), (task["id"], kind, result)
            assert result.reason != "ok"
    n = len(all_tasks[category])
    assert kinds_seen["wrong_name"] == kinds_seen["extra_call"] == kinds_seen["wrong_type"] == n
    # every task has a required parameter; one multiple and one parallel_multiple task have no
    # parameter value that can be moved outside its allowed list by _outside
    assert kinds_seen["missing_required"] == n and kinds_seen["not_allowed"] >= n - 1, kinds_seen


@pytest.mark.parametrize("category", ["parallel", "parallel_multiple"])
def test_parallel_ground_truth_in_any_order_is_correct(category, all_tasks):
    for task in all_tasks[category]:
        calls = ground_truth_calls(task)[::-1]
        assert check_calls(calls, task).correct, task["id"]


def test_irrelevance_expects_no_call(all_tasks):
    for task in all_tasks["irrelevance"]:
        assert task["possible_answer"] == []
        assert check_calls([], task) == CheckResult(True, True, "ok")
        first = task["functions"][0]["name"]
        result = check_calls([{"name": first, "arguments": {}}], task)
        assert (result.correct, result.well_formed) == (False, False)


# Tasks whose reversed ground truth BFCL's greedy pairing rejects: in parallel_178 the first
# expected call allows company "Microsoft" or "Apple", so, reversed, it takes the Apple call
# that the third expected call needs. A one-to-one assignment exists; we accept it.
GREEDY_ORDER_FAILURES = {"parallel_178"}


@pytest.mark.parametrize("category", SCORED)
def test_verdicts_equal_bfcl_reference(category, all_tasks, bfcl_reference):
    differ = set()
    for task in all_tasks[category]:
        calls = ground_truth_calls(task)
        variants = {"ground_truth": calls, "reversed": calls[::-1], **corruptions(task, calls)}
        for kind, variant in variants.items():
            ours, theirs = check_calls(variant, task).correct, bfcl_reference(variant, task)
            if kind == "reversed" and (ours, theirs) == (True, False):
                differ.add(task["id"])
                continue
            assert ours == theirs, (task["id"], kind, variant)
    assert differ == {t["id"] for t in all_tasks[category]} & GREEDY_ORDER_FAILURES


# ---------------------------------------------------------------- hand-written rules
def _task(category: str, functions: list[dict[str, Any]], answer: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": "t", "category": category, "functions": functions, "possible_answer": answer}


def _fn(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    parameters = {"type": "dict", "properties": properties, "required": required}
    return {"name": name, "description": "", "parameters": parameters}


WEATHER = _fn(
    "weather.get",
    {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "lat": {"type": "float"},
        "metric": {"type": "boolean"},
        "coords": {"type": "array", "items": {"type": "float"}},
        "units": {"type": "string"},
    },
    ["city"],
)
WEATHER_TASK = _task(
    "simple_python",
    [WEATHER],
    [{"weather.get": {"city": ["New York, NY"], "days": [3, ""], "lat": [40.0, ""], "metric": [True, ""],
                      "coords": [[40.5, -74.0], ""], "units": ["celsius", ""]}}],
)


def _one(**args: Any) -> list[dict[str, Any]]:
    return [{"name": "weather.get", "arguments": args}]


@pytest.mark.parametrize(
    ("args", "correct"),
    [
        ({"city": "new york ny"}, True),  # case, spaces and commas ignored
        ({"city": "New-York/NY."}, True),
        ({"city": "Boston"}, False),
        ({"city": "New York, NY", "days": 3, "lat": 40}, True),  # int accepted for float
        ({"city": "New York, NY", "days": 3.0}, False),  # float not accepted for integer
        ({"city": "New York, NY", "days": True}, False),  # bool is not an integer
        ({"city": "New York, NY", "metric": 1}, False),  # int is not a bool
        ({"city": "New York, NY", "coords": [40.5, -74.0]}, True),
        ({"city": "New York, NY", "coords": [-74.0, 40.5]}, False),  # order matters in lists
        ({"city": "New York, NY", "coords": [40.5, -74]}, True),  # element types unchecked: "" is allowed
        ({"city": "New York, NY", "coords": []}, True),  # "" allowed stands for the empty list
        ({"city": "New York, NY", "units": ""}, True),  # "" allowed: the empty string passes
        ({"city": "New York, NY", "wind": 3}, False),  # unknown parameter
        ({"days": 3}, False),  # required parameter missing
        ({"city": 12}, False),
    ],
)
def test_simple_rules(args, correct, bfcl_reference):
    assert check_calls(_one(**args), WEATHER_TASK).correct is correct
    assert bfcl_reference(_one(**args), WEATHER_TASK) is correct


def test_array_element_types_are_checked_as_bfcl_does(bfcl_reference):
    """One level deep, against the doc's items type or the allowed list's own first value."""
    fn = _fn("route", {"coords": {"type": "array", "items": {"type": "float"}}}, ["coords"])
    as_floats = _task("simple_python", [fn], [{"route": {"coords": [[40.0, -74.0]]}}])
    as_ints = _task("simple_python", [fn], [{"route": {"coords": [[40, -74]]}}])
    for task, value, correct in [
        (as_floats, [40.0, -74.0], True),
        (as_floats, [40, -74], False),
        (as_ints, [40, -74], True),
        (as_ints, [40.0, -74.0], True),
        (as_floats, [40.0, "-74"], False),
    ]:
        calls = [{"name": "route", "arguments": {"coords": value}}]
        assert check_calls(calls, task).correct is correct, (task["possible_answer"], value)
        assert bfcl_reference(calls, task) is correct


def test_tuples_count_as_arrays(bfcl_reference):
    """BFCL accepts a tuple only for its ``tuple`` type; we accept one for ``array`` too
    (JSON arguments never hold tuples; this matters only for calls built in Python)."""
    calls = _one(city="New York, NY", coords=(40.5, -74.0))
    assert check_calls(calls, WEATHER_TASK).correct
    assert not bfcl_reference(calls, WEATHER_TASK)


def test_answer_parameter_without_empty_option_must_be_given():
    task = _task("simple_python", [WEATHER], [{"weather.get": {"city": ["Paris"], "days": [3]}}])
    result = check_calls(_one(city="Paris"), task)
    assert not result.correct and "'days'" in result.reason


def test_variable_answers_compare_as_is(bfcl_reference):
    """An answer naming a variable (a string for an array parameter) is matched exactly."""
    fn = _fn("plot", {"x": {"type": "array", "items": {"type": "float"}}}, ["x"])
    task = _task("simple_python", [fn], [{"plot": {"x": ["data['sales']"]}}])
    for value, correct in [("data['sales']", True), ('data["sales"]', False), ([1.0], False)]:
        calls = [{"name": "plot", "arguments": {"x": value}}]
        assert check_calls(calls, task).correct is correct
        assert bfcl_reference(calls, task) is correct


def test_dict_and_list_of_dict_values(bfcl_reference):
    fn = _fn(
        "db.query",
        {
            "where": {"type": "dict", "properties": {"dept": {"type": "string"}, "school": {"type": "string"}}},
            "rules": {
                "type": "array",
                "items": {"type": "dict", "properties": {"f": {"type": "string"}, "v": {"type": "integer"}}},
            },
        },
        ["where"],
    )
    answer = {
        "where": [{"dept": ["Science"], "school": ["Bluebird HS", ""]}],
        "rules": [[{"f": ["age"], "v": [25]}, {"f": ["job"], "v": [1]}], ""],
    }
    task = _task("simple_python", [fn], [{"db.query": answer}])
    cases = [
        ({"where": {"school": "bluebird hs", "dept": "science"}}, True),
        ({"where": {"dept": "Science"}}, True),
        ({"where": {"school": "Bluebird HS"}}, False),  # missing key
        ({"where": {"dept": "Science", "room": "1"}}, False),  # unexpected key
        ({"where": {"dept": "Science"}, "rules": [{"f": "Age", "v": 25}, {"f": "job", "v": 1}]}, True),
        ({"where": {"dept": "Science"}, "rules": [{"f": "job", "v": 1}, {"f": "age", "v": 25}]}, False),
        ({"where": {"dept": "Science"}, "rules": [{"f": "age", "v": 25}]}, False),
        ({"where": {"dept": "Science"}, "rules": []}, True),
    ]
    for args, correct in cases:
        calls = [{"name": "db.query", "arguments": args}]
        assert check_calls(calls, task).correct is correct, args
        assert bfcl_reference(calls, task) is correct, args


def _pair_task() -> dict[str, Any]:
    fn = _fn("f", {"x": {"type": "integer"}}, ["x"])
    return _task("parallel", [fn], [{"f": {"x": [1, 2]}}, {"f": {"x": [1]}}])


def test_parallel_matching_is_one_to_one_and_order_free():
    task = _pair_task()
    calls = lambda *xs: [{"name": "f", "arguments": {"x": x}} for x in xs]  # noqa: E731
    assert check_calls(calls(2, 1), task).correct
    assert not check_calls(calls(1, 1, 2), task).correct  # count
    assert not check_calls(calls(2, 2), task).correct  # no call for the second expected one


def test_parallel_matching_beyond_bfcl_greedy(bfcl_reference):
    """BFCL pairs expected calls with the first fitting model call, in order; calls (1, 2)
    fail there (x=1 is taken by the first expected call) although a one-to-one assignment
    exists. We accept them (see GREEDY_ORDER_FAILURES for the one shipped task where it matters)."""
    calls = [{"name": "f", "arguments": {"x": 1}}, {"name": "f", "arguments": {"x": 2}}]
    assert check_calls(calls, _pair_task()).correct
    assert not bfcl_reference(calls, _pair_task())


def test_well_formed_rules():
    assert check_calls([], WEATHER_TASK) == CheckResult(False, False, "no tool call")
    result = check_calls([{"name": "weather.get", "arguments": '{"city": '}], WEATHER_TASK)
    assert (result.correct, result.well_formed) == (False, False) and "str" in result.reason
    result = check_calls(_one(city="Rome"), WEATHER_TASK)
    assert (result.correct, result.well_formed) == (False, True) and "'city'" in result.reason
    result = check_calls([{"name": "weather_get", "arguments": {"city": "New York, NY"}}], WEATHER_TASK)
    assert (result.correct, result.well_formed) == (False, False)  # dots are part of the name


def test_reward_values():
    assert reward(CheckResult(True, True, "ok")) == 1.0
    assert reward(CheckResult(False, True, "x")) == 0.1
    assert reward(CheckResult(False, True, "x"), partial_credit=0.3) == 0.3
    assert reward(CheckResult(False, False, "x"), partial_credit=0.3) == 0.0
    assert reward(CheckResult(True, True, "ok"), partial_credit=0.0) == 1.0
    with pytest.raises(ConfigError, match="partial_credit"):
        reward(CheckResult(False, True, "x"), partial_credit=1.5)


def test_standardize_string_matches_bfcl():
    assert standardize_string("April 1, 2024") == standardize_string("april 1 2024") == "april12024"
    assert standardize_string("It's a_b*c^d") == 'it"sabcd'
    assert Path(data_dir()).is_dir()
