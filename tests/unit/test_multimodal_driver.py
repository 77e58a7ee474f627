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
from relax_agent.multimodal.processor import check_placeholders
from relax_agent.multimodal.render import MediaRenderer
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.env_driver import EnvDriver
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
    driver = EnvDriver(make_env, engine, renderer, HermesParser())
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
    broken.processor.process = lambda part, where="part", **kw: (_ for _ in ()).throw(ValueError(f"{where}: corrupt"))
    _, traj = _play(broken, ScriptedEngine(broken, [ZOOM]))
    assert traj.reward_status == "error" and "env.reset observation[0] content part 1: corrupt" in traj.error


def test_a_reply_holding_a_placeholder_token_is_a_masked_policy_error_not_a_crash(renderer):
    from relax_agent.records import StopReason

    pad = renderer.tokenizer.convert_ids_to_tokens(renderer.family.token_ids["image"])
    _, traj = _play(renderer, ScriptedEngine(renderer, [f"Answer: {pad}{pad} 3"]))
    assert traj.stop_reason == StopReason.POLICY_ERROR and traj.reward_status == "error" and not traj.trainable
    assert traj.error.startswith(f"the policy sampled media placeholder token(s) ['{pad} (id "
                                 f"{renderer.family.token_ids['image']}) x2'] in turn 1")
    assert len(traj.turns) == 1 and traj.loss_mask.count(1) == len(traj.turns[0].token_ids)  # kept for inspection


@pytest.mark.parametrize("kind", ["tiny-vl", "tiny-omni"])
def test_the_media_engine_never_samples_a_placeholder_id(tmp_path, kind):
    """Placeholder logits pushed far above every other token: the engine still samples none of them."""
    import torch

    from relax_agent.models import load_policy
    from relax_agent.multimodal.parts import image_part
    from relax_agent.rollout.engines.config import EngineConfig
    from relax_agent.rollout.engines.hf import HFEngine

    folder = make_tiny_media_model(tmp_path, kind=kind, seed=1)
    cfg = ModelConfig(path=str(folder))
    model, tok = load_policy(cfg)
    r = MediaRenderer(ChatRenderer(tok, accepts_media=True), load_media_processor(cfg, model.config))
    ids = sorted(r.family.token_ids.values())
    assert len(ids) == (3 if kind == "tiny-omni" else 2)  # image and video (and audio) placeholders

    def favour_placeholders(module, args, out):
        out = out.clone()
        out[..., ids] += 1e4
        return out

    model.get_output_embeddings().register_forward_hook(favour_placeholders)
    import numpy as np

    seg = r.render_prompt([{"role": "user", "content": [
        {"type": "text", "text": "How many?"},
        image_part(np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8))]}])
    engine = HFEngine(model, tok, EngineConfig())
    try:
        gen = asyncio.run(engine.generate(list(seg.token_ids), SamplingParams(max_new_tokens=8, seed=3),
                                          media=seg.media))
    finally:
        engine.close()
    assert len(gen.token_ids) > 0 and not set(gen.token_ids) & set(ids), gen.token_ids
    assert all(torch.isfinite(torch.tensor(gen.logprobs)))  # log-probs of the full distribution, finite


def test_media_are_decoded_off_the_event_loop_so_other_episodes_keep_running(renderer, monkeypatch):
    """A slow decode (held until another coroutine has ticked 3 times, at most 20 s) does not stall the
    event loop: the other coroutine keeps ticking while each image is processed."""
    import threading
    import time

    ticks, progress, threads = [0], [], []
    real = renderer.processor.process

    def slow_process(part, where="part", **kw):
        start, give_up = ticks[0], time.monotonic() + 20.0
        while ticks[0] < start + 3 and time.monotonic() < give_up:
            time.sleep(0.005)
        progress.append(ticks[0] - start)
        threads.append(threading.current_thread() is threading.main_thread())
        return real(part, where, **kw)

    monkeypatch.setattr(renderer.processor, "process", slow_process)
    task0 = gymnasium.make("relax/VisualCount-v0").unwrapped.tasks("train")[0]
    engine = ScriptedEngine(renderer, [ZOOM, f"Answer: {task0['answer']}"])
    make_env = lambda: gymnasium.make("relax/VisualCount-v0")  # noqa: E731
    spec = EpisodeSpec("g/0", "g", task0["id"], task0, seed=0, max_turns=3, max_total_tokens=4096)

    async def main():
        done = asyncio.Event()

        async def other_episode():
            while not done.is_set():
                ticks[0] += 1
                await asyncio.sleep(0.001)

        other = asyncio.create_task(other_episode())
        traj = await EnvDriver(make_env, engine, renderer, HermesParser()).play(spec, SamplingParams(16))
        done.set()
        await other
        return traj

    traj = asyncio.run(main())
    assert traj.error is None and traj.media.kinds == ("image", "image")
    assert len(progress) == 2 and min(progress) >= 3  # the other coroutine ran during both decodes
    assert threads == [False, False]  # in a worker thread
