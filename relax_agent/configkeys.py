"""Every key of the run config with its type and default, one line each.

``tests/data/config_keys.txt`` holds this listing and ``tests/unit/test_config_keys.py`` compares
it with the live tree, so adding, removing, retyping or changing the default of a key shows up as a
diff to review. Regenerate the file after such a change::

    python -m relax_agent.configkeys --write tests/data/config_keys.txt
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from relax_agent.configbase import Section

WRITE_COMMAND = "python -m relax_agent.configkeys --write tests/data/config_keys.txt"
"""The command that rewrites the snapshot file from the live config tree."""


class ConfigKey(NamedTuple):
    """One key of the config tree: its dotted name, its annotation as written, its default rendered."""

    key: str
    type: str
    default: str

    def line(self) -> str:
        """The key's line in the snapshot: ``key  type  default`` (two spaces apart)."""
        return f"{self.key}  {self.type}  {self.default}"


def iter_config_keys(model: type[Section] | None = None, prefix: str = "") -> Iterator[ConfigKey]:
    """Yield every key of ``model`` (default: :class:`~relax_agent.config.RelaxConfig`) in declaration order.

    A section field is listed, then the keys inside it (``rollout``, ``rollout.agent``,
    ``rollout.agent.command``...); the keys of a list of sections are listed under ``name[]``
    (``reward.components[].source``).
    """
    if model is None:
        from relax_agent.config import RelaxConfig

        model = RelaxConfig
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        yield ConfigKey(dotted, _written_annotation(model, name), _render_default(field))
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            yield from iter_config_keys(ann, dotted + ".")
        elif typing.get_origin(ann) is list:
            (item,) = typing.get_args(ann)
            if isinstance(item, type) and issubclass(item, Section):
                yield from iter_config_keys(item, dotted + "[].")


def config_keys_text() -> str:
    """The snapshot: one :meth:`ConfigKey.line` per key, ending in a newline."""
    return "".join(k.line() + "\n" for k in iter_config_keys())


def _written_annotation(model: type[BaseModel], name: str) -> str:
    """Field ``name``'s annotation as written in the class that declares it."""
    for cls in model.__mro__:
        ann = vars(cls).get("__annotations__", {}).get(name)
        if ann is not None:
            return ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
    raise KeyError(f"{model.__name__}.{name} has no annotation")


def _render_default(field: FieldInfo) -> str:
    """The field's default as a stable string: the value a ``default_factory`` makes, not the factory."""
    if field.default_factory is not None:
        return _render_value(field.default_factory())  # type: ignore[call-arg]
    return _render_value(field.default)


def _render_value(value: Any) -> str:
    """``repr`` of a value; a section is ``Name(...)`` with only the keys given when it was made."""
    if isinstance(value, BaseModel):
        given = ", ".join(f"{k}={_render_value(v)}" for k, v in value if k in value.model_fields_set)
        return f"{type(value).__name__}({given})"
    if isinstance(value, list):
        return f"[{', '.join(_render_value(v) for v in value)}]"
    return repr(value)


def main(argv: list[str] | None = None) -> int:
    """Print the listing, or write it to ``--write PATH``."""
    parser = argparse.ArgumentParser(prog="python -m relax_agent.configkeys", description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PATH", help="write the listing to PATH instead of printing it")
    args = parser.parse_args(argv)
    text = config_keys_text()
    if args.write:
        Path(args.write).write_text(text)
        print(f"wrote {text.count(chr(10))} keys to {args.write}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
