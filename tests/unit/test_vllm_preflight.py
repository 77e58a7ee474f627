"""Preflight of ``engine.kind: vllm``: venv and weights folder, before any model loads; routing replay passes."""

import pytest

from relax_agent.config import load_config
from relax_agent.errors import ConfigError
from relax_agent.preflight import check_vllm_engine


def _cfg(tmp_path, *overrides):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\n")
    fake_python.chmod(0o755)
    return load_config("examples/bfcl.yaml", ["engine.kind=vllm", f"engine.vllm.python={fake_python}",
                                              f"engine.vllm.weights_dir={tmp_path}", *overrides])


def test_a_complete_vllm_setup_passes(tmp_path):
    check_vllm_engine(_cfg(tmp_path))


def test_missing_venv_names_the_key_and_the_setup_script(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.vllm\.python: no vLLM venv python at .*setup_vllm\.sh"):
        check_vllm_engine(_cfg(tmp_path, f"engine.vllm.python={tmp_path / 'absent'}"))


def test_routing_replay_passes(tmp_path):
    """The vLLM engine records routes (tests/contract/test_vllm_routes.py); the model's routers are
    checked when the engine starts."""
    check_vllm_engine(_cfg(tmp_path, "moe.routing_replay=rollout"))


def test_weights_dir_must_be_a_writable_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.vllm\.weights_dir=.*not a writable folder"):
        check_vllm_engine(_cfg(tmp_path, f"engine.vllm.weights_dir={tmp_path / 'missing'}"))


def test_other_engines_are_not_checked(tmp_path):
    check_vllm_engine(load_config("examples/bfcl.yaml", ["engine.kind=hf", "engine.vllm.python=/nonexistent"]))
