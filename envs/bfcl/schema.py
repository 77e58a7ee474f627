"""BFCL function docs -> OpenAI tool schemas.

BFCL writes parameter types in its own vocabulary (``dict``, ``float``, ``tuple``, ``any``),
not JSON Schema's. :func:`to_openai_tool` maps them, recursing into ``items`` and
``properties``, and keeps the JSON Schema keywords BFCL uses (``description``, ``enum``,
``default``, ``format``, ``minimum``, ``maximum``, nested ``required``); BFCL's own
``optional`` markers are dropped (``required`` already says it).

Tool names: the BFCL name is kept unchanged, dots included (``math.factorial``). The
OpenAI API itself rejects dots in names, but relax-agent renders tool schemas into the
chat template, where any string works, and :mod:`relax_agent.envs.bfcl.checker` compares
names exactly against the BFCL name. (BFCL's own harness renames dots to underscores
for OpenAI-style models and converts back when checking; keeping one name avoids that.)
Mapping source: ``GORILLA_TO_OPENAPI`` in ``bfcl_eval/constants/type_mappings.py``.
"""

from __future__ import annotations

from typing import Any

from relax_agent.errors import DataError

BFCL_TO_JSON_SCHEMA: dict[str, str] = {
    "string": "string",
    "any": "string",
    "integer": "integer",
    "float": "number",
    "number": "number",
    "boolean": "boolean",
    "bool": "boolean",
    "array": "array",
    "list": "array",
    "tuple": "array",
    "dict": "object",
    "object": "object",
}

_KEPT_KEYWORDS = ("description", "enum", "default", "format", "minimum", "maximum")


def json_schema_type(bfcl_type: str) -> str:
    """The JSON Schema type for a BFCL type name.

    Raises:
        DataError: ``bfcl_type`` is not a BFCL Python type.
    """
    try:
        return BFCL_TO_JSON_SCHEMA[bfcl_type]
    except (KeyError, TypeError):
        raise DataError(
            f"unknown BFCL parameter type {bfcl_type!r}; expected one of {sorted(BFCL_TO_JSON_SCHEMA)}"
        ) from None


def to_json_schema(bfcl_schema: dict[str, Any]) -> dict[str, Any]:
    """Convert one BFCL parameter schema (``{"type": "dict", "properties": ...}`` etc.) to JSON Schema.

    A schema without ``type`` is treated as ``string``, as BFCL does.

    Raises:
        DataError: an unknown BFCL type anywhere in the schema.
    """
    out: dict[str, Any] = {"type": json_schema_type(bfcl_schema.get("type", "string"))}
    for key in _KEPT_KEYWORDS:
        if key in bfcl_schema:
            out[key] = bfcl_schema[key]
    if "items" in bfcl_schema:
        out["items"] = to_json_schema(bfcl_schema["items"])
    if "properties" in bfcl_schema:
        out["properties"] = {name: to_json_schema(p) for name, p in bfcl_schema["properties"].items()}
        if isinstance(bfcl_schema.get("required"), list):
            out["required"] = list(bfcl_schema["required"])
    return out


def to_openai_tool(function: dict[str, Any]) -> dict[str, Any]:
    """One BFCL function doc -> ``{"type": "function", "function": {name, description, parameters}}``.

    ``parameters`` is always a JSON Schema object with ``properties`` and ``required``.

    Raises:
        DataError: the doc has no name, or uses an unknown parameter type.
    """
    if not isinstance(function.get("name"), str):
        raise DataError(f"BFCL function doc without a string 'name': {function!r}")
    params = function.get("parameters") or {}
    properties = {name: to_json_schema(p) for name, p in (params.get("properties") or {}).items()}
    return {
        "type": "function",
        "function": {
            "name": function["name"],
            "description": function.get("description", ""),
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(params.get("required") or []),
            },
        },
    }
