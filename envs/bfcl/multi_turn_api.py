"""BFCL's stateful API classes, one fresh set per episode, called without ``eval``.

The classes (``GorillaFileSystem``, ``MathAPI``, ``MessageAPI``, ``TwitterAPI``, ``TicketAPI``,
``TradingBot``, ``TravelAPI``, ``VehicleControlAPI``) are imported from the ``bfcl-eval`` wheel
(``bfcl_eval/eval_checker/multi_turn_eval/func_source_code/``): they need only the standard
library and ``mpmath`` (already a dependency of torch's ``sympy``), none of bfcl-eval's heavy
dependencies, so the wheel installed with ``--no-deps`` is enough.

:class:`ApiSession` does what BFCL's ``execute_multi_turn_func_call``
(``multi_turn_eval/multi_turn_utils.py``) does, without its two hazards: BFCL keeps instances in
module globals keyed by model name and task id (state leaks between runs of the same task) and
runs each call with ``eval`` of a string. Here every session owns its instances, loaded with
``_load_scenario(deepcopy(initial_config[cls]), long_context=...)`` (not for the stateless
``MathAPI``), and a call is a lookup of a public method by name plus ``method(**arguments)``.
As in BFCL, any public method of an involved class can be called (a later class wins a name
clash; there is none in v4), and results become strings the same way: a ``str`` as is, a ``dict``
as ``json.dumps`` (``str`` if that fails), anything else ``str``; an exception becomes
``"Error during execution: <message>"``.

Three guards BFCL lacks: arguments are deep-copied and omitted mutable defaults (``mentions=[]``)
filled with fresh copies, so no state is shared with the caller or between episodes (BFCL
shares each such default between every call, the model's and the ground truth's instances of
every task in the process: a ``mention`` on a tweet posted without mentions also shows up in
the ground truth's tweets; a session given a ``shared_defaults`` pool reproduces that within one
episode, which is what ``bfcl_compat`` uses); ``MathAPI``
calls run under one process-wide lock (``logarithm`` sets the process-global ``mpmath.mp.dps``,
so concurrent episodes would race); and arguments that would run for minutes (``power``
exponents beyond :data:`MAX_EXPONENT`, ``precision`` beyond :data:`MAX_PRECISION`) are refused
with an error result. BFCL's ground truth stays far inside these limits.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import inspect
import json
import threading
from collections.abc import Callable
from typing import Any

from relax_agent.envs.bfcl.multi_turn_data import API_CLASSES
from relax_agent.errors import DataError

SOURCE_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
STATELESS_CLASSES: tuple[str, ...] = ("MathAPI",)
MAX_EXPONENT = 10_000
MAX_PRECISION = 1_000
ERROR_PREFIX = "Error during execution: "
_MATH_LOCK = threading.Lock()


@functools.cache
def api_class(class_name: str) -> type:
    """The BFCL API class named ``class_name``, imported from the bfcl-eval wheel.

    Raises:
        DataError: unknown class name, or bfcl-eval is not installed.
    """
    if class_name not in API_CLASSES:
        raise DataError(f"unknown BFCL API class {class_name!r}; expected one of {sorted(API_CLASSES)}")
    module = f"{SOURCE_PACKAGE}.{API_CLASSES[class_name][0]}"
    try:
        return getattr(importlib.import_module(module), class_name)
    except ImportError as exc:
        raise DataError(f"cannot import {module} ({exc}); install the data wheel: pip install --no-deps bfcl-eval") from exc


def format_result(result: Any) -> str:
    """A call's return value as BFCL records it (``str``, ``json.dumps`` of a dict, else ``str``)."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


