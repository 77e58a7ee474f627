"""Token ids shown as text: the trajectory fields the token view needs, a tokenizer loaded on first use
(a failure reported, never raised), and the run's latest checkpoint's tokenizer."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

TOKEN_FIELDS = ("token_ids", "loss_mask", "rollout_logprobs")
"""Trajectory fields an episode needs for the token view (tokens coloured by loss mask and log-prob):
taken from the step's token record (``rollouts/tokens/step_NNNNNN.jsonl.gz``), or from the rollout
dump's row when it carries them (then optionally with ``token_text``, one string per token, and
``advantage``)."""


class TokenDecoder:
    """Token ids -> text, one string per token, with a Hugging Face tokenizer loaded on first use.

    Args:
        source: a tokenizer folder or hub id (``AutoTokenizer.from_pretrained``), or None (no text).

    A tokenizer that fails to load is reported by :attr:`error` (and ids stay ids); nothing raises.
    """

    def __init__(self, source: str | None):
        self.source = source
        self.error: str | None = None
        self._tok: Any = None
        self._lock = threading.Lock()

    def texts(self, ids: list[int]) -> list[str] | None:
        """``[decode([id]) for id in ids]``, or None without a (loadable) tokenizer."""
        if self.source is None:
            return None
        with self._lock:
            if self._tok is None and self.error is None:
                try:
                    from transformers import AutoTokenizer

                    self._tok = AutoTokenizer.from_pretrained(self.source)
                except Exception as exc:  # any loader failure: show ids, say why
                    self.error = f"tokenizer {self.source!r} did not load: {type(exc).__name__}: {exc}"
            tok = self._tok
        if tok is None:
            return None
        try:
            return [tok.decode([int(i)]) for i in ids]
        except Exception as exc:  # an id outside this tokenizer's vocabulary
            self.error = f"tokenizer {self.source!r} cannot decode these ids: {type(exc).__name__}: {exc}"
            return None


def checkpoint_tokenizer(run_dir: Path) -> Path | None:
    """The ``model`` folder of the run's latest checkpoint when it holds a tokenizer, else None."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return None
    for ckpt in sorted(folder.glob("step_*"), reverse=True):
        model = ckpt / "model"
        if (model / "tokenizer_config.json").is_file() or (model / "tokenizer.json").is_file():
            return model
    return None
