"""The Qwen2-VL family (built from a config here; the tiny builders make Qwen2.5-VL and the Omni
thinker) renders, expands and feeds images and videos the same way, and is not blind."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLConfig

from relax_agent.models import make_tiny_media_model
from relax_agent.multimodal.parts import image_part, video_part
from relax_agent.multimodal.processor import MediaFamily, MediaProcessor, check_placeholders
from relax_agent.multimodal.render import MediaRenderer
from relax_agent.rollout.chat import ChatRenderer
from relax_agent.train.backends.torch_backend import token_logprobs


def test_qwen2_vl_sees_its_images_and_videos(tmp_path):
    tok = AutoTokenizer.from_pretrained(make_tiny_media_model(tmp_path, kind="tiny-vl"))  # Qwen-VL media tokens
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in
           (("image", "<|image_pad|>"), ("video", "<|video_pad|>"), ("start", "<|vision_start|>"), ("end", "<|vision_end|>"))}
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14),
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg)
    family = MediaFamily.from_config(model.config)
    assert family.model_type == "qwen2_vl" and family.token_ids == {"image": ids["image"], "video": ids["video"]}
    r = MediaRenderer(ChatRenderer(tok, accepts_media=True), MediaProcessor(family))

    def logprobs(seed: int) -> torch.Tensor:
        img = np.random.default_rng(seed).integers(0, 255, (56, 56, 3), dtype=np.uint8)
        seg = r.render_prompt([{"role": "user", "content": [image_part(img), video_part([img, img[::-1], img])]}])
        check_placeholders(seg.token_ids, seg.media, family)
        x = torch.tensor([[*seg.token_ids, 5, 6, 7]])
        with torch.no_grad():
            return token_logprobs(model, x, torch.ones_like(x), media=[seg.media])[0, -3:]

    assert (logprobs(0) - logprobs(1)).abs().max() > 1e-4
