"""Java and JavaScript values in BFCL: string-encoded arguments, decoded by BFCL's type rules.

BFCL's ``simple_java`` and ``simple_javascript`` tasks describe functions in Java / JavaScript
types (``boolean``, ``long``, ``ArrayList``, ``HashMap``; ``Boolean``, ``Bigint``, ``array``,
``dict``). The model sees every parameter as a *string* holding the value in that language's
syntax (:func:`language_doc`, BFCL's ``_func_doc_language_specific_pre_processing``), and the
checker decodes each string back to a Python value before comparing it with the answer
(:func:`decode_value`). A string that does not match the type's syntax stays a string, which
then fails the type check unless the answer itself names a variable.

The decoders are our own implementation of BFCL's rules, quirks included, because the verdicts
must match BFCL's (``bfcl_eval/eval_checker/ast_eval/type_convertor/java_type_converter.py`` and
``js_type_converter.py``, type tables from ``constants/type_mappings.py``, bfcl-eval v4):

  * Java ``byte``/``short``/``integer``: ``-?\\d+``; ``long``: needs the ``L`` suffix (``5L``);
    ``float``: needs the ``f`` suffix (``2.5f``); ``double``: ``-?\\d+(\\.\\d+)?(e..)?``;
    ``boolean``: ``true``/``false``; ``char``, ``String`` and ``any``: the string as is (no
    quote removal; BFCL's ``char`` pattern never matches).
  * Java ``Array``: ``new T[]{a, b}`` (elements split on commas, each decoded as the ``items``
    type); ``ArrayList``: ``new ArrayList<>(Arrays.asList(a, b))`` or ``new ArrayList<>() {{
    add(a); }}`` (``String``/``char`` elements lose their quotes); ``HashMap``:
    ``new HashMap<K, V>() {{ put("k", v); }}``. ``Set``, ``Hashtable``, ``Queue`` and ``Stack``
    are not decodable (BFCL raises; here the call is judged wrong).
  * JavaScript ``String``: quotes removed when present; ``integer``: ``-?\\d+``; ``float``:
    ``-?\\d+(\\.\\d+)?``; ``Bigint``: ``5n``; ``Boolean``: ``true``/``false``; ``array``:
    ``[a, b]`` or ``new Array(a, b)`` (split on commas; a 2-D ``[[..], [..]]`` too); ``dict``:
    ``{key: value, ...}`` (a regex split, values decoded by :func:`parse_js_value`); ``any``:
    the string as is.

:func:`encode_value` writes a Python answer value in that syntax (used to build reference calls
from BFCL's possible answers, e.g. for a supervised warm-up); ``decode_value(encode_value(v))``
gives back ``v`` for the answer values BFCL ships, bar strings containing commas inside arrays.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from relax_agent.errors import DataError

LANGUAGES: tuple[str, ...] = ("python", "java", "javascript")

JAVA_TYPES: dict[str, type] = {
    "byte": int, "short": int, "integer": int, "float": float, "double": float, "long": int,
    "boolean": bool, "char": str, "Array": list, "ArrayList": list, "Set": set, "HashMap": dict,
    "Hashtable": dict, "Queue": list, "Stack": list, "String": str, "any": str,
}
"""BFCL's ``JAVA_TYPE_CONVERSION``: Java type name -> the Python type its decoded value has."""

JS_TYPES: dict[str, type] = {
    "String": str, "integer": int, "float": float, "Bigint": int, "Boolean": bool, "dict": dict,
    "array": list, "any": str,
}
"""BFCL's ``JS_TYPE_CONVERSION``."""

NESTED_TYPES: tuple[str, ...] = ("Array", "ArrayList", "array")
"""Types whose elements BFCL decodes (and type-checks) with the doc's ``items`` type."""

_HINTS = {"java": " Note that the provided function is in Java 8 SDK syntax.",
          "javascript": " Note that the provided function is in JavaScript syntax."}
_LANGUAGE_NAMES = {"java": "Java", "javascript": "JavaScript"}


class UndecodableValue(ValueError):
    """A Java collection type BFCL cannot decode (``Set``, ``Hashtable``, ``Queue``, ``Stack``)."""


