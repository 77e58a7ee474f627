"""Rendering with media, token-in/token-out: per family (tiny Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE,
Qwen2.5-Omni thinker), placeholders expand into exactly the features the processor made, on
multi-turn conversations with media in user and tool messages (Qwen3-VL videos frame by frame with
the timestamps transformers' Qwen3-VL processor writes); each message's media is processed once;
sampled tokens are never re-rendered; mismatches are errors naming the message."""

from __future__ import annotations

import copy
import functools
import types

import numpy as np
import pytest
from transformers import AutoConfig, AutoTokenizer

from relax_agent.config import ModelConfig
from relax_agent.errors import DataError, EnvError
from relax_agent.models import is_media_policy, load_media_processor, make_tiny_media_model
from relax_agent.multimodal.parts import audio_part, decode_audio, image_part, video_part
from relax_agent.multimodal.processor import check_placeholders
from relax_agent.multimodal.render import MediaRenderer
from relax_agent.rollout.chat import ChatRenderer


def _image(seed: int, h: int = 60, w: int = 80) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module", params=["tiny-vl", "tiny-vl3", "tiny-vl3-moe", "tiny-omni"])
def family_dir(request, tmp_path_factory):
    return request.param, make_tiny_media_model(tmp_path_factory.mktemp(request.param), kind=request.param)


def _renderer(folder, tokenizer=None):
    cfg = ModelConfig(path=str(folder))
    tok = tokenizer or AutoTokenizer.from_pretrained(folder)
    return MediaRenderer(ChatRenderer(tok, accepts_media=True), load_media_processor(cfg, AutoConfig.from_pretrained(folder)))


def _user_content(kind: str) -> list:
    parts = [{"type": "text", "text": "Look:"}, image_part(_image(0)), video_part([_image(1), _image(2), _image(3)])]
    if kind == "tiny-omni":
        parts.append(audio_part(np.sin(np.arange(16000) / 3.0)))
    return parts


def test_tiny_media_models_are_media_policies(family_dir):
    kind, folder = family_dir
    assert is_media_policy(ModelConfig(path=str(folder)))
    assert not is_media_policy(ModelConfig())  # the embedded text policy


