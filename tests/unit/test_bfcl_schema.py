"""BFCL function docs -> OpenAI tool schemas."""

from __future__ import annotations

import pytest

from relax_agent.envs.bfcl.schema import to_json_schema, to_openai_tool
from relax_agent.errors import DataError


def test_types_map_to_json_schema_recursively():
    doc = {
        "name": "geo.route",
        "description": "Plan a route.",
        "parameters": {
            "type": "dict",
            "properties": {
                "start": {"type": "tuple", "items": {"type": "float"}, "description": "(lat, lon)"},
                "stops": {
                    "type": "array",
                    "items": {
                        "type": "dict",
                        "properties": {"name": {"type": "string"}, "minutes": {"type": "integer"}},
                        "required": ["name"],
                    },
                },
                "options": {
                    "type": "dict",
                    "properties": {"avoid_tolls": {"type": "boolean", "default": False, "optional": True}},
                },
                "mode": {"type": "string", "enum": ["car", "bike"]},
                "payload": {"type": "any"},
                "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                "speed": {"type": "float", "minimum": 0},
            },
            "required": ["start", "stops"],
            "optional": ["options"],
        },
    }
    assert to_openai_tool(doc) == {
        "type": "function",
        "function": {
            "name": "geo.route",
            "description": "Plan a route.",
            "parameters": {
                "type": "object",
                "properties": {
                    "start": {"type": "array", "items": {"type": "number"}, "description": "(lat, lon)"},
                    "stops": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}, "minutes": {"type": "integer"}},
                            "required": ["name"],
                        },
                    },
                    "options": {
                        "type": "object",
                        "properties": {"avoid_tolls": {"type": "boolean", "default": False}},
                    },
                    "mode": {"type": "string", "enum": ["car", "bike"]},
                    "payload": {"type": "string"},
                    "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                    "speed": {"type": "number", "minimum": 0},
                },
                "required": ["start", "stops"],
            },
        },
    }


def test_missing_type_is_string_and_input_is_not_mutated():
    schema = {"description": "free text"}
    assert to_json_schema(schema) == {"type": "string", "description": "free text"}
    assert schema == {"description": "free text"}


def test_function_without_parameters_gets_empty_object():
    tool = to_openai_tool({"name": "ping", "description": "Ping."})
    assert tool["function"]["parameters"] == {"type": "object", "properties": {}, "required": []}


def test_unknown_type_names_the_type():
    with pytest.raises(DataError, match="'HashSet'"):
        to_openai_tool({"name": "f", "parameters": {"type": "dict", "properties": {"x": {"type": "HashSet"}}}})
