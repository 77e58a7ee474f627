"""The bridge table: ``"<scheme>:<name>"`` env ids resolve to the bridge's gymnasium id and one kwarg, a missing
package is a ConfigError naming the extra, and every place that makes an env from an id goes through it."""

from __future__ import annotations

import sys

import gymnasium
import pytest
from typer.testing import CliRunner

import relax_agent.envs as envs
from relax_agent.envs.bridges import BRIDGES, require, resolve, split_scheme
from relax_agent.errors import ConfigError


def test_a_scheme_resolves_to_the_bridge_id_and_its_kwarg():
    assert resolve("gem:game:GuessTheNumber-v0-hard") == ("relax/GEM-v0", {"game": "game:GuessTheNumber-v0-hard"})
    assert resolve("reasoning_gym:leg_counting", {"size": 10}) == ("relax/ReasoningGym-v0",
                                                                  {"dataset": "leg_counting", "size": 10})
    assert resolve("openenv:http://127.0.0.1:8000") == ("relax/OpenEnv-v0", {"env": "http://127.0.0.1:8000"})
    assert resolve("harbor:examples/harbor/x") == ("relax/Harbor-v0", {"task_dir": "examples/harbor/x"})


def test_ids_without_a_bridge_scheme_pass_through():
    assert resolve("relax/Calculator-v0", {"difficulty": 2}) == ("relax/Calculator-v0", {"difficulty": 2})
    assert resolve("mypkg.envs:mypkg/Echo-v0") == ("mypkg.envs:mypkg/Echo-v0", {})
    assert split_scheme("relax/BFCL-simple-v0") == (None, "relax/BFCL-simple-v0")


def test_an_empty_name_or_a_contradicting_kwarg_is_refused():
    with pytest.raises(ConfigError, match="expected 'gem:<game>'"):
        resolve("gem:")
    with pytest.raises(ConfigError, match=r"env.kwargs.dataset='ab' contradicts env.id='reasoning_gym:leg_counting'"):
        resolve("reasoning_gym:leg_counting", {"dataset": "ab"})
    assert resolve("reasoning_gym:ab", {"dataset": "ab"}) == ("relax/ReasoningGym-v0", {"dataset": "ab"})


def test_every_bridge_is_registered_under_its_id():
    for bridge in BRIDGES.values():
        assert gymnasium.spec(bridge.env_id).entry_point == bridge.entry_point


@pytest.mark.parametrize("scheme", [s for s, b in BRIDGES.items() if b.package is not None])
def test_a_missing_package_names_the_extra_that_installs_it(scheme, monkeypatch):
    bridge = BRIDGES[scheme]
    monkeypatch.setitem(sys.modules, bridge.package, None)  # import raises ImportError
    with pytest.raises(ConfigError, match=rf"pip install 'relax-agent\[{bridge.extra}\]'"):
        require(scheme)


def test_make_and_preflight_take_a_scheme(monkeypatch):
    from relax_agent.preflight import check_env_id, check_env_kwargs

    env = envs.make("reasoning_gym:leg_counting", size=20)
    try:
        assert env.unwrapped.dataset_name == "leg_counting" and len(env.unwrapped.dataset) == 20
    finally:
        env.close()
    check_env_id("reasoning_gym:leg_counting")
    check_env_kwargs("reasoning_gym:leg_counting", {"size": 20})
    with pytest.raises(ConfigError, match="contradicts"):
        check_env_kwargs("reasoning_gym:leg_counting", {"dataset": "ab"})
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ConfigError, match=r"relax-agent\[reasoning\]"):
        check_env_id("reasoning_gym:leg_counting")


def test_envs_list_shows_what_each_bridge_offers():
    from relax_agent.cli import app

    out = CliRunner().invoke(app, ["envs", "list", "--bridge", "reasoning_gym"])
    assert out.exit_code == 0, out.output
    names = out.output.split()
    assert "reasoning_gym:leg_counting" in names and "reasoning_gym:basic_arithmetic" in names
    out = CliRunner().invoke(app, ["envs", "list", "--bridge", "nope"])
    assert out.exit_code != 0 and "expected one of" in out.output
