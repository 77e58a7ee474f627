"""What the commands share: the stderr console, the ``error:`` line and exit code of a failure, the
overrides argument, loading a config (with its preflight checks) and writing a JSON summary."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from relax_agent.errors import ConfigError, RelaxError

console = Console(stderr=True, soft_wrap=True)

OVERRIDES = typer.Argument(None, help="Dotted overrides of the config, e.g. rollout.group_size=4 eval.num_tasks=100")


def fail(exc: RelaxError, resume: str | None = None) -> None:
    """One ``error:`` line: the root cause (an error raised inside a Ray actor without Ray's wrapper
    header), then ``resume`` (the command that continues the run) when given; exit 2 for a config
    error, else 1."""
    text = str(_unwrapped(exc))
    if resume is not None:
        text = f"{text}; resume from the last checkpoint with: {resume}"
    console.print("[bold red]error:[/] ", end="")
    console.print(text, markup=False, highlight=False)
    raise typer.Exit(2 if isinstance(exc, ConfigError) else 1)


def _unwrapped(exc: BaseException) -> BaseException:
    """The exception raised inside a Ray actor, when ``exc`` is Ray's ``RayTaskError`` around it."""
    for _ in range(16):
        cause = getattr(exc, "cause", None)
        if not type(exc).__name__.startswith("RayTaskError") or not isinstance(cause, BaseException):
            break
        exc = cause
    return exc


def resume_command(config: Path, overrides: list[str] | None) -> str:
    """``relax-agent train CONFIG OVERRIDES... --resume``, quoted for a shell."""
    return shlex.join(["relax-agent", "train", str(config), *(overrides or []), "--resume"])


def load(config: Path, overrides: list[str] | None) -> Any:
    """The config ``config`` with ``overrides`` applied, checked by the preflight."""
    from relax_agent.config import load_config
    from relax_agent.preflight import preflight

    cfg = load_config(config, list(overrides or []))
    preflight(cfg)
    return cfg


def announce(path: str) -> None:
    """Print that the policy at ``path`` is loading (an ``on_load`` hook)."""
    console.print(f"loading policy {path} ...")


class null:
    """A context manager that does nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write ``summary`` as JSON to ``path``, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str))
