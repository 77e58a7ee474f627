"""Every registered ``relax/`` env passes gymnasium's env checker and our contract suite
(relax_agent.envs.testing); envs registered later (by other modules) are picked up automatically."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401  (registers the built-in envs)
from relax_agent.envs.testing import CHECKS, EnvContract, run_check


def _dataset_tools_file() -> str:
    """A 20-row JSON-lines file of weather questions for relax/DatasetTools-v0 (written once per run)."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
    folder = tempfile.mkdtemp(prefix="relax-contract-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = Path(folder) / "weather.jsonl"
    path.write_text("".join(json.dumps({"id": f"w{i}", "prompt": f"Weather in City{i}?", "tools": [tool],
                                        "answer": [{"name": "get_weather", "arguments": {"city": f"City{i}"}}]}) + "\n"
                            for i in range(20)))
    return str(path)


KWARGS: dict[str, dict] = {
    "relax/DatasetTools-v0": {"data_files": _dataset_tools_file()},  # a small file this module writes
    "relax/PythonExec-v0": {"sandbox": {"backend": "fake"}},  # no Docker needed: in-memory sandbox
    "relax/DataFile-v0": {"sandbox": {"backend": "fake"}},
    "relax/Calculator-v0": {"num_tasks": 200},
    "relax/ReasoningGym-v0": {"dataset": "leg_counting", "size": 100},
    "relax/Verifiers-v0": {"env": "tests.e2e.data.vf_envs:load_lookup"},  # a real verifiers taskset with a Toolset
    "relax/OpenEnv-v0": {"env": "tests.e2e.data.openenv_guess:app", "num_tasks": 50},  # a local server process, shared
    "relax/Harbor-v0": {"task_dir": str(Path(__file__).resolve().parents[2] / "examples" / "harbor" / "sum-numbers"),
                        "sandbox": {"backend": "fake"}},  # no image, no verifier run; Docker: test_bridge_harbor_docker.py
    "relax/GEM-v0": {"game": "game:GuessTheNumber-v0-easy", "num_tasks": 50, "num_heldout": 10},
    "relax/TextArena-v0": {"game": "GuessTheNumber-v0", "num_tasks": 50, "num_heldout": 10},
}
"""Constructor overrides that keep the suite fast and daemon-free."""

RELAX_IDS = sorted(i for i in gymnasium.registry if i.startswith("relax/"))


def test_builtins_are_registered():
    expected = {"relax/BFCL-simple-v0", "relax/PythonExec-v0", "relax/DataFile-v0", "relax/Calculator-v0", "relax/ReasoningGym-v0",
                "relax/DatasetTools-v0", "relax/BFCL-live-simple-v0", "relax/BFCL-live-multiple-v0",
                "relax/BFCL-live-parallel-v0", "relax/BFCL-live-parallel-multiple-v0", "relax/BFCL-live-irrelevance-v0",
                "relax/BFCL-live-relevance-v0", "relax/BFCL-simple-java-v0", "relax/BFCL-simple-javascript-v0",
                "relax/BFCL-multi-turn-long-context-v0"}
    assert expected <= set(RELAX_IDS)


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("env_id", RELAX_IDS)
def test_builtin_env_contract(env_id, check):
    run_check(functools.partial(gymnasium.make, env_id, **KWARGS.get(env_id, {})), check)


class TestCalculatorDifficulty5(EnvContract):
    """The mixin a user's own test uses, here on the hardest calculator level."""

    def make_env(self):
        return gymnasium.make("relax/Calculator-v0", difficulty=5, num_tasks=100)
