"""Checks that run before any model loads."""

import pytest

from relax_agent.config import load_config
from relax_agent.errors import ConfigError
from relax_agent.preflight import preflight


def _check(*overrides):
    return preflight(load_config("examples/bfcl.yaml", list(overrides)))


def test_valid_config_passes_and_resolves_the_device():
    assert _check("run.device=cpu") == "cpu"


def test_env_kwargs_typo_names_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"env.kwargs.partial_credti: unknown argument .* did you mean 'partial_credit'"):
        _check("env.kwargs.partial_credti=0.1")


def test_unknown_env_id_suggests_close_ids():
    with pytest.raises(ConfigError, match=r"did you mean 'relax/BFCL-simple-v0'"):
        _check("env.id=relax/BFCL-simpel-v0")


def test_module_env_id_imports_from_the_working_directory(monkeypatch):
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    monkeypatch.chdir(repo)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", repo)])
    _check("env.id=examples.custom_env:examples/Echo-v0", "env.kwargs={}")


def test_unknown_parser_and_unavailable_device():
    with pytest.raises(ConfigError, match="tool_parser"):
        _check("rollout.tool_parser=pythonic")
    with pytest.raises(ConfigError, match="run.device"):
        _check("run.device=tpu")
