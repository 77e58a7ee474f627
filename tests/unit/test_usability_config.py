"""Config mistakes a new user made are refused with the key and the reason, before any model loads."""

from __future__ import annotations

import asyncio
import threading

import pytest
from transformers import AutoTokenizer

from relax_agent.config import load_config
from relax_agent.envs import TextEnv
from relax_agent.errors import ConfigError
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.parsers import HermesParser


def test_group_size_one_is_refused_naming_the_key_and_why():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.group_size=1"])
    assert "rollout.group_size=1" in str(err.value) and "at least 2 samples per group" in str(err.value)
    assert load_config(None, ["rollout.group_size=2"]).rollout.group_size == 2


@pytest.mark.parametrize("text, key, lines", [
    ("run:\n  seed: 1\ntrainer:\n  steps: 2\nrun:\n  seed: 2\n", "'run'", "lines 1 and 5"),
    ("trainer:\n  steps: 2\n  lr: 1.0e-3\n  steps: 3\n", "'steps'", "lines 2 and 4"),
    ("env:\n  kwargs:\n    a: 1\n    a: 2\n", "'a'", "lines 3 and 4"),
])
def test_duplicate_yaml_keys_are_refused_with_their_lines(tmp_path, text, key, lines):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"duplicate key {key} ({lines})" in str(err.value)


def test_yaml_without_duplicates_still_loads(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("run:\n  seed: 3\ntrainer:\n  steps: 2\nenv:\n  kwargs: {a: 1, b: {a: 2}}\n")
    cfg = load_config(path)
    assert cfg.run.seed == 3 and cfg.env.kwargs == {"a": 1, "b": {"a": 2}}


class Blocks(TextEnv):
    """``step`` blocks on an Event that only the test sets."""

    release = threading.Event()

    def tasks(self, split="train"):
        return [{"id": "t0"}]

    def _reset_task(self, task):
        return [{"role": "user", "content": "answer"}], {"tools": []}

    def step(self, action):
        self.release.wait()
        return [], 1.0, True, False, {}


class OneToken:
    def __init__(self, tokenizer):
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt_ids, params):
        return Generation((self.end,), (-0.1,), "stop", 0)


def test_env_step_timeout_s_from_the_config_cuts_a_hanging_env(tiny_model_dir):
    from relax_agent.roles import rollout_limits
    from relax_agent.rollout.runner import RolloutRunner

    cfg = load_config(None, ["env.step_timeout_s=0.2", "env.max_turns=2"])
    limits = rollout_limits(cfg)
    assert (limits.step_timeout_s, limits.max_turns) == (0.2, 2)
    assert load_config(None).env.step_timeout_s == 60.0
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    runner = RolloutRunner(Blocks, OneToken(tok), ChatRenderer(tok), HermesParser(), limits)
    try:
        (traj,) = asyncio.run(runner.run(runner.specs([{"id": "t0"}], 1, prefix="s", seed=0), SamplingParams(4)))
    finally:
        Blocks.release.set()
    assert traj.reward_status == "timeout" and traj.error == "env call exceeded step_timeout_s=0.2"


def test_tasks_per_step_beyond_the_train_split_is_refused_before_the_model_loads():
    from relax_agent.envs.calculator import CalculatorEnv
    from relax_agent.roles import build_roles

    cfg = load_config(None, ["env.id=relax/Calculator-v0", "env.kwargs.num_tasks=20", "rollout.tasks_per_step=60000",
                             "model.path=/nonexistent/model", "run.device=cpu"])
    loaded = []
    with pytest.raises(ConfigError) as err:
        build_roles(cfg, on_load=loaded.append)
    n_train = len(CalculatorEnv(num_tasks=20).tasks("train"))
    assert f"rollout.tasks_per_step=60000 is more than the {n_train} train tasks" in str(err.value)
    assert loaded == []
