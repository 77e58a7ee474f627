"""A third-party package registers an env through the ``gymnasium.envs`` entry point group.

The plugin is built from source in a temporary folder, pip-installed into this interpreter's
environment and uninstalled afterwards; every check runs in a fresh interpreter so the entry
point is discovered the way a user's process discovers it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

PLUGIN = "relax-plugin-demo"
MODULE = '''
from relax_agent.envs import ToolEnv, register

WORDS = ["apple", "river", "orange", "planet", "garden", "silver"]


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text to upper-case.
    """
    return text.upper()


class ShoutEnv(ToolEnv):
    reward_description = "1.0 when the reply is the requested word in capitals, else 0.0"

    def __init__(self, num_words: int = 6):
        super().__init__(tools=[shout])
        self.words = WORDS[:num_words]

    def tasks(self, split="train"):
        words = self.words[:-2] if split == "train" else self.words[-2:]
        return [{"id": w, "word": w} for w in words]

    def prompt(self, task):
        return [{"role": "user", "content": f"Say {task['word']} in capitals."}]

    def score(self, message):
        ok = (message.get("content") or "").strip() == self.task["word"].upper()
        return float(ok), {"correct": float(ok)}


def register_envs():
    register(id="Shout-v0", entry_point="relax_plugin_demo:ShoutEnv", max_episode_steps=4)
'''
PYPROJECT = f'''
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{PLUGIN}"
version = "0.1.0"

[project.entry-points."gymnasium.envs"]
plugin = "relax_plugin_demo:register_envs"

[tool.setuptools]
py-modules = ["relax_plugin_demo"]
'''


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "-q", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    src = tmp_path_factory.mktemp("plugin")
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "relax_plugin_demo.py").write_text(MODULE)
    out = _pip("install", "--no-deps", "--no-build-isolation", str(src))
    assert out.returncode == 0, out.stderr[-2000:]
    try:
        yield src
    finally:
        _pip("uninstall", "-y", PLUGIN)


def _python(code: str, cwd) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_plugin_env_is_made_by_gymnasium_and_passes_the_contract(plugin, tmp_path):
    out = _python("""
        import json, gymnasium, relax_agent.envs
        from relax_agent.envs.testing import run_contract
        env = gymnasium.make("plugin/Shout-v0")
        obs, info = env.reset(seed=0)
        step = env.step({"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "shout", "arguments": {"text": "hi"}}}]})
        print(json.dumps({"spec": [env.spec.id, env.spec.max_episode_steps], "tool": info["tools"][0]["function"]["name"],
                          "result": step[0][0]["content"], "failures": run_contract(lambda: gymnasium.make("plugin/Shout-v0"))}))
    """, cwd=tmp_path)  # not the repository: the module must come from the installed package
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"spec": ["plugin/Shout-v0", 4], "tool": "shout", "result": "HI", "failures": {}}


def test_cli_lists_and_shows_the_plugin_env(plugin, tmp_path):
    listed = subprocess.run([sys.executable, "-m", "relax_agent.cli", "envs", "list"], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert {"plugin/Shout-v0", "relax/Calculator-v0"} <= set(listed.stdout.split())
    shown = subprocess.run([sys.executable, "-m", "relax_agent.cli", "envs", "show", "plugin/Shout-v0", "--json"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    info = json.loads(shown.stdout)
    assert info["tasks"] == {"train": 4, "heldout": 2} and info["max_episode_steps"] == 4
    assert info["tools"][0]["function"]["parameters"]["properties"]["text"]["type"] == "string"
    assert info["reward"].startswith("1.0 when the reply")


def test_unknown_plugin_id_fails_with_gymnasium_suggestion(plugin, tmp_path):
    out = subprocess.run([sys.executable, "-m", "relax_agent.cli", "envs", "show", "plugin/Shuot-v0"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and "Did you mean: `Shout`?" in out.stderr
