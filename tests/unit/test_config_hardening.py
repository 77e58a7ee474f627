"""Config values that used to pass validation and then break the run are refused at load, naming the key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from relax_agent.config import RelaxConfig, dump_config, load_config, parse_override
from relax_agent.errors import ConfigError
from relax_agent.train.config import TrainerConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("override, key", [
    ("trainer.lr=.inf", "trainer.lr"),
    ("trainer.lr=.nan", "trainer.lr"),
    ("rollout.temperature=.inf", "rollout.temperature"),
    ("eval.temperature=.nan", "eval.temperature"),
    ("env.step_timeout_s=.inf", "env.step_timeout_s"),
    ("data.lease_timeout_s=.inf", "data.lease_timeout_s"),
    ("engine.batch_wait_s=.inf", "engine.batch_wait_s"),
    ("weights.publish_timeout_s=.inf", "weights.publish_timeout_s"),
    ("reward.weight=.nan", "reward.components.0.weight"),
    ("trainer.weight_decay=1.0e999", "trainer.weight_decay"),
])
def test_non_finite_numbers_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert f"{key}: Input should be a finite number" in str(err.value)


def test_non_finite_numbers_are_refused_in_python_and_on_assignment_too():
    with pytest.raises(ValidationError, match="finite number"):
        TrainerConfig(lr=math.inf)
    cfg = RelaxConfig()
    with pytest.raises(ValidationError, match="finite number"):
        cfg.rollout.temperature = math.nan


@pytest.mark.parametrize("betas", ["[1.0, 0.999]", "[0.9, 1.0]", "[-0.1, 0.999]", "[0.9, 1.5]"])
def test_betas_outside_zero_one_are_refused(betas):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"trainer.betas={betas}"])
    assert "trainer.betas." in str(err.value)


def test_betas_inside_zero_one_load_from_yaml_lists():
    cfg = load_config(None, ["trainer.betas=[0.0, 0.95]"])
    assert cfg.trainer.betas == (0.0, 0.95)
    with pytest.raises(ConfigError, match="trainer.betas"):
        load_config(None, ["trainer.betas=[0.9]"])


def test_empty_eval_seed_list_is_refused():
    with pytest.raises(ConfigError, match=r"eval.seeds: List should have at least 1 item"):
        load_config(None, ["eval.seeds=[]"])
    assert load_config(None, ["eval.seeds=[7]"]).eval.seeds == [7]


@pytest.mark.parametrize("override, key", [
    ("trainer.betas=[0.9, 0.99", "trainer.betas"),
    ("env.kwargs={a: 1", "env.kwargs"),
    ("run.name='unclosed", "run.name"),
])
def test_yaml_syntax_error_in_an_override_names_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        parse_override(override)
    assert f"override {override!r}" in str(err.value) and f"value of {key} is not valid YAML" in str(err.value)


@pytest.mark.parametrize("overrides, key, shown", [
    (["mode=async", "max_staleness='2'"], "max_staleness", "'2'"),
    (["rollout.group_size=true"], "rollout.group_size", "True"),
    (["trainer.lr='1e-6'"], "trainer.lr", "'1e-6'"),
    (["trainer.steps=2.5"], "trainer.steps", "2.5"),
    (["rollout.tool_example=1"], "rollout.tool_example", "1"),
    (["logging.plot='false'"], "logging.plot", "'false'"),
    (["eval.seeds=['1']"], "eval.seeds.0", "'1'"),
])
def test_numbers_and_booleans_of_the_wrong_type_are_refused_not_coerced(overrides, key, shown):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert f"{key}: Input should be a valid" in str(err.value) and f"(got {shown})" in str(err.value)


def test_a_quoted_number_gets_a_hint_to_drop_the_quotes():
    with pytest.raises(ConfigError, match="write numbers without quotes"):
        load_config(None, ["rollout.group_size='4'"])


def test_plain_yaml_numbers_still_work_and_ints_are_accepted_for_floats(tmp_path):
    cfg = load_config(None, ["trainer.lr=1e-6", "rollout.group_size=4", "rollout.temperature=1", "trainer.steps=3"])
    assert cfg.trainer.lr == 1e-6 and cfg.rollout.group_size == 4 and cfg.trainer.steps == 3
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 2e-5\n  grad_clip: 1\n")
    cfg = load_config(path)
    assert cfg.trainer.lr == 2e-5 and cfg.trainer.grad_clip == 1.0


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing set yet\n", "---\n"])
def test_an_empty_yaml_file_is_refused_not_run_with_all_defaults(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value) and "is empty" in str(err.value)


def test_a_directory_as_the_config_path_is_refused_as_a_directory(tmp_path):
    (tmp_path / "run.yaml").write_text("trainer:\n  steps: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert "is a directory" in str(err.value) and "run.yaml" in str(err.value)


def test_every_example_config_still_loads():
    configs = sorted(REPO.glob("examples/**/*.yaml"))
    assert len(configs) >= 4
    for path in configs:
        load_config(path)


def test_a_dumped_config_loads_back_unchanged(tmp_path):
    cfg = load_config(None, ["trainer.betas=[0.8, 0.9]", "trainer.lr=3e-6"])
    path = tmp_path / "saved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize("what", ["directory", "empty file", "quoted number", "broken override"])
def test_the_train_command_exits_2_naming_the_problem_before_anything_loads(tmp_path, what):
    from typer.testing import CliRunner

    from relax_agent.cli import app

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    ok = tmp_path / "ok.yaml"
    ok.write_text("trainer:\n  steps: 1\n")
    args, expected = {
        "directory": ([str(tmp_path)], "is a directory"),
        "empty file": ([str(empty)], "is empty"),
        "quoted number": ([str(ok), "mode=async", "max_staleness='2'"], "max_staleness"),
        "broken override": ([str(ok), "trainer.betas=[0.9,"], "trainer.betas is not valid YAML"),
    }[what]
    result = CliRunner().invoke(app, ["train", *args])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())


@pytest.mark.parametrize("override, key, says", [
    ("rollout.temperature=1e-300", "rollout.temperature", "greater than or equal to 0.001"),
    ("eval.temperature=1e-9", "eval.temperature", "greater than or equal to 0.001"),
    ("run.num_threads=100000", "run.num_threads", "less than or equal to 1024"),
    ("run.seed=18446744073709551616", "run.seed", "less than 4294967296"),
    ("rollout.group_size=1000000", "rollout.group_size", "less than or equal to 1024"),
    ("rollout.tasks_per_step=100000000", "rollout.tasks_per_step", "less than or equal to 65536"),
])
def test_values_that_crashed_or_hung_a_run_are_refused_at_load(override, key, says):
    """Each of these passed validation and then gave NaN log-probs (temperature), a segfault (threads),
    a failure after the model loaded (seed) or minutes of memory growth without a line (group size)."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in str(err.value) and says in str(err.value)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8001/score me", "http://host\n:80"])
def test_a_reward_url_with_whitespace_is_refused(url):
    with pytest.raises(ConfigError, match="whitespace or a control character"):
        load_config(None, ["reward.source=remote", f"reward.url={url}"])
