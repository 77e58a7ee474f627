"""The Qwen3-VL families (tiny ``tiny-vl3`` / ``tiny-vl3-moe``): 16-px patching agreed between the
processor and the vision tower (a mismatch is refused by its key), 3-D rope positions from
``mm_token_type_ids`` (never a silent 1-D fall-back), timestamped videos laid out as the model's
rope index reads them (one run of placeholders per temporal step), and videos the policy sees."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from relax_agent.errors import ConfigError
from relax_agent.models import main, make_tiny_media_model
from relax_agent.multimodal.batch import media_model_kwargs
from relax_agent.multimodal.parts import image_part, video_part
from relax_agent.multimodal.processor import MediaFamily, MediaProcessor
from relax_agent.rollout.engines.base import SamplingParams
from relax_agent.rollout.engines.config import EngineConfig
from relax_agent.rollout.engines.hf import HFEngine
from relax_agent.train.backends.torch_backend import token_logprobs
from tests.fixtures import load_media_policy

KINDS = {"tiny-vl3": "qwen3_vl", "tiny-vl3-moe": "qwen3_vl_moe"}


@pytest.fixture(scope="module", params=sorted(KINDS))
def policy(request, tmp_path_factory):
    folder = make_tiny_media_model(tmp_path_factory.mktemp(request.param), kind=request.param, seed=2)
    return (request.param, folder, *load_media_policy(folder))


def _image(seed: int, h: int = 64, w: int = 96) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)


def test_the_builders_write_16px_qwen3_vl_policies(policy):
    kind, folder, model, tok, r = policy
    assert model.config.model_type == KINDS[kind] and type(model).__name__.endswith("ForConditionalGeneration")
    f = r.family
    assert (f.patch_size, f.temporal_patch_size, f.merge_size, f.timestamped_video) == (16, 2, 2, True)
    assert f.token_ids == {"image": tok.convert_tokens_to_ids("<|image_pad|>"), "video": tok.convert_tokens_to_ids("<|video_pad|>")}
    assert json.loads((folder / "preprocessor_config.json").read_text())["patch_size"] == 16
    item = r.processor.process(image_part(_image(0)))
    # 64x96 px -> 4x6 patches of 16 px (C * t * p * p = 3 * 2 * 16 * 16 values each) -> 2x3 merged tokens
    assert item.arrays["pixel_values"].shape == (24, 1536) and item.arrays["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert item.num_tokens == (6,)
    assert (getattr(model.config.get_text_config(), "num_experts", 0) == 8) == (kind == "tiny-vl3-moe")


def test_the_cli_builds_both_qwen3_kinds(tmp_path, capsys):
    for kind, model_type in KINDS.items():
        assert main([kind, str(tmp_path / kind), "--text", "num_hidden_layers=1"]) == 0
        config = AutoConfig.from_pretrained(tmp_path / kind)
        assert config.model_type == model_type and config.get_text_config().num_hidden_layers == 1
    assert "wrote a tiny-vl3-moe model" in capsys.readouterr().out
    assert main(["tiny-vl3", str(tmp_path / "bad"), "--vision", "no_such_field=1"]) == 2


def test_a_processor_with_another_patch_size_is_refused_by_its_key(policy, tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    kind, folder, model, tok, r = policy
    with pytest.raises(ConfigError, match=r"patch_size=14 but the qwen3_vl\w* model's vision_config.patch_size=16"):
        MediaProcessor(r.family, image_processor=Qwen2VLImageProcessorPil(patch_size=14))
    config = json.loads((folder / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**config, "merge_size": 1}))
    with pytest.raises(ConfigError, match=r"merge_size=1 .* vision_config.spatial_merge_size=2"):
        MediaProcessor.from_pretrained(tmp_path, model.config)


def _video_prompt(r, seed: int = 0, frames: int = 4):
    video = [_image(seed + i, 64, 64) for i in range(frames)]
    return r.render_prompt([{"role": "user", "content": [{"type": "text", "text": "What moves?"}, image_part(_image(9)),
                                                          video_part(video)]}])


def test_rope_positions_are_3d_and_each_video_step_is_its_own_run(policy):
    kind, folder, model, tok, r = policy
    seg = _video_prompt(r, frames=3)  # 3 frames of 64x64 px -> 2 temporal steps of 2x2 merged tokens
    ids = torch.tensor([list(seg.token_ids)])
    kwargs = media_model_kwargs(model, r.family, ids, [seg.media])
    types_ = kwargs["mm_token_type_ids"][0]
    video = (ids[0] == r.family.token_ids["video"]).nonzero().flatten().tolist()
    assert len(video) == 8 and types_[video].tolist() == [2] * 8
    assert types_[ids[0] == r.family.token_ids["image"]].tolist() == [1] * seg.media.num_tokens[0]
    runs = [video[:4], video[4:]]
    assert all(run == list(range(run[0], run[0] + 4)) for run in runs)
    assert runs[1][0] - runs[0][-1] > 1  # text (the second step's timestamp) between the steps
    pos, _ = model.model.get_rope_index(ids, kwargs["mm_token_type_ids"], kwargs["image_grid_thw"],
                                        kwargs["video_grid_thw"])
    for run in runs:  # Qwen's layout of one 2x2 step: time constant, (h, w) over the merged grid
        t, h, w = (pos[d, 0, run].tolist() for d in range(3))
        assert t == [t[0]] * 4 and h == [h[0], h[0], h[0] + 1, h[0] + 1] and w == [w[0], w[0] + 1, w[0], w[0] + 1]
    assert pos[0, 0, runs[1][0]] > pos[0, 0, runs[0][0]]  # the later step sits later in time
    with torch.no_grad():
        own = model(input_ids=ids, **kwargs).logits
        flat = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        one_d = model(input_ids=ids, position_ids=flat, **kwargs).logits
        assert (own - one_d).abs().max() > 1e-4  # the forward used the 3-D positions, not 1-D ones
        no_types = {k: v for k, v in kwargs.items() if k != "mm_token_type_ids"}
        with pytest.raises(ValueError, match="mm_token_type_ids"):  # Qwen3-VL refuses to fall back silently
            model(input_ids=ids, **no_types)


def test_the_policy_sees_the_video_and_the_engine_agrees_with_the_trainer(policy):
    kind, folder, model, tok, r = policy
    answer = tok("It moves left", add_special_tokens=False)["input_ids"]

    def logprobs(seed):
        seg = _video_prompt(r, seed)
        ids = torch.tensor([[*seg.token_ids, *answer]])
        with torch.no_grad():
            return token_logprobs(model, ids, torch.ones_like(ids), media=[seg.media])[0, len(seg.token_ids):]

    assert (logprobs(0) - logprobs(10)).abs().max() > 1e-4, "the log-probs did not depend on the video"
    seg = _video_prompt(r)
    engine = HFEngine(model, tok, EngineConfig())
    try:
        gen = asyncio.run(engine.generate(list(seg.token_ids), SamplingParams(max_new_tokens=5, seed=4), media=seg.media))
    finally:
        engine.close()
    ids = torch.tensor([[*seg.token_ids, *gen.token_ids]])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids), media=[seg.media])[0, len(seg.token_ids):]
    assert torch.allclose(lp, torch.tensor(gen.logprobs), atol=1e-4)


def test_the_family_reads_the_vision_tokens_of_the_config(policy):
    kind, folder, model, tok, r = policy
    family = MediaFamily.from_config(model.config)
    assert family.vision_start_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert family.vision_end_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert r.processor.video_timestamps_s(3) == [0.25, 1.0] and r.processor.video_timestamps_s(4) == [0.25, 1.25]