def language_of(category: str) -> str:
    """"java", "javascript" or "python" for a BFCL category name (BFCL's ``is_java``/``is_js``)."""
    if "javascript" in category:
        return "javascript"
    return "java" if "java" in category else "python"


def type_table(language: str) -> dict[str, type]:
    """BFCL's doc-type -> Python-type table for ``language``.

    Raises:
        DataError: unknown language.
    """
    from relax_agent.envs.bfcl.checker import PYTHON_TYPES

    tables = {"python": PYTHON_TYPES, "java": JAVA_TYPES, "javascript": JS_TYPES}
    if language not in tables:
        raise DataError(f"unknown BFCL language {language!r}; expected one of {list(tables)}")
    return tables[language]


def language_doc(function: dict[str, Any], language: str) -> dict[str, Any]:
    """The function doc as BFCL shows it to the model (a copy; Python docs come back unchanged).

    For Java and JavaScript, the language hint is appended to the description and every
    parameter becomes a ``string`` whose description names its type; array element types (and
    JavaScript object schemas) move into the description, as BFCL's pre-processing does.
    """
    if language == "python":
        return function
    doc = copy.deepcopy(function)
    doc["description"] = doc.get("description", "") + _HINTS[language]
    name = _LANGUAGE_NAMES[language]
    for value in (doc.get("parameters") or {}).get("properties", {}).values():
        value.setdefault("description", "")
        if value["type"] == "any":
            value["description"] += f" This parameter can be of any type of {name} object in string representation."
        else:
            value["description"] += f" This is {name} {value['type']} type parameter in string representation."
        arrays = ("ArrayList", "Array") if language == "java" else ("array",)
        if value["type"] in arrays:
            value["description"] += (f" The list elements are of type {value['items']['type']}; "
                                     "they are not in string representation.")
            del value["items"]
        if language == "javascript" and value["type"] == "dict" and "properties" in value:
            value["description"] += (" The dictionary entries have the following schema; they are not in string "
                                     f"representation. {json.dumps(value['properties'])}")
            del value["properties"]
        value["type"] = "string"
    return doc


def decode_value(text: str, bfcl_type: str, language: str, nested_type: str | None = None) -> Any:
    """Decode a string-encoded Java/JavaScript argument the way BFCL does (see the module docstring).

    Raises:
        UndecodableValue: a Java ``Set``/``Hashtable``/``Queue``/``Stack`` (BFCL cannot decode them).
        DataError: ``bfcl_type`` is not a type of ``language``.
    """
    if language == "java":
        return _java(text, bfcl_type, nested_type)
    if language == "javascript":
        return _js(text, bfcl_type, nested_type)
    raise DataError(f"decode_value: language={language!r}; expected 'java' or 'javascript'")


# ---------------------------------------------------------------- Java
_JAVA_INT = re.compile(r"^-?\d+$")
_JAVA_FLOAT = re.compile(r"^-?\d+(\.\d+)?([eE][+-]?\d+)?[fF]$")
_JAVA_DOUBLE = re.compile(r"^-?\d+(\.\d+)?([eE][+-]?\d+)?$")
_JAVA_LONG = re.compile(r"^-?\d+[lL]$")


def _java(value: str, bfcl_type: str, nested_type: str | None = None) -> Any:
    if bfcl_type not in JAVA_TYPES:
        raise DataError(f"unknown BFCL Java type {bfcl_type!r}; expected one of {sorted(JAVA_TYPES)}")
    if bfcl_type in ("byte", "short", "integer"):
        return int(value) if _JAVA_INT.match(value) else str(value)
    if bfcl_type == "float":
        return float(re.sub(r"[fF]$", "", value)) if _JAVA_FLOAT.match(value) else str(value)
    if bfcl_type == "double":
        return float(value) if _JAVA_DOUBLE.match(value) else str(value)
    if bfcl_type == "long":
        return int(re.sub(r"[lL]$", "", value)) if _JAVA_LONG.match(value) else str(value)
    if bfcl_type == "boolean":
        return value == "true" if value in ("true", "false") else str(value)
    if bfcl_type == "ArrayList":
        return _java_arraylist(value, nested_type)
    if bfcl_type == "Array":
        return _java_array(value, nested_type)
    if bfcl_type == "HashMap":
        return _java_hashmap(value)
    if bfcl_type in ("Set", "Hashtable", "Queue", "Stack"):
        raise UndecodableValue(f"BFCL cannot decode Java {bfcl_type} values")
    return str(value)  # char, String, any


