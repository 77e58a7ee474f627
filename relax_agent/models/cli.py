"""``python -m relax_agent.models``: write a tiny random model (text or multimodal) to a folder."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from relax_agent.errors import ConfigError, RelaxError
from relax_agent.models.tiny import TINY_ARCHS, make_tiny_model
from relax_agent.models.tiny_media import make_tiny_media_model


def main(argv: list[str] | None = None) -> int:
    """``python -m relax_agent.models tiny DIR [--arch llama] [--seed 0]``: write a tiny random
    model (see :func:`~relax_agent.models.tiny.make_tiny_model`) for smoke runs such as ``examples/tiny.yaml``;
    ``tiny-vl DIR`` / ``tiny-vl3 DIR`` / ``tiny-vl3-moe DIR`` / ``tiny-omni DIR``: a tiny multimodal
    one (:func:`~relax_agent.models.tiny_media.make_tiny_media_model`)."""
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
