import pytest

from relax_agent.config import RelaxConfig, load_config
from relax_agent.errors import ConfigError


def test_defaults_and_yaml_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 1.0e-5\nrollout:\n  group_size: 4\n")
    cfg = load_config(path, ["trainer.lr=1e-6", "rollout.tool_parser=hermes", "env.kwargs.partial_credit=0.3"])
    assert cfg.trainer.lr == 1e-6
    assert cfg.rollout.group_size == 4
    assert cfg.env.kwargs == {"partial_credit": 0.3}
    assert cfg.trainer.steps == RelaxConfig().trainer.steps


def test_unknown_key_names_it_and_suggests(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.lrr=1"])
    assert "trainer.lrr" in str(err.value) and "did you mean 'trainer.lr'" in str(err.value)


def test_unknown_section_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rolout:\n  group_size: 4\n")
    with pytest.raises(ConfigError, match="rolout: unknown key; did you mean 'rollout'"):
        load_config(path)


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError, match=r"rollout.group_size.*'abc'"):
        load_config(None, ["rollout.group_size=abc"])


def test_out_of_range_value():
    with pytest.raises(ConfigError, match="rollout.temperature"):
        load_config(None, ["rollout.temperature=0"])


def test_impossible_combinations():
    with pytest.raises(ConfigError, match="max_staleness=2 needs mode=async"):
        load_config(None, ["max_staleness=2"])
    assert load_config(None, ["mode=async", "max_staleness=2"]).max_staleness == 2
    with pytest.raises(ConfigError, match="mode"):
        load_config(None, ["mode=disaggregated"])
    with pytest.raises(ConfigError, match="clip_eps_high"):
        load_config(None, ["trainer.clip_eps_low=0.3", "trainer.clip_eps_high=0.1"])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        load_config(None, ["rollout.max_new_tokens=4096", "rollout.max_total_tokens=1024"])


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["trainer.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "bad.yaml")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_every_example_config_passes_preflight():
    from pathlib import Path

    from relax_agent.preflight import preflight

    repo = Path(__file__).resolve().parents[2]
    configs = sorted(repo.glob("examples/**/*.yaml"))
    assert len(configs) >= 4
    for path in configs:
        preflight(load_config(path))