def parse_call(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """Parse one ground-truth call string such as ``"mv(source='a', destination='b')"``.

    Returns:
        (function name, positional values, keyword values); values are Python literals.

    Raises:
        DataError: not a single call of a plain name with literal arguments.
    """
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError("not a call of a plain function name")
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        if len(kwargs) != len(node.keywords):
            raise ValueError("**kwargs are not supported")
    except (SyntaxError, ValueError) as exc:
        raise DataError(f"BFCL call {text!r} is not a call with literal arguments: {exc}") from None
    return node.func.id, args, kwargs


def _guard_error(class_name: str, arguments: dict[str, Any]) -> str | None:
    if class_name != "MathAPI":
        return None
    exponent, precision = arguments.get("exponent"), arguments.get("precision")
    if isinstance(exponent, (int, float)) and abs(exponent) > MAX_EXPONENT:
        return f"exponent {exponent!r} is outside the range this environment runs (|exponent| <= {MAX_EXPONENT})"
    if isinstance(precision, (int, float)) and precision > MAX_PRECISION:
        return f"precision {precision!r} is above the largest this environment runs ({MAX_PRECISION})"
    return None


class ApiSession:
    """Fresh instances of a task's API classes, and calls on them.

    Args:
        involved_classes: class names (keys of :data:`API_CLASSES`), in the task's order.
        initial_config: ``{class name: scenario dict}``; deep-copied, never mutated.
        long_context: load the scenarios as BFCL's long-context category does.
        shared_defaults: None (each omitted mutable default gets a fresh copy per call), or a
            dict that sessions share: an omitted mutable default is then one object per
            ``(class, method, parameter)`` for every call of every session holding the dict,
            as the Python default itself is in BFCL.

    Raises:
        DataError: an unknown class, or bfcl-eval is not installed.
    """

    def __init__(self, involved_classes: list[str], initial_config: dict[str, Any], long_context: bool = False,
                 shared_defaults: dict[tuple[str, str, str], Any] | None = None):
        self.shared_defaults = shared_defaults
        self.instances: dict[str, Any] = {}
        self._methods: dict[str, tuple[str, Callable[..., Any]]] = {}
        for class_name in involved_classes:
            instance = api_class(class_name)()
            if class_name not in STATELESS_CLASSES:
                instance._load_scenario(copy.deepcopy(initial_config.get(class_name, {})), long_context=long_context)
            self.instances[class_name] = instance
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self._methods[name] = (class_name, method)

    def has(self, name: Any) -> bool:
        """True when ``name`` is a public method of one of the session's classes."""
        return isinstance(name, str) and name in self._methods

    def signature(self, name: str) -> inspect.Signature:
        """The signature of method ``name`` (which :meth:`has`)."""
        return inspect.signature(self._methods[name][1])

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Call method ``name`` with keyword ``arguments``; returns BFCL's result string.

        Never raises for bad model input: an unknown name, arguments that do not fit, or an
        exception inside the method become an ``"Error during execution: ..."`` result.
        """
        if not self.has(name):
            return f"{ERROR_PREFIX}name {name!r} is not defined"
        if not isinstance(arguments, dict) or not all(isinstance(k, str) for k in arguments):
            return f"{ERROR_PREFIX}arguments of {name} must be a JSON object, got {type(arguments).__name__}"
        class_name, method = self._methods[name]
        guard = _guard_error(class_name, arguments)
        if guard is not None:
            return ERROR_PREFIX + guard
        arguments = self._own_arguments(class_name, name, arguments)
        try:
            if class_name == "MathAPI":
                with _MATH_LOCK:
                    result = method(**arguments)
            else:
                result = method(**arguments)
        except Exception as exc:  # the API's own failure is the call's result, as in BFCL
            return f"{ERROR_PREFIX}{exc}"
        return format_result(result)

    def _own_arguments(self, class_name: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """A deep copy of ``arguments`` plus fresh copies of omitted mutable defaults (from the
        ``shared_defaults`` pool when the session has one).

        The instances keep argument objects in their state (``post_tweet`` stores its
        ``mentions`` list, which ``mention`` later extends): without the copy, the episode's state
        would alias the caller's message, and an omitted ``mentions=[]`` default, one list shared
        by every ``TwitterAPI`` in the process, would carry one episode's mentions into the next.
        """
        own = copy.deepcopy(arguments)
        for param in self.signature(name).parameters.values():
            if param.name not in own and isinstance(param.default, (list, dict, set)):
                if self.shared_defaults is None:
                    own[param.name] = copy.deepcopy(param.default)
                else:
                    key = (class_name, name, param.name)
                    own[param.name] = self.shared_defaults.setdefault(key, copy.deepcopy(param.default))
        return own

    def keyword_call(self, text: str) -> tuple[str, dict[str, Any]]:
        """A ground-truth call string as ``(name, keyword arguments)``, positional ones bound by name.

        Raises:
            DataError: the string does not parse, names no method of the session, or its
                arguments do not fit the method's signature.
        """
        name, args, kwargs = parse_call(text)
        if not self.has(name):
            raise DataError(f"BFCL call {text!r} names no method of {list(self.instances)}")
        try:
            bound = self.signature(name).bind(*args, **kwargs)
        except TypeError as exc:
            raise DataError(f"BFCL call {text!r} does not fit {name}{self.signature(name)}: {exc}") from None
        return name, dict(bound.arguments)

    def state(self) -> dict[str, dict[str, Any]]:
        """``{class name: {public attribute: value}}``: what BFCL's state check compares."""
        return {c: {k: v for k, v in vars(i).items() if not k.startswith("_")} for c, i in self.instances.items()}
