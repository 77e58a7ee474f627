"""Config inputs that used to crash late, train nothing or be misread (issue 30, items 12, 18, 19):
each is refused at load naming the key, or read the way a user means it."""

from __future__ import annotations

import os

import pytest

from relax_agent.config import RelaxConfig, dump_config, load_config
from relax_agent.errors import ConfigError

# -- item 12: `runtime=ray` is a value; the runtime's mode check before any model loads ---------

def test_runtime_as_a_value_then_a_key_inside_it_reads_as_the_kind():
    cfg = load_config(None, ["runtime=ray", "runtime.rollout_replicas=2"])
    assert (cfg.runtime.kind, cfg.runtime.rollout_replicas) == ("ray", 2)


def test_a_key_below_a_plain_value_names_the_value_and_the_key():
    with pytest.raises(ConfigError, match=r"'run' is set to the value 'x', not a section, so it has no key 'seed'"):
        load_config(None, ["run=x", "run.seed=2"])
    with pytest.raises(ConfigError, match=r"'runtime' is set to the value 3.*to choose its kind write runtime.kind=3"):
        load_config(None, ["runtime=3", "runtime.rollout_replicas=2"])


def test_runtime_ray_with_colocate_fails_in_preflight_before_the_policy_loads(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import relax_agent.roles as roles
    from relax_agent.cli import app

    def no_model(*args, **kwargs):
        raise AssertionError("the policy was loaded before the mode check")

    monkeypatch.setattr(roles, "build_roles", no_model)
    config = tmp_path / "run.yaml"
    config.write_text(f"run:\n  output_dir: {tmp_path / 'out'}\n")
    result = CliRunner().invoke(app, ["train", str(config), "runtime=ray", "weights.transport=tcp"])
    assert result.exit_code == 2, result.output
    assert "runtime.kind='ray' with mode='colocate'" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["train", str(config), "runtime=ray", "mode=async"])
    assert result.exit_code == 2 and "set weights.transport=tcp" in " ".join(result.output.split())


# -- item 18: numbers and URLs without bounds --------------------------------------------------

@pytest.mark.parametrize("overrides, key, why", [
    (["run.num_threads=-1"], "run.num_threads", "greater than or equal to 0"),
    (["reward.source=remote", "reward.url=http://127.0.0.1:99999"], "reward.components.0.url",
     "the port '99999' is not a number in 1-65535"),
    (["reward.source=remote", "reward.url=http://127.0.0.1:0"], "reward.components.0.url", "the port '0'"),
    (["reward.source=remote", "reward.url=http://"], "reward.components.0.url", "'http://' names no host"),
    (["reward.source=remote", "reward.url='http://[::1'"], "reward.components.0.url", "is not a valid URL"),
    (["reward.weight=0"], "reward.components.0.weight", "every reward weight is 0"),
])
def test_unbounded_numbers_and_broken_urls_are_refused_at_load_naming_the_key(overrides, key, why):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert key in str(info.value) and why in str(info.value), str(info.value)


def test_every_reward_weight_zero_is_refused_but_one_nonzero_weight_is_enough():
    components = ["reward.components=[{source: env, weight: 0}, {source: local, name: l, weight: 0, "
                  "function: 'relax_agent.reward_services.math_reward:score'}]"]
    with pytest.raises(ConfigError, match=r"reward.components.0.weight, reward.components.1.weight"):
        load_config(None, components)
    ok = load_config(None, [components[0].replace("source: env, weight: 0", "source: env, weight: 0.5")])
    assert [c.weight for c in ok.reward.components] == [0.5, 0]
    assert load_config(None, ["reward.source=remote", "reward.url=https://127.0.0.1:8001/score"]).reward


# -- item 19: merge keys, ~, dotted top-level keys ---------------------------------------------

def test_yaml_merge_keys_and_anchor_holders_are_read(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("x-sampling: &sampling\n  temperature: 0.9\n"
                      "rollout:\n  <<: *sampling\n  group_size: 8\n"
                      "eval:\n  <<: *sampling\n  num_tasks: 4\n")
    cfg = load_config(config)
    assert (cfg.rollout.temperature, cfg.rollout.group_size) == (0.9, 8)
    assert (cfg.eval.temperature, cfg.eval.num_tasks) == (0.9, 4)
    config.write_text("rollout:\n  group_size: 8\n  group_size: 4\n")  # a repeated key is still refused
    with pytest.raises(ConfigError, match="duplicate key 'group_size'"):
        load_config(config)


def test_a_tilde_in_the_output_dir_is_the_home_folder():
    cfg = load_config(None, ["run.output_dir=~/runs/exp"])
    assert cfg.run.output_dir == os.path.join(os.path.expanduser("~"), "runs", "exp")
    assert RelaxConfig.model_validate({"run": {"output_dir": "~"}}).run.output_dir == os.path.expanduser("~")
    assert load_config(None, ["run.output_dir=runs/~x"]).run.output_dir == "runs/~x"  # only a leading ~
    assert dump_config(cfg).count("~") == 0


def test_a_top_level_key_spelled_with_dots_is_explained_not_answered_with_itself(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("trainer.lr: 1.0e-6\n")
    with pytest.raises(ConfigError) as info:
        load_config(config)
    message = str(info.value)
    assert "did you mean 'trainer.lr'" not in message
    assert "a YAML key with dots in its name is not a path" in message and "trainer: {lr: ...}" in message


def test_an_env_refusing_a_kwarg_names_it_by_its_full_key():
    from relax_agent.roles import make_env_factory

    make = make_env_factory(load_config(None, ["env.kwargs.split=nope"]))
    with pytest.raises(ConfigError, match=r"^env.kwargs.split='nope'; expected one of .*env.id='relax/BFCL-simple-v0'"):
        make()
