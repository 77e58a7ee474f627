"""Checkpoints: model, optimizer, step, data position and RNG, written atomically.

Layout::

    OUTPUT_DIR/checkpoints/step_000010/
        model/              save_pretrained (safetensors) + tokenizer
        trainer.pt          optimizer / scheduler / grad-scaler state
        state.json          step, policy version, sampler position, metrics so far
        rng.pt              python, numpy and torch RNG states
        config.yaml         the run's config

A checkpoint folder appears under its final name only once complete (written to a
``.tmp`` sibling, then renamed), so a crash mid-save never leaves a half checkpoint that
``--resume`` would pick.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relax_agent.errors import CheckpointError

_NAME = re.compile(r"step_(\d+)")


def _step_of(path: Path) -> int | None:
    """The step of a ``step_NNNNNN`` folder; None for any other name."""
    match = _NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why ``ckpt`` cannot be resumed from (naming the file), or None when it looks complete:
    ``state.json`` parses with a step, ``trainer.pt`` and ``rng.pt`` are non-empty, ``model/``
    holds non-empty files."""
    state = ckpt / "state.json"
    try:
        data = json.loads(state.read_text())
    except FileNotFoundError:
        return f"{state} is missing"
    except (OSError, ValueError) as exc:
        return f"{state} is not valid JSON ({exc})"
    if not isinstance(data, dict) or not isinstance(data.get("step"), int):
        return f"{state} has no integer 'step'"
    for name in ("trainer.pt", "rng.pt"):
        f = ckpt / name
        if not f.is_file() or f.stat().st_size == 0:
            return f"{f} is {'missing' if not f.is_file() else 'empty (0 bytes)'}"
    model = ckpt / "model"
    files = [f for f in model.rglob("*") if f.is_file()] if model.is_dir() else []
    if not files:
        return f"{model} holds no model files"
    empty = [str(f) for f in files if f.stat().st_size == 0]
    return f"{empty[0]} is empty (0 bytes)" if empty else None


class CheckpointManager:
    """Saves and finds checkpoints under ``OUTPUT_DIR/checkpoints``.

    Args:
        output_dir: the run folder.
        keep_last: how many most recent checkpoints to keep (older ones are deleted).
        pinned: steps kept whatever ``keep_last`` says.
    """

    def __init__(self, output_dir: str | Path, keep_last: int = 2, pinned: frozenset[int] = frozenset()):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last
        self.pinned = pinned
        """Steps never pruned (the warm-up's ``step_000000``)."""

    def save(self, step: int, save_model: Callable[[Path], None], trainer_state: dict[str, Any],
             state: dict[str, Any], config_yaml: str) -> Path:
        """Write checkpoint ``step`` and prune old ones; returns its folder.

        ``save_model(folder)`` writes the policy (weights and tokenizer) into ``folder/model``."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".step_{step:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_model(tmp / "model")
        torch.save(trainer_state, tmp / "trainer.pt")
        torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))
        (tmp / "config.yaml").write_text(config_yaml)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self._prune()
        return final

    def _prune(self) -> None:
        for old in self.all()[: -self.keep_last]:
            if _step_of(old) not in self.pinned:
                shutil.rmtree(old, ignore_errors=True)

    def all(self) -> list[Path]:
        """Numbered checkpoint folders that hold a ``state.json``, oldest first (other names are ignored)."""
        return _numbered(self.root)

    def latest(self) -> Path | None:
        """The newest checkpoint that passes :func:`checkpoint_problem`; newer broken ones are
        skipped with a warning naming what is wrong."""
        return _newest_valid(self.all())


def resolve(path: str | Path) -> Path:
    """A checkpoint folder from a checkpoint path, a ``checkpoints/`` folder or a run folder.

    Raises:
        CheckpointError: nothing complete is there.
    """
    p = Path(path)
    if (p / "state.json").exists():
        problem = checkpoint_problem(p)
        if problem:
            raise CheckpointError(f"checkpoint {p} cannot be loaded: {problem}")
        return p
    for root in (p, p / "checkpoints"):
        found = _newest_valid(_numbered(root))
        if found is not None:
            return found
    raise CheckpointError(f"no complete checkpoint at {str(p)!r} (expected a step_NNNNNN folder with state.json)")


def _numbered(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    done = [c for c in root.iterdir() if c.is_dir() and _step_of(c) is not None and (c / "state.json").exists()]
    return sorted(done, key=lambda c: _step_of(c) or 0)


def _newest_valid(candidates: list[Path]) -> Path | None:
    for ckpt in reversed(candidates):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        warnings.warn(f"skipping checkpoint {ckpt}: {problem}", stacklevel=3)
    return None


def load_state(ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state.json contents, trainer state) of a checkpoint; restores the RNG states too."""
    problem = checkpoint_problem(ckpt)
    if problem:
        raise CheckpointError(f"checkpoint {ckpt} cannot be loaded: {problem}")
    state = json.loads((ckpt / "state.json").read_text())
    trainer_state, rng = _torch_load(ckpt / "trainer.pt"), _torch_load(ckpt / "rng.pt")
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return state, trainer_state


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated or corrupt file: name it
        raise CheckpointError(f"{path} is corrupt or truncated ({type(exc).__name__}: {exc}); "
                              "resume from an earlier checkpoint or delete this one") from exc
