"""Reading a model, config, tokenizer or media processor with ``from_pretrained``.

Each call turns a failure into :class:`~relax_agent.errors.ModelLoadError` with a hint; GGUF
weights are de-quantized to dense ones; a multimodal policy of a family relax-agent processes
(:func:`is_media_policy`) loads as an image-text-to-text model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from relax_agent.config import ModelConfig
from relax_agent.errors import ModelLoadError
from relax_agent.models.source import EMBEDDED_PREFIX


def _gguf_kwargs(gguf_file: str | None) -> dict[str, Any]:
    if gguf_file is None:
        return {}
    from transformers import GgufConfig

    # Dense weights: the trainer needs ordinary nn.Linear parameters, and the model must save.
    return {"gguf_file": gguf_file, "quantization_config": GgufConfig(dequantize=True)}


def from_pretrained_tokenizer(location: str, gguf_file: str | None, cfg: ModelConfig) -> Any:
    """The tokenizer at ``location`` (from ``gguf_file`` when given); a failure raises ModelLoadError."""
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(location, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except Exception as exc:
        raise ModelLoadError(_load_failure("tokenizer", location, gguf_file, exc)) from exc


def from_pretrained_model(location: str, gguf_file: str | None, dtype: torch.dtype, cfg: ModelConfig) -> Any:
    """The model at ``location`` (from ``gguf_file`` when given) in ``dtype``; a failure raises ModelLoadError."""
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
    ``limits``: the processor's ``max_image_pixels`` / ``max_aspect_ratio`` / ``max_video_frames`` (its
    defaults when not given).

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
