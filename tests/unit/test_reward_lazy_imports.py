"""``import relax_agent`` (and loading a config) stays light: no torch, no FastAPI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import relax_agent.reward_services as rs

HEAVY = ("torch", "fastapi", "uvicorn", "transformers", "ray")


def loaded_after(code: str) -> list[str]:
    """The HEAVY modules in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_relax_agent_loads_neither_torch_nor_fastapi():
    assert loaded_after("import relax_agent") == []


def test_loading_a_config_with_a_remote_reward_loads_neither_torch_nor_fastapi():
    code = ("from relax_agent import load_config\n"
            "load_config(None, ['reward.source=remote', 'reward.url=http://127.0.0.1:9'])")
    assert loaded_after(code) == []


def test_reward_services_names_still_resolve_and_the_server_loads_on_first_use():
    assert "fastapi" in loaded_after("from relax_agent.reward_services import create_app")
    for name in rs.__all__:
        assert getattr(rs, name) is not None, name
    assert set(rs.__all__) <= set(dir(rs))
    from relax_agent.reward_services.server import create_app

    assert rs.create_app is create_app


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="has no attribute 'create_ap'"):
        rs.create_ap  # noqa: B018
