"""Multi-turn episodes with a media tool: the zoom tool's image reaches the policy as media tokens,
every engine call gets the episode's media so far, the trajectory keeps it all in token order,
and a media failure is a failed record naming the message."""

from __future__ import annotations

import asyncio

import gymnasium
import pytest
from transformers import AutoConfig, AutoTokenizer

import relax_agent.envs  # noqa: F401
from relax_agent.config import ModelConfig
from relax_agent.models import load_media_processor, make_tiny_media_model
from relax_agent.multimodal.driver import MediaEnvDriver
from relax_agent.multimodal.processor import check_placeholders
from relax_agent.multimodal.render import MediaRenderer
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.parsers import HermesParser


@pytest.fixture(scope="module", params=["tiny-vl", "tiny-vl3"])
def renderer(request, tmp_path_factory):
    folder = make_tiny_media_model(tmp_path_factory.mktemp(request.param), kind=request.param)
    tok = AutoTokenizer.from_pretrained(folder)
    proc = load_media_processor(ModelConfig(path=str(folder)), AutoConfig.from_pretrained(folder))
    return MediaRenderer(ChatRenderer(tok, accepts_media=True), proc)


class ScriptedEngine:
    """Replies with the scripted texts in turn; records what each call got."""

    policy_version = 0

    def __init__(self, renderer, texts):
        self.renderer, self.texts, self.calls = renderer, list(texts), []

    async def generate(self, prompt_ids, params, media=None):
        check_placeholders(prompt_ids, media, self.renderer.family, "engine call")
        self.calls.append((list(prompt_ids), media))
        tok = self.renderer.tokenizer
        ids = tok(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        return Generation(tuple(ids), tuple([-0.5] * len(ids)), "stop", 0)


ZOOM = '<tool_call>\n{"name": "zoom", "arguments": {"quadrant": "top-left"}}\n</tool_call>'


def _play(renderer, engine, env_kwargs=None):
    make_env = lambda: gymnasium.make("relax/VisualCount-v0", **(env_kwargs or {}))  # noqa: E731
    task = make_env().unwrapped.tasks("train")[0]
    spec = EpisodeSpec("g/0", "g", task["id"], task, seed=0, max_turns=3, max_total_tokens=4096)
    driver = MediaEnvDriver(make_env, engine, renderer, HermesParser())
    return task, asyncio.run(driver.play(spec, SamplingParams(16)))


def test_a_zoom_tool_image_reaches_the_policy_as_media(renderer):
    task0 = gymnasium.make("relax/VisualCount-v0").unwrapped.tasks("train")[0]
    engine = ScriptedEngine(renderer, [ZOOM, f"Answer: {task0['answer']}"])
    task, traj = _play(renderer, engine)
    assert traj.error is None and traj.reward == 1.0 and len(traj.turns) == 2
    assert traj.media.kinds == ("image", "image")  # the task image, then the zoomed quarter
    assert [len(m) for _, m in engine.calls] == [1, 2]  # each call had the media so far
    check_placeholders(traj.token_ids, traj.media, renderer.family, "trajectory")
    for turn in traj.turns:  # sampled ids kept verbatim at their positions
        assert traj.token_ids[turn.start:turn.start + len(turn.token_ids)] == turn.token_ids
    second_prompt = engine.calls[1][0]
    assert traj.token_ids[:len(second_prompt)] == tuple(second_prompt)
    tool = [m for m in traj.messages if m["role"] == "tool"]
    assert len(tool) == 1 and tool[0]["content"][1]["type"] == "image_url"


def test_a_media_failure_is_a_failed_record_naming_the_message(renderer):
    tok = renderer.tokenizer
    broken = MediaRenderer(ChatRenderer(tok, accepts_media=True), renderer.processor)
    broken.processor = type(renderer.processor)(renderer.family)
    broken.processor.process = lambda part, where="part": (_ for _ in ()).throw(ValueError(f"{where}: corrupt"))
    _, traj = _play(broken, ScriptedEngine(broken, [ZOOM]))
    assert traj.reward_status == "error" and "env.reset observation[0]: corrupt" in traj.error
