"""Media limits: an image's pixels are capped from its header before it is decoded, an extreme
aspect ratio is refused before Qwen's ``smart_resize`` raises, 0-second and NaN / inf audio are
refused, and audio longer than the model's window is cut with a warning (once per episode) and
counted, each naming the message and part."""

from __future__ import annotations

import asyncio
import base64
import logging
import struct
import types
import zlib

import gymnasium
import numpy as np
import pytest
from PIL import Image, ImageFile
from transformers import AutoConfig, AutoTokenizer

from relax_agent.config import ModelConfig, RolloutConfig, load_config
from relax_agent.control.reporting import rollout_metrics
from relax_agent.errors import DataError
from relax_agent.models import load_media_processor, make_tiny_media_model
from relax_agent.multimodal.parts import AUDIO_RATE_HZ, MAX_IMAGE_PIXELS, audio_part, decode_image, image_part
from relax_agent.multimodal.render import MediaRenderer
from relax_agent.roles import _media_driver
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.rollout.driver import EpisodeSpec
from relax_agent.rollout.engines.base import Generation, SamplingParams
from relax_agent.rollout.env_driver import AUDIO_CLIPS_CUT, EnvDriver
from relax_agent.rollout.parsers import HermesParser


def _png_header_only(width: int, height: int) -> str:
    """A PNG data URL whose header says ``width`` x ``height`` RGB but whose pixel data is a stub:
    reading its size works, decoding its pixels cannot (so a test sees whether decoding was tried)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _renderer(folder, **limits):
    proc = load_media_processor(ModelConfig(path=str(folder)), AutoConfig.from_pretrained(folder), **limits)
    return MediaRenderer(ChatRenderer(AutoTokenizer.from_pretrained(folder), accepts_media=True), proc)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_media_model(tmp_path_factory.mktemp("tiny-vl"), kind="tiny-vl")


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    return make_tiny_media_model(tmp_path_factory.mktemp("tiny-omni"), kind="tiny-omni")


def _user(*parts):
    return [{"role": "user", "content": [{"type": "text", "text": "Look:"}, *parts]}]


# -- 1. pixels capped before decoding ----------------------------------------------------------------

def test_an_8000_by_8000_image_is_refused_from_its_header_without_decoding_its_pixels(vl_dir, monkeypatch):
    loads = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self.size) or real_load(self))
    r = _renderer(vl_dir)
    part = {"type": "image_url", "image_url": {"url": _png_header_only(8000, 8000)}}
    with pytest.raises(DataError, match=r"env.reset observation\[0\] content part 1: the image is 8000x8000 = "
                                        r"64000000 pixels, more than rollout.max_image_pixels=40000000"):
        r.render_prompt(_user(part))
    assert loads == []  # refused from the header: no pixel was decoded


def test_the_pixel_cap_is_configurable_and_normal_images_pass(vl_dir):
    assert RolloutConfig().max_image_pixels == MAX_IMAGE_PIXELS == 40_000_000
    assert decode_image(image_part(np.zeros((480, 640, 3), np.uint8))).size == (640, 480)
    with pytest.raises(DataError, match="not a readable image"):  # 6000 x 6000 passes the cap: decoding is tried
        decode_image(_png_header_only(6000, 6000), "x")
    cfg = load_config(None, [f"model.path={vl_dir}", "rollout.max_image_pixels=100"])
    engine = types.SimpleNamespace(model_config=AutoConfig.from_pretrained(vl_dir))
    driver = _media_driver(cfg, cfg.model, engine, ChatRenderer(AutoTokenizer.from_pretrained(vl_dir), accepts_media=True),
                           HermesParser())
    assert driver.renderer.processor.max_image_pixels == 100  # the key reaches the episode driver
    small = _renderer(vl_dir, max_image_pixels=100)
    with pytest.raises(DataError, match=r"observation\[0\] content part 2: the image is 20x10 = 200 pixels, more than "
                                        r"rollout.max_image_pixels=100"):
        small.render_prompt(_user(image_part(np.zeros((5, 5, 3), np.uint8)), image_part(np.zeros((10, 20, 3), np.uint8))))
    seg = _renderer(vl_dir).render_prompt(_user(image_part(np.zeros((480, 640, 3), np.uint8))))
    assert seg.media is not None and seg.media.kinds == ("image",)


def test_pils_decompression_bomb_error_becomes_our_error_naming_the_part(vl_dir):
    r = _renderer(vl_dir, max_image_pixels=10 ** 12)  # above PIL's own bound: PIL refuses at open
    part = {"type": "image_url", "image_url": {"url": _png_header_only(20_000, 20_000)}}
    with pytest.raises(DataError, match=r"observation\[0\] content part 1: the image is larger than "
                                        r"rollout.max_image_pixels=1000000000000 \(PIL refused it as a decompression bomb"):
        r.render_prompt(_user(part))
    assert Image.MAX_IMAGE_PIXELS is not None  # PIL's global bound is left alone


# -- 4. extreme aspect ratio ------------------------------------------------------------------------

def test_an_extreme_aspect_ratio_is_refused_naming_the_message_part_and_bound(vl_dir):
    r = _renderer(vl_dir)
    tall = image_part(np.zeros((402, 2, 3), np.uint8))
    with pytest.raises(DataError, match=r"env.step observation\[1\] content part 0: the image is 2x402 pixels, an "
                                        r"aspect ratio of 201:1; the policy's image processor takes at most 200:1"):
        r.observation_delta([{"role": "tool", "content": "ok"}, {"role": "user", "content": [tall]}])
    seg = r.render_prompt(_user(image_part(np.zeros((400, 2, 3), np.uint8))))  # 200:1 is Qwen's bound: accepted
    assert seg.media.kinds == ("image",)


# -- 3. audio -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("part, expect", [
    (audio_part(np.zeros(0)), r"content part 1: the audio has 0 samples \(0 seconds\)"),
    ({"type": "audio", "audio": np.asarray([0.1, np.nan, 0.2, np.inf], np.float32)},
     r"content part 1: 2 of the audio's 4 samples are NaN or inf"),
])
def test_empty_or_non_finite_audio_is_refused_naming_the_part(omni_dir, part, expect):
    with pytest.raises(DataError, match=r"env.reset observation\[0\] " + expect):
        _renderer(omni_dir).render_prompt(_user(part))


def test_audio_longer_than_the_window_is_cut_with_a_note_naming_the_part(omni_dir):
    r = _renderer(omni_dir)
    window = r.processor.audio_window_samples
    assert window == r.processor.feature_extractor.n_samples == 2 * AUDIO_RATE_HZ  # the tiny model's 2 s clips
    clip = np.sin(np.arange(3 * window) / 5.0).astype(np.float32) * 0.5
    long_seg = r.render_prompt(_user({"type": "audio", "audio": clip}))
    cut_seg = r.render_prompt(_user({"type": "audio", "audio": clip[:window]}))
    assert long_seg.notes == ("env.reset observation[0] content part 1: audio of 6.00 s is longer than the model's "
                              "2.00 s window; only its first 2.00 s reach the policy",)
    assert cut_seg.notes == ()
    np.testing.assert_array_equal(long_seg.media.arrays["input_features"], cut_seg.media.arrays["input_features"])
    assert long_seg.token_ids == cut_seg.token_ids


class _AudioEnv(gymnasium.Env):
    """One user message with two audio clips of ``seconds`` each; the first reply ends the episode."""

    def __init__(self, seconds: float):
        self.clip = np.sin(np.arange(int(seconds * AUDIO_RATE_HZ)) / 5.0).astype(np.float32) * 0.5

    def reset(self, seed=None, options=None):
        return _user(audio_part(self.clip), {"type": "audio", "audio": self.clip}), {}

    def step(self, action):
        return [], 1.0, True, False, {}


class _OneReply:
    policy_version = 0

    def __init__(self, tokenizer):
        self.ids = tuple(tokenizer("done", add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")])

    async def generate(self, prompt_ids, params, media=None):
        return Generation(self.ids, tuple([-0.5] * len(self.ids)), "stop", 0)


def test_cut_audio_is_logged_once_per_episode_and_counted(omni_dir, caplog):
    r = _renderer(omni_dir)
    spec = EpisodeSpec("g/0", "g", "t", {}, seed=0, max_turns=2, max_total_tokens=4096)

    def play(seconds):
        driver = EnvDriver(lambda: _AudioEnv(seconds), _OneReply(r.tokenizer), r, HermesParser())
        return asyncio.run(driver.play(spec, SamplingParams(8)))

    with caplog.at_level(logging.WARNING, logger="relax_agent.media"):
        long_traj = play(3.0)
    warned = [rec.getMessage() for rec in caplog.records if rec.name == "relax_agent.media"]
    assert warned == ["episode g/0: env.reset observation[0] content part 1: audio of 3.00 s is longer than the "
                      "model's 2.00 s window; only its first 2.00 s reach the policy"]  # two clips cut, one line
    assert long_traj.error is None and long_traj.metrics[AUDIO_CLIPS_CUT] == 2.0
    short_traj = play(1.0)
    assert short_traj.error is None and AUDIO_CLIPS_CUT not in short_traj.metrics
    assert rollout_metrics([long_traj, short_traj, long_traj], 1.0)["rollout/audio_clips_cut"] == 4.0
    assert "rollout/audio_clips_cut" not in rollout_metrics([short_traj], 1.0)


@pytest.mark.parametrize("samples", [1, 160, 320])
def test_audio_too_short_to_make_a_token_is_refused(omni_dir, samples):
    """Under ~20 ms the audio encoder makes 0 tokens: the clip silently vanished from the prompt."""
    r = _renderer(omni_dir)
    with pytest.raises(DataError, match=r"content part 1: audio of [\d.]+ ms makes no audio token for the policy; "
                                        r"expected at least 321 samples \(20.06 ms at 16000 Hz\)"):
        r.render_prompt(_user({"type": "audio", "audio": np.full(samples, 0.1, np.float32)}))
    assert r.render_prompt(_user({"type": "audio", "audio": np.full(321, 0.1, np.float32)})).media.num_tokens == (1,)


def test_two_channel_audio_is_averaged_not_interleaved(omni_dir):
    r = _renderer(omni_dir)
    left = np.sin(np.arange(4000) / 7.0).astype(np.float32) * 0.5
    right = np.cos(np.arange(4000) / 3.0).astype(np.float32) * 0.5
    mono = r.render_prompt(_user({"type": "audio", "audio": (left + right) / 2})).media.arrays["input_features"]
    for stereo in (np.stack([left, right], axis=1), np.stack([left, right])):  # [n, 2] and [2, n]
        feats = r.render_prompt(_user({"type": "audio", "audio": stereo})).media.arrays["input_features"]
        np.testing.assert_allclose(feats, mono, atol=1e-5)
    with pytest.raises(DataError, match=r"an audio array of shape \[100, 100\]; expected \[samples\] or \[samples, "
                                        r"channels\] with at most 8 channels"):
        r.render_prompt(_user({"type": "audio", "audio": np.zeros((100, 100), np.float32)}))


def test_a_video_over_the_frame_bound_is_refused_before_a_frame_is_decoded(vl_dir):
    """2,000 frames of 224 x 224 made 64,000 tokens and 3 GB; frames here cannot even be decoded."""
    r = _renderer(vl_dir, max_video_frames=8)
    stub = _png_header_only(224, 224)
    with pytest.raises(DataError, match=r"content part 1: a video of 9 frames; rollout.max_video_frames=8"):
        r.render_prompt(_user({"type": "video", "video": [stub] * 9}))
    frame = np.zeros((32, 32, 3), np.uint8)
    from relax_agent.multimodal.parts import video_part

    assert r.render_prompt(_user(video_part([frame] * 8))).media.kinds == ("video",)
    assert load_config(None, []).rollout.max_video_frames == 256
