"""Structured outputs on the OpenAI API: ``response_format``, vLLM's ``structured_outputs`` extra body, the legacy
``guided_*`` fields and ``tool_choice`` -> one ``StructuredOutputsParams`` for the engine.

A request takes at most one constraint: ``response_format`` ``json_object`` / ``json_schema`` (``strict`` accepted;
the schema is enforced either way, as vLLM does) / ``structural_tag``, or ``structured_outputs`` with exactly one
of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag``, or one ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``. On chat, ``tool_choice`` "required" or a named function
is a constraint too (the DSML grammar of :mod:`deepseek_v41.structured.dsml_grammar`) and cannot be combined with
another; "auto" with tools constrains only an opened tool block (a triggered tag), and gives way to an explicit
constraint. In thinking mode every constraint starts after ``</think>`` (vLLM's reasoning-aware structured
outputs): the reasoning stays free. Anything else is a 400 naming the field.

Source: the OpenAI API reference (``response_format``), vLLM ``StructuredOutputsParams`` and its OpenAI protocol
(``structured_outputs``, ``guided_*``), CHAT_FORMAT.md §3(d), §5.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from deepseek_v41.engine.sampling_params import StructuredOutputsParams
from deepseek_v41.server.errors import APIError
from deepseek_v41.structured import dsml_grammar
from deepseek_v41.structured.tool_choice import tool_choice_tag

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


@dataclass
class Constraint:
    """One structured-output constraint: ``kind`` (one of :data:`KINDS`), its value, the request field it came
    from (for errors), and whether it already describes the reasoning (the DSML tags do)."""

    kind: str
    value: Any
    param: str
    covers_reasoning: bool = False

    def engine_kwargs(self, thinking: bool) -> dict[str, Any]:
        """The ``StructuredOutputsParams`` keyword arguments; in thinking mode a structural tag that leaves the
        reasoning free and applies the constraint after ``</think>``."""
        if not thinking or self.covers_reasoning:
            return {self.kind: self.value}
        return {"structural_tag": dsml_grammar.structural_tag(self._format(), thinking=True)}

    def _format(self) -> dict[str, Any]:
        if self.kind == "json":
            return dsml_grammar.json_format(self.value)
        if self.kind == "json_object":
            return dsml_grammar.json_format(None)
        if self.kind == "regex":
            return dsml_grammar.regex_format(self.value)
        if self.kind == "choice":
            return dsml_grammar.choice_format(self.value)
        if self.kind == "grammar":
            return dsml_grammar.grammar_format(self.value)
        tag = json.loads(self.value)
        if not isinstance(tag, dict) or "format" not in tag:
            raise APIError("in thinking mode a structural_tag must be xgrammar's {\"type\": \"structural_tag\", "
                           "\"format\": {...}} (the legacy structures / triggers form describes the whole output, "
                           "reasoning included); turn thinking off or send the format form", self.param,
                           "invalid_value")
        return tag["format"]


def request_constraint(req: Any) -> Constraint | None:
    """The structured-output constraint a request sets (``response_format`` where the request has it,
    ``structured_outputs``, ``guided_*``), or None; APIError 400 for a malformed one or for more than one."""
    found = []
    fmt = response_format_constraint(getattr(req, "response_format", None))
    if fmt is not None:
        found.append(fmt)
    if req.structured_outputs is not None:
        found.extend(_structured_outputs(req.structured_outputs))
    for field, kind in LEGACY_FIELDS.items():
        value = getattr(req, field)
        if value is not None:
            found.append(Constraint(kind, _checked(kind, value, field), field))
    if len(found) > 1:
        raise APIError(f"{found[0].param} and {found[1].param} both constrain the output; set only one",
                       found[1].param, "invalid_value")
    return found[0] if found else None


def response_format_constraint(fmt: dict[str, Any] | None) -> Constraint | None:
    """``response_format`` -> a constraint; None for absent or ``{"type": "text"}``."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        _no_other_keys(fmt, ("type",), "response_format")
        return None
    if kind == "json_object":
        _no_other_keys(fmt, ("type",), "response_format")
        return Constraint("json_object", True, "response_format")
    if kind == "json_schema":
        _no_other_keys(fmt, ("type", "json_schema"), "response_format")
        return Constraint("json", _json_schema(fmt.get("json_schema")), "response_format.json_schema")
    if kind == "structural_tag":
        return Constraint("structural_tag", json.dumps(fmt, ensure_ascii=False), "response_format")
    raise APIError(f"response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', got "
                   f"{kind!r}", "response_format.type", "invalid_value")


