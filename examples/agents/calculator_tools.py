"""The calculator's four tools as plain typed Python functions, for the framework agents.

Agent frameworks build a tool's JSON schema from a function's signature and docstring (the
Agents SDK's ``function_tool``, LangChain's and smolagents' ``tool``), so each framework example
wraps these; ``for_task`` keeps those the task offers (its ``tools``, by name).

They repeat ``relax_agent.envs.calculator``'s tools on purpose: an agent runs in its framework's own venv
(``scripts/setup_agent_frameworks.sh``), which has neither relax-agent nor its dependencies, and the env still
scores the answer with its own copy.
"""

from __future__ import annotations

from collections.abc import Callable


def _tidy(x: float) -> float:
    """Integral floats as ints (``48`` rather than ``48.0``), others rounded to 10 places."""
    return int(x) if float(x).is_integer() else round(x, 10)


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return _tidy(a + b)


def subtract(a: float, b: float) -> float:
    """Subtract b from a.

    Args:
        a: The number to subtract from.
        b: The number to subtract.
    """
    return _tidy(a - b)


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return _tidy(a * b)


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor (not zero).
    """
    return _tidy(a / b)


ALL: dict[str, Callable[[float, float], float]] = {f.__name__: f for f in (add, subtract, multiply, divide)}


def for_task(task: dict) -> list[Callable[[float, float], float]]:
    """The functions among ``ALL`` that the task's ``tools`` (OpenAI function tools) name."""
    names = [t["function"]["name"] for t in task.get("tools") or []]
    return [ALL[name] for name in names if name in ALL]


def split_messages(task: dict) -> tuple[str, list[dict]]:
    """The task's system (and developer) text joined, and its other messages as ``{role, content}``."""
    system = "\n\n".join(m["content"] for m in task["messages"] if m["role"] in ("system", "developer"))
    rest = [{"role": m["role"], "content": m["content"]} for m in task["messages"]
            if m["role"] not in ("system", "developer")]
    return system, rest
