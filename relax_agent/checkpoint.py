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
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from relax_agent.errors import CheckpointError


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


class CheckpointManager:
    """Saves and finds checkpoints under ``OUTPUT_DIR/checkpoints``.

    Args:
        output_dir: the run folder.
        keep_last: how many most recent checkpoints to keep (older ones are deleted).
    """

    def __init__(self, output_dir: str | Path, keep_last: int = 2):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last

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
            shutil.rmtree(old, ignore_errors=True)

    def all(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.exists():
            return []
        done = [p for p in self.root.glob("step_*") if (p / "state.json").exists()]
        return sorted(done, key=_step_of)

    def latest(self) -> Path | None:
        found = self.all()
        return found[-1] if found else None


def resolve(path: str | Path) -> Path:
    """A checkpoint folder from a checkpoint path, a ``checkpoints/`` folder or a run folder.

    Raises:
        CheckpointError: nothing complete is there.
    """
    p = Path(path)
    if (p / "state.json").exists():
        return p
    for root in (p, p / "checkpoints"):
        if root.is_dir():
            done = sorted((c for c in root.glob("step_*") if (c / "state.json").exists()), key=_step_of)
            if done:
                return done[-1]
    raise CheckpointError(f"no complete checkpoint at {str(p)!r} (expected a step_NNNNNN folder with state.json)")


def load_state(ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state.json contents, trainer state) of a checkpoint; restores the RNG states too."""
    state = json.loads((ckpt / "state.json").read_text())
    trainer_state = torch.load(ckpt / "trainer.pt", map_location="cpu", weights_only=False)
    rng = torch.load(ckpt / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return state, trainer_state
