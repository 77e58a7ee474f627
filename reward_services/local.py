"""In-process rewards: turn a user's Python function into a :class:`RewardFunction`.

The function is named ``module:function`` or ``path/to/file.py:function`` and may be sync or
async, per-item or batched; its parameter names say which:

- per-item: any of ``id, messages, response, ground_truth, metadata`` (passed by keyword),
  ``item`` (the whole :class:`RewardItem`), or ``**kwargs`` (all fields);
- batched: one parameter named ``items`` (a ``list[RewardItem]``); it returns one value per
  item, in order, and may put an ``Exception`` in the list to fail just that item.

A returned value is a number (the reward), a dict ``{"reward", "metrics"?, "extra"?}``, or a
:class:`RewardResult`. Sync functions run in a thread pool, never on the event loop. Each
item gets ``timeout_s`` (a batched call gets ``timeout_s`` for the whole call); an exception
(``sys.exit`` and ``KeyboardInterrupt`` included) or overrun becomes ``status: error`` /
``timeout`` for that item only. A sync function that overruns keeps running in its thread
(Python cannot stop a thread); the item is answered ``timeout`` at once, and
:meth:`LocalReward.health` reports when such calls hold every slot.
A returned number must be finite in float32 and not a bool (see
:func:`~relax_agent.reward_services.protocol.check_number`).

A class (or any target given ``kwargs``) is a factory: it is called with ``kwargs`` and the
object it returns is the reward function (how the LLM judge takes its endpoint and rubric).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import numbers
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from relax_agent.errors import ConfigError, RewardServiceError
from relax_agent.reward_services.protocol import RewardItem, RewardResult, RewardStatus, check_number, invalid_fields

log = logging.getLogger("relax_agent.reward_services")

ITEM_FIELDS = ("id", "messages", "response", "ground_truth", "metadata")


def load_target(target: str) -> Any:
    """Import the object named by ``module:attr`` or ``path/to/file.py:attr``.

    ``attr`` may be dotted (``module:Class.method``). For the module form the current
    directory is put on ``sys.path`` first (as ``python -m`` and uvicorn do), so an
    uninstalled project's ``examples.custom_reward.reward:score`` imports.

    Raises:
        ConfigError: malformed target, missing file or module, or missing attribute.
    """
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise ConfigError(f"reward target {target!r} must look like 'module:function' or 'path/to/file.py:function'")
    module = _load_file(module_part, target) if _is_path(module_part) else _import_module(module_part, target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"reward target {target!r}: {obj.__name__ if obj is module else obj!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _is_path(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


def _import_module(name: str, target: str) -> Any:
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise ConfigError(f"reward target {target!r}: no module named {exc.name!r} (searched sys.path and {cwd})") from exc
        raise


def _load_file(path_str: str, target: str) -> Any:
    path = Path(path_str).resolve()
    if not path.is_file():
        raise ConfigError(f"reward target {target!r}: file {str(path)!r} does not exist")
    name = f"_relax_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def resolve_target(target: str) -> str:
    """``target`` with a relative file path made absolute (for processes with another cwd)."""
    module_part, _, attr = target.rpartition(":")
    if module_part and _is_path(module_part):
        return f"{Path(module_part).resolve()}:{attr}"
    return target


def make_callable(obj: Any, kwargs: dict[str, Any] | None, target: str) -> Callable[..., Any]:
    """The reward callable: ``obj`` itself, or ``obj(**kwargs)`` for a class or when kwargs are given.

    Raises:
        ConfigError: the result is not callable, or the factory rejects ``kwargs``.
    """
    if inspect.isclass(obj) or kwargs:
        try:
            obj = obj(**(kwargs or {}))
        except TypeError as exc:
            raise ConfigError(f"reward target {target!r} could not be built with kwargs {kwargs!r}: {exc}") from exc
    if not callable(obj):
        raise ConfigError(f"reward target {target!r} is a {type(obj).__name__}, expected a function or callable object")
    return obj


def _call_plan(fn: Callable[..., Any], name: str) -> tuple[bool, tuple[str, ...], bool]:
    """(batched, item parameter names, takes **kwargs) from ``fn``'s signature."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"reward function {name}: cannot read its signature ({exc})") from exc
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    if "items" in names:
        others = [p.name for p in params if p.name != "items" and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if others:
            raise ConfigError(f"batched reward function {name} must take only 'items'; it also requires {others}")
        return True, ("items",), False
    allowed = (*ITEM_FIELDS, "item")
    used = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in allowed:
            used.append(p.name)
        elif p.default is p.empty:
            raise ConfigError(
                f"reward function {name} has required parameter {p.name!r}; a per-item reward takes any of "
                f"{', '.join(allowed)} (by name), a batched one takes 'items'"
            )
    return False, tuple(used), var_kw


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004 -- not a callable check: an object whose __call__ is async


def to_result(item_id: str, value: Any) -> RewardResult:
    """Normalise what a reward function returned into a :class:`RewardResult` for ``item_id``.

    Raises:
        TypeError / ValueError: the value is not a finite number, a dict with ``reward``, or a
            RewardResult (the caller turns this into ``status: error``).
    """
    if isinstance(value, RewardResult):
        return _json_safe(value if value.id == item_id else value.model_copy(update={"id": item_id}))
    if isinstance(value, numbers.Real):  # bool included: check_number refuses it by name
        return RewardResult(id=item_id, reward=check_number(value, "reward"))
    if isinstance(value, dict) and "reward" in value:
        try:
            return _json_safe(RewardResult.model_validate({**value, "id": item_id}))
        except ValidationError as exc:
            raise ValueError(f"reward function returned an invalid result: {invalid_fields(exc)}") from None
    raise TypeError(
        f"reward function returned {type(value).__name__} {repr(value)[:80]}; expected a number, "
        "a dict with 'reward' (and optional 'metrics', 'extra'), or a RewardResult"
    )


def _json_safe(result: RewardResult) -> RewardResult:
    """``result`` with ``extra`` made JSON-safe (other objects become their ``str``), so one
    item can never break the serialization of a whole batch (metrics that are not finite
    numbers were already dropped by :class:`RewardResult` itself)."""
    if not result.extra:
        return result
    return result.model_copy(update={"extra": json.loads(json.dumps(result.extra, default=str))})


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def error_result(item_id: str, exc: BaseException) -> RewardResult:
    """``status: error`` for ``item_id`` naming the exception and where it was raised."""
    return RewardResult.failed(item_id, RewardStatus.ERROR, f"{type(exc).__name__}: {exc}{_where(exc)}")


def _exit_error(name: str, exc: BaseException) -> RewardServiceError:
    """The item error for a reward function that called ``sys.exit`` or raised ``KeyboardInterrupt``."""
    return RewardServiceError(
        f"reward function {name} raised {type(exc).__name__}({exc}){_where(exc)}; it must return a reward or raise "
        "an Exception (exiting would end the service or the training run, so the call was failed instead)")


class _Call:
    """One invocation of the reward function; ``abandoned`` once its caller was answered ``timeout``."""

    __slots__ = ("abandoned",)

    def __init__(self) -> None:
        self.abandoned = False


class LocalReward:
    """A Python reward function as a :class:`RewardFunction`.

    Args:
        fn: the reward function (see the module docstring for signatures).
        timeout_s: deadline per item (per call for a batched function), seconds.
        max_concurrency: items scored at once (and threads for sync functions).
        name: used in error messages and logs.
    """

    def __init__(self, fn: Callable[..., Any], *, timeout_s: float = 30.0, max_concurrency: int = 64, name: str | None = None):
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency!r}")
        self.fn = fn
        # not ``name or getattr(...)``: mypy types that ``str | Any | None``
        self.name: str = name if name else getattr(fn, "__qualname__", type(fn).__name__)
        self.timeout_s = timeout_s
        self.batched, self._params, self._var_kw = _call_plan(fn, self.name)
        self._is_async = _is_async(fn)
        self._max_concurrency = max_concurrency
        self._sem_loop: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._pool = None if self._is_async else ThreadPoolExecutor(max_concurrency, thread_name_prefix="reward")
        self._running: set[_Call] = set()  # calls executing now (not merely queued)
        self._running_lock = threading.Lock()

    @classmethod
    def from_target(cls, target: str, kwargs: dict[str, Any] | None = None, **options: Any) -> LocalReward:
        """Load ``module:function`` / ``file.py:function`` (see :func:`load_target`) and wrap it."""
        fn = make_callable(load_target(target), kwargs, target)
        return cls(fn, name=target, **options)

    async def score(self, items: list[RewardItem]) -> list[RewardResult]:
        """One result per item, in order; failures become error/timeout results."""
        if not items:
            return []
        if self.batched:
            return await self._score_batch(items)
        return list(await asyncio.gather(*(self._score_one(item) for item in items)))

    def _semaphore(self) -> asyncio.Semaphore:
        """The concurrency limit of the running event loop (callers may use ``asyncio.run`` per step)."""
        loop = asyncio.get_running_loop()
        if self._sem_loop is None or self._sem_loop[0] is not loop:
            self._sem_loop = (loop, asyncio.Semaphore(self._max_concurrency))
        return self._sem_loop[1]

    async def _score_one(self, item: RewardItem) -> RewardResult:
        kwargs = {k: item if k == "item" else getattr(item, k) for k in self._params}
        if self._var_kw:
            kwargs.update({k: getattr(item, k) for k in ITEM_FIELDS if k not in kwargs})
        async with self._semaphore():
            try:
                call = _Call()
                value = await asyncio.wait_for(self._invoke(kwargs, call), self.timeout_s)
                return to_result(item.id, value)
            except asyncio.TimeoutError:
                call.abandoned = True
                return RewardResult.failed(item.id, RewardStatus.TIMEOUT, f"{self.name} took longer than timeout_s={self.timeout_s}")
            except Exception as exc:  # one item's failure is data, not a crash of the batch
                log.warning("reward %s failed on item %r", self.name, item.id, exc_info=True)
                return error_result(item.id, exc)

    async def _score_batch(self, items: list[RewardItem]) -> list[RewardResult]:
        async with self._semaphore():
            try:
                call = _Call()
                values = await asyncio.wait_for(self._invoke({"items": list(items)}, call), self.timeout_s)
            except asyncio.TimeoutError:
                call.abandoned = True
                cause = f"{self.name} took longer than timeout_s={self.timeout_s} for a batch of {len(items)}"
                return [RewardResult.failed(i.id, RewardStatus.TIMEOUT, cause) for i in items]
            except Exception as exc:
                log.warning("batched reward %s failed on %d items", self.name, len(items), exc_info=True)
                return [error_result(i.id, exc) for i in items]
        if not isinstance(values, (list, tuple)) or len(values) != len(items):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            cause = f"batched reward {self.name} returned {got} for {len(items)} items"
            return [RewardResult.failed(i.id, RewardStatus.ERROR, cause) for i in items]
        return [self._batch_value(item, value) for item, value in zip(items, values, strict=True)]

    @staticmethod
    def _batch_value(item: RewardItem, value: Any) -> RewardResult:
        if isinstance(value, BaseException):
            return error_result(item.id, value)
        try:
            return to_result(item.id, value)
        except Exception as exc:
            return error_result(item.id, exc)

    async def _invoke(self, kwargs: dict[str, Any], call: _Call) -> Any:
        """Call the function; ``sys.exit`` and ``KeyboardInterrupt`` from it become a RewardServiceError."""
        try:
            if self._is_async:
                with self._tracked(call):
                    return await self.fn(**kwargs)
            loop = asyncio.get_running_loop()
            value = await loop.run_in_executor(self._pool, functools.partial(self._call_in_thread, kwargs, call))
            if inspect.isawaitable(value):
                value = await value
            return value
        except (SystemExit, KeyboardInterrupt) as exc:
            raise _exit_error(self.name, exc) from None

    def _call_in_thread(self, kwargs: dict[str, Any], call: _Call) -> Any:
        with self._tracked(call):
            return self.fn(**kwargs)

    @contextlib.contextmanager
    def _tracked(self, call: _Call) -> Iterator[None]:
        """Count ``call`` as executing while the body runs."""
        with self._running_lock:
            self._running.add(call)
        try:
            yield
        finally:
            with self._running_lock:
                self._running.discard(call)

    def health(self) -> str | None:
        """Why this reward cannot take more work, or None when it can.

        Unhealthy when every one of the ``max_concurrency`` slots is held by a call running
        past ``timeout_s`` (a sync function that hangs keeps its thread: Python cannot stop it),
        so every new item would only wait and time out.
        """
        with self._running_lock:
            overdue = sum(1 for call in self._running if call.abandoned)
        if overdue >= self._max_concurrency:
            return (f"all {self._max_concurrency} slots of {self.name} (max_concurrency) are held by calls running "
                    f"past timeout_s={self.timeout_s:g}; new items would only time out")
        return None

    async def aclose(self) -> None:
        """Close the function's own resources (its ``aclose``/``close``) and the thread pool."""
        closer = getattr(self.fn, "aclose", None) or getattr(self.fn, "close", None)
        if closer is not None and not inspect.isfunction(self.fn):
            out = closer()
            if inspect.isawaitable(out):
                await out
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
