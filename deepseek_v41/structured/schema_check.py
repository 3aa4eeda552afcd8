"""A small JSON-schema validator, independent of the grammars (jsonschema is not a dependency): the oracle of the
structured-output tests and the tool-call validity check of ``dsv41 eval-chat`` (:mod:`deepseek_v41.train.chat_eval`).

It knows these keywords: type (one or a list), enum, const, properties, required, additionalProperties (false or
a schema), items, minItems, maxItems, minLength, maxLength, pattern, minimum, maximum, exclusiveMinimum,
exclusiveMaximum, multipleOf, and the annotations title, description, default, examples. An unknown keyword is a
ValueError naming it, never ignored: a schema it cannot judge is not passed as valid.

Source: JSON Schema draft 2020-12, validation vocabulary (the keywords above only).
"""

from __future__ import annotations

import re
from typing import Any

KNOWN = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
         "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
         "exclusiveMaximum", "multipleOf", "title", "description", "default", "examples"}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is_type(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, TYPES[name])


def schema_errors(value: Any, schema: dict, path: str = "$") -> list[str]:
    """Why ``value`` (a JSON value as ``json.loads`` gives it) is not valid under ``schema``: one line per
    violation, each starting with its JSON path from ``path``; [] when it is valid. Raises ValueError for a
    keyword this validator does not know (see the module docstring)."""
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"the oracle does not know {sorted(unknown)}")
    out: list[str] = []
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(value, n) for n in names):
            return [f"{path}: {value!r} is not of type {names}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        out.append(f"{path}: {value!r} != {schema['const']!r}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        for key, item in value.items():
            if key in props:
                out += schema_errors(item, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{path}: unexpected property {key!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                out += schema_errors(item, schema["additionalProperties"], f"{path}.{key}")
    if isinstance(value, list):
        if "items" in schema:
            for i, item in enumerate(value):
                out += schema_errors(item, schema["items"], f"{path}[{i}]")
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            out.append(f"{path}: {len(value)} items outside [{schema.get('minItems')}, {schema.get('maxItems')}]")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            out.append(f"{path}: length {len(value)} outside [{schema.get('minLength')}, {schema.get('maxLength')}]")
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            out.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    if _is_type(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{path}: {value} > maximum {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            out.append(f"{path}: {value} <= exclusiveMinimum {schema['exclusiveMinimum']}")
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            out.append(f"{path}: {value} >= exclusiveMaximum {schema['exclusiveMaximum']}")
        if "multipleOf" in schema and value % schema["multipleOf"] != 0:
            out.append(f"{path}: {value} is not a multiple of {schema['multipleOf']}")
    return out
