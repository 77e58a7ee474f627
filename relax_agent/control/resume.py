"""Resuming a run: what changed since the checkpoint, and whether the train split still fits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relax_agent.config import RelaxConfig, dump_config
from relax_agent.errors import CheckpointError

EXACT_RESUME_KEYS = ("rollout.tasks_per_step", "rollout.group_size", "env.id", "env.kwargs", "run.seed")
"""Config keys (``env.kwargs`` and everything under it) whose change makes a resumed run draw
different tasks or seeds than the uninterrupted run would have."""


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict) or (prefix and not data):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def resume_changes(ckpt: Path, cfg: RelaxConfig) -> list[tuple[str, Any, Any, bool]]:
    """``(dotted key, checkpoint value, current value, breaks exact resume)`` for every key whose
    value differs between ``ckpt/config.yaml`` and ``cfg``; a key missing on one side has
    value ``None`` there. Empty when the checkpoint holds no config.yaml."""
    import yaml

    path = Path(ckpt) / "config.yaml"
    if not path.is_file():
        return []
    old = _flatten(yaml.safe_load(path.read_text()) or {})
    new = _flatten(yaml.safe_load(dump_config(cfg)))
    changes = []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) != new.get(key):
            breaks = any(key == k or key.startswith(k + ".") for k in EXACT_RESUME_KEYS)
            changes.append((key, old.get(key), new.get(key), breaks))
    return changes


def format_resume_changes(ckpt: Path, changes: list[tuple[str, Any, Any, bool]]) -> str:
    """A warning listing ``changes`` (see :func:`resume_changes`) as ``key: old → new``."""
    lines = [f"warning: the config differs from the checkpoint's ({Path(ckpt) / 'config.yaml'}); continuing with the new values:"]
    for key, old, new, breaks in changes:
        lines.append(f"  {key}: {old!r} → {new!r}" + ("  (breaks exact resume)" if breaks else ""))
    broken = [c[0] for c in changes if c[3]]
    if broken:
        lines.append(f"  changed {', '.join(broken)}: the resumed run draws other tasks or seeds than the "
                     "uninterrupted run would have")
    return "\n".join(lines)


def check_resume_tasks(ckpt: Path, num_train_tasks: int, cfg: RelaxConfig) -> None:
    """Raise CheckpointError when ``ckpt`` was taken on a train split of another size (cheap:
    reads ``state.json`` only, so it can run before the policy loads)."""
    state = json.loads((Path(ckpt) / "state.json").read_text())
    saved = state.get("sampler", {}).get("num_tasks")
    if saved is not None and saved != num_train_tasks:
        raise CheckpointError(
            f"checkpoint {ckpt} was taken on a train split of {saved} tasks, this run has {num_train_tasks} "
            f"(env.id={cfg.env.id!r}, env.kwargs={cfg.env.kwargs}); most likely env.id or env.kwargs changed "
            "since the checkpoint: restore them, or start a new run.output_dir"
        )