def _json_schema(spec: Any) -> dict[str, Any]:
    """OpenAI's ``json_schema`` object -> the schema (any JSON object when it has none)."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise APIError("response_format type 'json_schema' needs a json_schema object: {\"name\": ..., \"schema\": "
                       "{...}, \"strict\": true}", where, "invalid_value")
    _no_other_keys(spec, _JSON_SCHEMA_KEYS, where)
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise APIError(f"json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -, got {name!r}",
                       f"{where}.name", "invalid_value")
    if not isinstance(spec.get("description", ""), str):
        raise APIError("json_schema.description must be a string", f"{where}.description", "invalid_type")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise APIError(f"json_schema.strict must be true or false, got {spec['strict']!r}", f"{where}.strict",
                       "invalid_type")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise APIError(f"json_schema.schema must be a JSON schema object, got {type(schema).__name__}",
                       f"{where}.schema", "invalid_type")
    return schema


def _structured_outputs(body: dict[str, Any]) -> list[Constraint]:
    """vLLM's ``structured_outputs`` object: exactly one of :data:`KINDS` (``json_object: false`` is unset)."""
    unknown = [k for k in body if k not in KINDS]
    if unknown:
        raise APIError(f"structured_outputs.{unknown[0]} is not supported; structured_outputs takes exactly one of "
                       f"{', '.join(KINDS)}", f"structured_outputs.{unknown[0]}", "unsupported_parameter")
    chosen = [k for k in KINDS if body.get(k) not in (None, False)]
    if len(chosen) != 1:
        raise APIError(f"structured_outputs must set exactly one of {', '.join(KINDS)}, got "
                       f"{chosen or 'none'}", "structured_outputs", "invalid_value")
    kind = chosen[0]
    param = f"structured_outputs.{kind}"
    return [Constraint(kind, _checked(kind, body[kind], param), param)]


def _checked(kind: str, value: Any, param: str) -> Any:
    """A constraint value of the type its kind takes (JSON schemas as objects or JSON text)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                raise APIError(f"a JSON schema given as a string must be JSON text: {exc}", param,
                               "invalid_value") from exc
            value = parsed
        if not isinstance(value, dict):
            raise APIError(f"a JSON schema is a JSON object, got {type(value).__name__}", param, "invalid_type")
        return value
    if kind == "json_object":
        if value is not True:
            raise APIError(f"json_object must be true, got {value!r}", param, "invalid_type")
        return True
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError("choice must be a non-empty list of non-empty strings", param, "invalid_value")
        return value
    if kind == "structural_tag":
        if isinstance(value, dict):
            return json.dumps(value, ensure_ascii=False)
        if not isinstance(value, str):
            raise APIError("structural_tag must be the JSON text (or object) of an xgrammar structural tag", param,
                           "invalid_type")
        try:
            json.loads(value)
        except ValueError as exc:
            raise APIError(f"structural_tag must be JSON text: {exc}", param, "invalid_value") from exc
        return value
    if not isinstance(value, str) or not value:
        raise APIError(f"{kind} must be a non-empty string", param, "invalid_value")
    return value


def _no_other_keys(body: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in body:
        if key not in allowed:
            raise APIError(f"Unrecognized argument {key!r}; {where} takes {', '.join(allowed)}", f"{where}.{key}",
                           "unknown_parameter")


def tool_constraint(tools: list[dict[str, Any]], choice: str, name: str | None, thinking: bool,
                    parallel: bool) -> Constraint | None:
    """``tool_choice`` "required" / named / "auto" -> the DSML structural tag (with the reasoning prefix when
    thinking; :func:`deepseek_v41.structured.tool_choice.tool_choice_tag`), None for "none" or no tools; APIError
    400 naming the tool field the grammar cannot be built from."""
    try:
        tag = tool_choice_tag(tools, choice, name, thinking=thinking, parallel=parallel)
    except dsml_grammar.ToolGrammarError as exc:
        raise APIError(str(exc), exc.param, "invalid_value") from exc
    if tag is None:
        return None
    return Constraint("structural_tag", tag, "tools", covers_reasoning=True)  # a tag that fails to compile: a schema


def engine_params(constraint: Constraint | None, thinking: bool = False):
    """``StructuredOutputsParams`` of ``constraint`` (None for none); APIError 400 naming its field when the engine
    refuses the value."""
    if constraint is None:
        return None
    try:
        return StructuredOutputsParams(**constraint.engine_kwargs(thinking))
    except ValueError as exc:
        raise APIError(str(exc), constraint.param, "invalid_value") from exc