def _java_element(text: str, nested_type: str | None) -> Any:
    if nested_type in ("char", "String"):
        return text[1:-1]
    return _java(text, nested_type) if nested_type else parse_java_value(text)


def _java_arraylist(text: str, nested_type: str | None) -> Any:
    match = re.search(r"new\s+ArrayList<\w*>\(Arrays\.asList\((.+?)\)\)", text)
    if match:
        return [_java_element(e.strip(), nested_type) for e in match.group(1).split(",")]
    match = re.search(r"new\s+ArrayList<\w*>\(\)\s*\{\{\s*(.+?)\s*\}\}", text, re.DOTALL)
    if match:
        return [_java_element(m.strip(), nested_type) for m in re.findall(r"add\((.+?)\)", match.group(1))]
    if re.search(r"new\s+ArrayList<\w*>\(\)", text):
        return []
    return text


def _java_array(text: str, nested_type: str | None) -> Any:
    match = re.search(r"new\s+\w+\[\]\s*\{(.*?)\}", text)
    if not match:
        return text
    parts = [x.strip() for x in match.group(1).split(",") if x.strip()]
    return [_java(x, nested_type) if nested_type else parse_java_value(x) for x in parts]


def _java_hashmap(text: str) -> Any:
    match = re.search(r"new\s+HashMap<.*?>\s*\(\)\s*\{\s*\{?\s*(.*?)\s*\}?\s*\}", text, re.DOTALL)
    if match:
        return {key: parse_java_value(value.strip())
                for key, value in re.findall(r"put\(\"(.*?)\",\s*(.*?)\)", match.group(1))} if match.group(1).strip() else {}
    return {} if re.search(r"new\s+HashMap<.*?>\s*\(\)", text) else text


def parse_java_value(text: str) -> Any:
    """A Java literal without a declared type: boolean, quoted string, long, float, int, double, else the text."""
    if text in ("true", "false"):
        return text == "true"
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    if _JAVA_LONG.match(text):
        return int(text[:-1])
    if _JAVA_FLOAT.match(text):
        return float(re.sub(r"[fF]$", "", text))
    return _number_or_text(text)


