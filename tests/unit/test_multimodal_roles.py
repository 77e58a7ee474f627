"""Wiring a multimodal policy: the env's media prompt passes the start-up check only for a media
policy, and settings that cannot serve one are refused by their key."""

from __future__ import annotations

import gymnasium
import pytest

import relax_agent.envs  # noqa: F401
from relax_agent.config import load_config
from relax_agent.errors import ConfigError
from relax_agent.models import make_tiny_media_model
from relax_agent.preflight import check_env_prompt
from relax_agent.roles import _media_policy


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_media_model(tmp_path_factory.mktemp("vl"), kind="tiny-vl")


def test_a_media_prompt_is_refused_for_a_text_policy_and_accepted_for_a_media_one():
    env = gymnasium.make("relax/VisualCount-v0")
    task = env.unwrapped.tasks("train")[0]
    with pytest.raises(ConfigError, match=r"env.reset observation\[0\] has a 'image_url' content part"):
        check_env_prompt(env, task, 0)
    check_env_prompt(env, task, 0, accepts_media=True)


@pytest.mark.parametrize("override, key", [("engine.kind=fake", "engine.kind"), ("rollout.driver=agent", "rollout.driver"),
                                           ("trainer.backend=megatron", "trainer.backend"),
                                           ("trainer.backend=fake", "trainer.backend")])
def test_settings_that_cannot_serve_a_media_policy_are_refused_by_key(vl_dir, override, key):
    extra = ['rollout.agent.command=["python", "agent.py"]'] if key == "rollout.driver" else []
    cfg = load_config("examples/visual_count.yaml", [f"model.path={vl_dir}", override, *extra])
    with pytest.raises(ConfigError, match=key):
        _media_policy(cfg, cfg.model)


def test_a_supervised_warm_up_serves_a_media_policy(vl_dir):
    cfg = load_config("examples/visual_count.yaml", [f"model.path={vl_dir}", "trainer.sft_warmup_steps=2"])
    assert _media_policy(cfg, cfg.model) is True  # its demonstrations carry their prompt's media


def test_a_text_policy_is_not_a_media_one(tiny_model_dir):
    cfg = load_config("examples/tiny.yaml", [f"model.path={tiny_model_dir}"])
    assert _media_policy(cfg, cfg.model) is False