def test_placeholders_equal_features_over_a_multi_turn_episode_with_media_in_user_and_tool_messages(family_dir):
    kind, folder = family_dir
    r = _renderer(folder)
    tok = r.tokenizer
    prompt = r.render_prompt([{"role": "user", "content": _user_content(kind)}],
                             [{"type": "function", "function": {"name": "zoom", "parameters": {}}}])
    want = ("image", "video", "audio") if kind == "tiny-omni" else ("image", "video")
    assert prompt.media.kinds == want
    counts = r.family.count_placeholders(prompt.token_ids)
    for k in want:
        assert counts[k] == sum(n for kk, n in zip(prompt.media.kinds, prompt.media.num_tokens, strict=True) if kk == k) > 1
    assert counts["image"] == int(np.prod(prompt.media.arrays["image_grid_thw"][0])) // 4
    assert len(prompt.media.arrays["pixel_values"]) == int(np.prod(prompt.media.arrays["image_grid_thw"][0]))
    sampled = tok("Let me zoom.", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    tool = r.observation_delta([{"role": "tool", "content": [{"type": "text", "text": "zoomed"},
                                                              image_part(_image(4, 28, 28)), image_part(_image(5))]}])
    user = r.observation_delta([{"role": "user", "content": [{"type": "text", "text": "and this?"},
                                                              video_part([_image(6), _image(7)])]}])
    assert tool.media.kinds == ("image", "image") and user.media.kinds == ("video",)
    stream = [*prompt.token_ids, *sampled, *tool.token_ids, *sampled, *user.token_ids]
    from relax_agent.records import MediaInputs

    media = MediaInputs.concat([prompt.media, tool.media, user.media])
    check_placeholders(stream, media, r.family, "episode")  # the whole episode agrees, kind by kind
    # sampled tokens sit verbatim where they were appended: nothing is re-rendered around them
    start = len(prompt.token_ids)
    assert stream[start:start + len(sampled)] == sampled
    # decode equals the template's rendering of the whole conversation, placeholders expanded
    text = tok.decode(stream)
    conversation = [{"role": "user", "content": _user_content(kind)}]
    rendered = r.chat.tokenizer.apply_chat_template(
        [*prompt.messages, {"role": "assistant", "content": "Let me zoom."}, *tool.messages,
         {"role": "assistant", "content": "Let me zoom."}, *user.messages], tokenize=False, add_generation_prompt=True)
    assert conversation and text == _expanded(rendered, r, media, video_frames=[3, 2])
    if r.family.timestamped_video:  # one run of placeholders per temporal step, each between start and end
        assert "<0.2 seconds><|vision_start|><|video_pad|>" in text and "<1.0 seconds><|vision_start|>" in text
        assert "<|vision_start|><0.2 seconds>" not in text  # the template's own pair was replaced


def _qwen3_video_text(grid, num_frames: int) -> str:
    """A video's text as transformers' ``Qwen3VLProcessor.replace_video_token`` writes it (frames at 2 fps)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    proc = types.SimpleNamespace(video_processor=types.SimpleNamespace(merge_size=2, temporal_patch_size=2),
                                 vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                                 video_token="<|video_pad|>")
    proc._calculate_timestamps = functools.partial(Qwen3VLProcessor._calculate_timestamps, proc)
    meta = VideoMetadata(total_num_frames=num_frames, fps=2.0, frames_indices=list(range(num_frames)))
    return Qwen3VLProcessor.replace_video_token(proc, {"video_grid_thw": grid[None], "video_metadata": [meta]}, 0)


def _expanded(text: str, r: MediaRenderer, media, video_frames: list[int]) -> str:
    """The template's text with each placeholder repeated as often as its item's features; a Qwen3-VL
    video's ``<|vision_start|><|video_pad|><|vision_end|>`` replaced by its per-frame text (as the
    Qwen3-VL processor did before transformers 5, which keeps that outer pair)."""
    tok = r.tokenizer
    names = {k: tok.convert_ids_to_tokens(v) for k, v in r.family.token_ids.items()}
    queues = {k: [n for kk, n in zip(media.kinds, media.num_tokens, strict=True) if kk == k] for k in names}
    grids, frames = list(media.arrays.get("video_grid_thw", [])), list(video_frames)
    wrapped = "<|vision_start|><|video_pad|><|vision_end|>"
    out, i = [], 0
    while i < len(text):
        if r.family.timestamped_video and text.startswith(wrapped, i):
            queues["video"].pop(0)
            out.append(_qwen3_video_text(grids.pop(0), frames.pop(0)))
            i += len(wrapped)
            continue
        for k, name in names.items():
            if text.startswith(name, i):
                out.append(name * queues[k].pop(0))
                i += len(name)
                break
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def test_each_new_messages_media_is_processed_once(family_dir):
    kind, folder = family_dir
    r = _renderer(folder)
    calls = []
    process = r.processor.process
    r.processor.process = lambda part, where="part", **kw: calls.append(where) or process(part, where, **kw)
    r.render_prompt([{"role": "user", "content": [{"type": "text", "text": "a"}, image_part(_image(0))]}])
    r.observation_delta([{"role": "tool", "content": [image_part(_image(1))]}])
    r.observation_delta([{"role": "user", "content": "text only"}])
    assert calls == ["env.reset observation[0] content part 1", "env.step observation[0] content part 0"]


def test_a_template_that_drops_tool_images_is_an_error_naming_the_message(family_dir):
    kind, folder = family_dir
    tok = AutoTokenizer.from_pretrained(folder)
    tok = copy.deepcopy(tok)
    # tool messages keep only their text parts
    tok.chat_template = tok.chat_template.replace(
        "{{ render(message['content']) }}",
        "{% if message['role'] == 'tool' and message['content'] is not string %}"
        "{% for p in message['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
        "{% else %}{{ render(message['content']) }}{% endif %}")
    r = _renderer(folder, tok)
    r.render_prompt([{"role": "user", "content": [image_part(_image(0))]}])  # user images still render
    with pytest.raises(EnvError, match=r"env.step observation\[1\] \(role 'tool'\) has 1 image part\(s\) but the chat "
                                       r"template rendered 0"):
        r.observation_delta([{"role": "tool", "content": "plain"}, {"role": "tool", "content": [image_part(_image(1))]}])


def test_user_text_cannot_forge_a_media_placeholder(family_dir):
    kind, folder = family_dir
    r = _renderer(folder)
    pad = r.tokenizer.convert_ids_to_tokens(r.family.token_ids["image"])
    seg = r.render_prompt([{"role": "user", "content": f"fake {pad}{pad} image"}])
    assert seg.media is None and r.family.count_placeholders(seg.token_ids)["image"] == 0


def test_a_sequence_cut_inside_an_image_is_a_data_error_naming_the_row(family_dir):
    kind, folder = family_dir
    r = _renderer(folder)
    seg = r.render_prompt([{"role": "user", "content": [image_part(_image(0)), image_part(_image(1))]}])
    pad = r.family.token_ids["image"]
    cut = list(seg.token_ids)
    cut.remove(pad)  # one image token short
    with pytest.raises(DataError, match=r"row 3: .* image placeholder tokens in token_ids but its media has 2 image"):
        check_placeholders(cut, seg.media, r.family, "row 3")


def test_an_undecodable_part_names_the_message(family_dir):
    kind, folder = family_dir
    r = _renderer(folder)
    bad = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
    with pytest.raises(DataError, match=r"env.reset observation\[0\] content part 0: expected a PIL image"):
        r.render_prompt([{"role": "user", "content": [bad]}])


def test_wav_parts_round_trip_and_resample():
    t = np.arange(8000) / 8000
    clip = 0.5 * np.sin(2 * np.pi * 440 * t)
    back = decode_audio(audio_part(clip, rate_hz=8000))
    assert back.shape == (16000,) and abs(float(np.abs(back).max()) - 0.5) < 0.01


def test_a_responses_api_input_image_renders_as_its_image_url_part(family_dir):
    from relax_agent.errors import ConfigError
    from relax_agent.multimodal.parts import png_data_url

    kind, folder = family_dir
    r = _renderer(folder)
    url = png_data_url(_image(0))
    a = r.render_prompt([{"role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                                      {"type": "input_image", "image_url": url}]}])
    b = r.render_prompt([{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}])
    assert a.token_ids == b.token_ids and a.media.kinds == ("image",)
    assert np.array_equal(a.media.arrays["pixel_values"], b.media.arrays["pixel_values"])
    with pytest.raises(ConfigError, match=r"content part 1 has type 'image_file', which relax-agent cannot take"):
        r.render_prompt([{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                      {"type": "image_file", "image_file": {"file_id": "f"}}]}])