def _number_or_text(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


# ---------------------------------------------------------------- JavaScript
def _js(value: str, bfcl_type: str, nested_type: str | None = None) -> Any:
    if bfcl_type not in JS_TYPES:
        raise DataError(f"unknown BFCL JavaScript type {bfcl_type!r}; expected one of {sorted(JS_TYPES)}")
    if bfcl_type == "String":
        quoted = len(value) >= 1 and value[0] == value[-1] and value[0] in "\"'"
        return value[1:-1] if quoted else str(value)
    if bfcl_type == "integer":
        return int(value) if re.match(r"^-?\d+$", value) else str(value)
    if bfcl_type == "float":
        return float(value) if re.match(r"^-?\d+(\.\d+)?$", value) else str(value)
    if bfcl_type == "Bigint":
        return int(value[:-1]) if re.match(r"^-?\d+n$", value) else str(value)
    if bfcl_type == "Boolean":
        return value == "true" if value in ("true", "false") else str(value)
    if bfcl_type == "dict":
        return _js_dict(value.strip())
    if bfcl_type == "array":
        return _js_array(value.strip(), nested_type)
    return str(value)  # any


_JS_2D = re.compile(r"\[\s*\[.*?\]\s*(,\s*\[.*?\]\s*)*\]|\bnew\s+Array\(\s*\[.*?\]\s*(,\s*\[.*?\]\s*)*\)")
_JS_1D = re.compile(r"\[(.*?)\]|\bnew\s+Array\((.*?)\)")


def _js_array(code: str, nested_type: str | None) -> Any:
    try:
        if match_2d := _JS_2D.match(code):
            rows = []
            for i, inner in enumerate(re.findall(r"\[(.*?)\]", match_2d.group(0))):
                inner = inner.strip()
                if i == 0 and inner.startswith("["):
                    inner = inner[1:]
                rows.append([parse_js_value(e.strip()) for e in inner.split(",")])
            return rows
        match = _JS_1D.match(code)
        if not match:
            return code
        body = match.group(1) if match.group(1) is not None else match.group(2)
        elements = body.strip().split(",") if body is not None and body.strip() else []
        if nested_type:
            return [_js(e.strip(), nested_type, "String") if e.strip().startswith(("'", '"'))
                    else _js(e.strip(), nested_type) for e in elements]
        return [parse_js_value(e.strip()) for e in elements]
    except Exception:  # noqa: BLE001 - BFCL keeps the raw text when anything in the array fails to decode
        return code


def _js_dict(code: str) -> Any:
    if code == "{}":
        return {}
    match = re.match(r"\{(.*?)\}", code)
    if not match:
        return code
    try:
        out: dict[str, Any] = {}
        for key, value in re.findall(r"([^:]+):\s*(.*?)(?:,\s*(?=[^,]+:)|$)", match.group(1)):
            key, value = key.strip().strip("'\""), value.strip()
            if value.startswith("[") and value.endswith("]"):
                out[key] = _js_array(value, None)
            elif value.startswith("{") and value.endswith("}"):
                out[key] = _js_dict(value)
            else:
                out[key] = parse_js_value(value.strip("'\""))
        return out
    except Exception:  # noqa: BLE001 - as BFCL: an object that fails to decode stays text
        return code


def parse_js_value(text: str) -> Any:
    """A JavaScript literal without a declared type: boolean, quoted string, int, float, else the text."""
    text = text.strip()
    if text in ("true", "false"):
        return text == "true"
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return _number_or_text(text)


# ---------------------------------------------------------------- encoding answers
def encode_value(value: Any, bfcl_type: str, language: str, nested_type: str | None = None) -> str:
    """An answer value written as the string a model should send for a ``bfcl_type`` parameter.

    Raises:
        DataError: ``language`` is not Java or JavaScript.
    """
    if language == "java":
        return _encode_java(value, bfcl_type, nested_type)
    if language == "javascript":
        return _encode_js(value, bfcl_type)
    raise DataError(f"encode_value: language={language!r}; expected 'java' or 'javascript'")


def _java_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _encode_java(value: Any, bfcl_type: str, nested_type: str | None) -> str:
    if bfcl_type == "Array" and isinstance(value, list):
        items = ", ".join(_encode_java(v, nested_type, None) if nested_type else _java_literal(v) for v in value)
        return f"new {nested_type or 'Object'}[]{{{items}}}"
    if bfcl_type == "ArrayList" and isinstance(value, list):
        if not value:
            return "new ArrayList<>()"
        items = ", ".join(json.dumps(v) if nested_type in ("String", "char") else
                          _encode_java(v, nested_type, None) if nested_type else _java_literal(v) for v in value)
        return f"new ArrayList<>(Arrays.asList({items}))"
    if bfcl_type == "HashMap" and isinstance(value, dict):
        puts = " ".join(f"put({json.dumps(k)}, {_java_literal(v)});" for k, v in value.items())
        return f"new HashMap<String, Object>() {{{{ {puts} }}}}"
    if isinstance(value, str):
        return value  # String, char, any, or an answer that names a variable
    if isinstance(value, bool):
        return "true" if value else "false"
    if bfcl_type == "long":
        return f"{value}L"
    if bfcl_type == "float":
        return f"{float(value)}f"
    return str(value)


def _encode_js(value: Any, bfcl_type: str) -> str:
    if bfcl_type == "Bigint" and isinstance(value, int) and not isinstance(value, bool):
        return f"{value}n"
    if isinstance(value, str):
        return value
    return _js_literal(value)


def _js_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_js_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_js_literal(v)}" for k, v in value.items()) + "}"
    return str(value)
