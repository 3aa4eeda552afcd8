"""Grammars of the DeepSeek-V4.1 output: DSML tool calls and thinking-aware structured outputs, as xgrammar
structural tags.

Every builder returns the JSON text of an xgrammar 0.2.9 structural tag (``{"type": "structural_tag", "format":
...}``, what ``xgrammar.Grammar.from_structural_tag`` / ``GrammarCompiler.compile_structural_tag`` accept), for
``StructuredOutputsParams(structural_tag=...)``. Nothing here imports xgrammar: the tags are plain JSON.

Tool calls follow CHAT_FORMAT.md §3(d) byte for byte (the model's own output format, which
:class:`deepseek_v41.chat.StreamingParser` reads back)::

    \\n\\n<｜DSML｜ calls>\\n<｜DSML｜ invoke name="NAME">\\n
    <｜DSML｜ parameter name="P" string="true|false">VALUE</｜DSML｜ parameter>\\n ... </｜DSML｜ invoke>\\n
    ... </｜DSML｜ calls>

with one ASCII space after ``｜DSML｜``; a call without arguments is ``">\\n\\n</｜DSML｜ invoke>``. Invoke names
are the tools given; parameters are the tool's ``parameters.properties`` in schema order, the ``required`` ones
always present, each at most once, then other names where ``additionalProperties`` allows them (see
:func:`invoke_format`). A value whose schema admits only strings is raw text with ``string="true"``
(as the official encoder renders every string); a value whose schema admits no string is JSON valid under the
parameter's schema with ``string="false"``; a schema admitting both (or none given) takes either form. Raw
string values honour ``enum`` / ``const`` and ``pattern``; other string keywords (``minLength``, ``format``) are
not enforced on raw values. JSON values are written with at most one whitespace character in a row, as
``json.dumps`` writes them (this also keeps a model from spending its budget on whitespace), and no JSON string
in them may hold ``</｜DSML｜ parameter>`` (the parser ends the value there).

Modes (``tool_choice``): "required" (one block of at least one call, any tool), "named" (one call of that tool),
"auto" (free text; once ``<｜DSML｜ calls>`` appears the block must be valid, and the answer ends with it; the text
holds no other DSML: no V4 / V3.2 / unspaced block, no invoke or parameter tag outside a block).
"none" has no grammar: the tools are not rendered and the server never returns DSML as calls.

Thinking (CHAT_FORMAT.md §2, §5): when the prompt ends with ``<think>`` the output starts with free reasoning that
ends at ``</think>``; it may not contain ``<think>`` or open a tool block (the parser would end the reasoning
there). The constrained part starts after ``</think>``. Every builder takes ``thinking`` and adds that prefix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from deepseek_v41.chat.tokens import (
    CALLS_CLOSE,
    CALLS_OPEN,
    CALLS_SEPARATOR,
    DSML,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK_END,
    THINK_START,
)

ToolChoice = Literal["auto", "required", "named"]
Format = dict[str, Any]

_JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "array", "object", "null"})
# DSML that must not appear in "auto"'s free text: other spellings of a block (V4, V3.2, unspaced) and its inner
# tags outside one; only the exact opener starts a block (an exclude cannot cover "｜DSML｜" itself: the opener holds
# it).
_STRAY_DSML = (f"<{DSML}tool_calls", f"<{DSML}function_calls", f"<{DSML}calls", f"<{DSML}invoke", f"<{DSML} invoke",
               f"<{DSML}parameter", f"<{DSML} parameter", f"</{DSML}")
# Consecutive whitespace characters allowed inside a JSON parameter value (json.dumps writes at most one).
_MAX_JSON_WHITESPACE = 1


class ToolGrammarError(ValueError):
    """A ``tools`` entry or ``tool_choice`` the grammar cannot be built from; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def structural_tag(fmt: Format, thinking: bool = False) -> str:
    """The structural-tag JSON of ``fmt`` (a structural-tag format dict), after free reasoning when ``thinking``."""
    if thinking:
        fmt = {"type": "sequence", "elements": [reasoning_format(), fmt]}
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def reasoning_format() -> Format:
    """Free reasoning text up to and including ``</think>`` (no ``<think>``, no tool block inside)."""
    return {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": [THINK_START, CALLS_OPEN]},
            "end": THINK_END}


def tool_call_tag(tools: Sequence[Mapping[str, Any]], choice: ToolChoice, name: str | None = None,
                  thinking: bool = False, parallel: bool = True) -> str:
    """The structural tag of a V4.1 answer under ``tool_choice`` (CHAT_FORMAT.md §3(d), §4).

    tools: the OpenAI ``tools`` list (``{"type": "function", "function": {"name", "parameters"}}``).
    choice: "required" (a block of one or more calls), "named" (one call of ``name``) or "auto" (free text, or
        text then a block; nothing may follow the block).
    thinking: the prompt ends with ``<think>``: free reasoning up to ``</think>`` comes first.
    parallel: ``parallel_tool_calls``; False allows one call per block.

    Raises ToolGrammarError (``param`` = the field) for a tool without a name, duplicate names, parameters that
    are not an object schema, or a ``name`` not among the tools.
    """
    invokes = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        tool_name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(tool_name, str) or not tool_name:
            raise ToolGrammarError("a tool needs a non-empty function.name", f"tools[{i}].function.name")
        if tool_name in invokes:
            raise ToolGrammarError(f"two tools are named {tool_name!r}; tool names must be unique",
                                   f"tools[{i}].function.name")
        invokes[tool_name] = invoke_format(tool_name, function.get("parameters"), f"tools[{i}].function.parameters")
    if choice == "named":
        if name not in invokes:
            raise ToolGrammarError(f"tool_choice names {name!r}, which is not in tools {list(invokes)}",
                                   "tool_choice.function.name")
        calls = [invokes[name]]
        parallel = False
    else:
        calls = list(invokes.values())
    if not calls:
        raise ToolGrammarError(f"tool_choice {choice!r} needs at least one tool", "tools")
    body = {"type": "tags_with_separator", "tags": calls, "separator": "", "at_least_one": True,
            "stop_after_first": not parallel}
    if choice == "auto":
        block = {"type": "tag", "begin": f"{CALLS_OPEN}\n", "content": body, "end": CALLS_CLOSE}
        fmt: Format = {"type": "triggered_tags", "triggers": [CALLS_OPEN], "tags": [block],
                       "stop_after_first": True, "excludes": [THINK_START, THINK_END, *_STRAY_DSML]}
    else:
        fmt = {"type": "sequence", "elements": [_const(f"{CALLS_SEPARATOR}{CALLS_OPEN}\n"), body,
                                                _const(CALLS_CLOSE)]}
    return structural_tag(fmt, thinking)


def invoke_format(name: str, parameters: Any, where: str = "parameters") -> Format:
    """One ``<｜DSML｜ invoke name="NAME">`` ... ``</｜DSML｜ invoke>\\n`` whose parameters follow ``parameters``.

    parameters: the tool's JSON schema, ``type: "object"``; None is any parameters. The declared ``properties``
    come in schema order; other names only when ``additionalProperties`` is true or a schema. Absent, it counts as
    false when properties are declared and true when none are (as xgrammar's strict JSON schemas read an object:
    ``{"type": "object"}`` is any object). ``$defs`` / ``definitions`` of the root stay reachable from each
    parameter's schema. Raises ToolGrammarError naming ``where`` otherwise.
    """
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, Mapping):
        raise ToolGrammarError(f"parameters must be a JSON schema object, got {type(parameters).__name__}", where)
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ToolGrammarError(f"parameters must be an object schema (type 'object'), got type {kind!r}", where)
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    if not isinstance(properties, Mapping) or not isinstance(required, list) or \
            not all(isinstance(r, str) for r in required):
        raise ToolGrammarError("parameters.properties must be an object and parameters.required a list of names",
                               where)
    missing = [r for r in required if r not in properties]
    if missing:
        raise ToolGrammarError(f"required parameters {missing} are not in properties", f"{where}.required")
    shared = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    items = [(_parameter(_const(f"{PARAM_OPEN}{key}"), schema, shared, f"{where}.properties.{key}"),
              key in required) for key, schema in properties.items()]
    additional = parameters.get("additionalProperties", not properties)
    extra = None
    if additional is True or isinstance(additional, Mapping):
        name_text = _seq([_const(PARAM_OPEN), {"type": "regex", "pattern": '[^"<>\\n]+'}])
        extra = _parameter(name_text, additional, shared, f"{where}.additionalProperties")
    return {"type": "tag", "begin": f'{INVOKE_OPEN}{name}">\n', "content": _parameter_list(items, extra),
            "end": f"{INVOKE_CLOSE}\n"}


def _parameter_list(items: list[tuple[Format, bool]], extra: Format | None) -> Format:
    """Declared parameters in order, each at most once and the required ones present, then any number of
    ``extra`` ones; no parameter at all is the empty line ``\\n``."""
    tail = [{"type": "star", "content": extra}] if extra is not None else []
    if any(required for _, required in items):
        return _seq([p if req else {"type": "optional", "content": p} for p, req in items] + tail)
    # All optional: none (an empty line), or a first present one followed by optional later ones.
    options: list[Format] = [_const("\n")]
    for first in range(len(items)):
        options.append(_seq([items[first][0], *({"type": "optional", "content": p} for p, _ in items[first + 1:]),
                             *tail]))
    if extra is not None:
        options.append({"type": "plus", "content": extra})
    return options[0] if len(options) == 1 else {"type": "or", "elements": options}


def _parameter(opening: Format, schema: Any, shared: Mapping[str, Any], where: str) -> Format:
    """``<｜DSML｜ parameter name="KEY" string="...">VALUE</｜DSML｜ parameter>\\n`` for one property; ``opening``
    matches ``<｜DSML｜ parameter name="KEY``."""
    if schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise ToolGrammarError(f"a property schema must be an object, got {type(schema).__name__}", where)
    strings, others = _admits(schema)
    forms = []
    if strings:
        forms.append(_tag('" string="true">', _raw_string(schema), f"{PARAM_CLOSE}\n"))
    if others:
        # The parser ends a value at the first close tag, so no JSON string may hold one.
        value = {"type": "json_schema", "json_schema": without_string_lengths({**shared, **schema}),
                 "max_whitespace_cnt": _MAX_JSON_WHITESPACE, "excludes": [PARAM_CLOSE]}
        forms.append(_tag('" string="false">', value, f"{PARAM_CLOSE}\n"))
    if not forms:
        raise ToolGrammarError("this schema admits no value (an empty enum)", where)
    return _seq([opening, forms[0] if len(forms) == 1 else {"type": "or", "elements": forms}])


def _admits(schema: Mapping[str, Any]) -> tuple[bool, bool]:
    """(admits a string, admits a non-string) by ``type`` / ``enum`` / ``const`` / ``anyOf`` / ``oneOf``;
    (True, True) when the schema does not say (a ``$ref``, no type)."""
    if "const" in schema:
        return isinstance(schema["const"], str), not isinstance(schema["const"], str)
    if isinstance(schema.get("enum"), list):
        values = schema["enum"]
        return any(isinstance(v, str) for v in values), any(not isinstance(v, str) for v in values)
    kind = schema.get("type")
    if isinstance(kind, str):
        kind = [kind]
    if isinstance(kind, list) and kind and all(isinstance(k, str) and k in _JSON_TYPES for k in kind):
        return "string" in kind, any(k != "string" for k in kind)
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches and all(isinstance(b, Mapping) for b in branches):
        admitted = [_admits(b) for b in branches]
        return any(s for s, _ in admitted), any(o for _, o in admitted)
    return True, True


def _raw_string(schema: Mapping[str, Any]) -> Format:
    """The text of a ``string="true"`` value: one of its string ``enum`` / ``const`` values, its ``pattern``, or
    any text (which ends at the first ``</｜DSML｜ parameter>``, as the parser reads it)."""
    if "const" in schema or isinstance(schema.get("enum"), list):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return choice_format([v for v in values if isinstance(v, str)])
    if isinstance(schema.get("pattern"), str):
        return regex_format(schema["pattern"])
    return {"type": "any_text"}


def json_format(schema: Mapping[str, Any] | bool | None) -> Format:
    """A JSON value valid under ``schema``; None is any JSON object (``response_format`` ``json_object``). At most
    one whitespace character in a row (given free whitespace, the bundled model writes tabs until ``max_tokens``);
    string length bounds dropped (:func:`without_string_lengths`)."""
    body = {"type": "object"} if schema is None else without_string_lengths(dict(schema)) \
        if isinstance(schema, Mapping) else schema
    return {"type": "json_schema", "json_schema": body, "max_whitespace_cnt": _MAX_JSON_WHITESPACE}


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")


def without_string_lengths(schema: Any) -> Any:
    """``schema`` with every ``minLength`` / ``maxLength`` removed, through all nested schemas (property names are
    left alone). Inside a structural tag xgrammar 0.2.9 compiles a bounded JSON string into a rule that admits raw
    control characters (not JSON), and a structural tag cannot fall back to llguidance: the bound is dropped so the
    value stays JSON (README, "Structured outputs": which keywords tool calls do not enforce)."""
    if not isinstance(schema, Mapping):
        return schema
    out = {k: v for k, v in schema.items() if k not in ("minLength", "maxLength")}
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: without_string_lengths(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [without_string_lengths(sub) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = without_string_lengths(out[key])
    return out


def choice_format(choices: Sequence[str]) -> Format:
    """Exactly one of ``choices`` (vLLM's ``choice``)."""
    consts = [_const(c) for c in dict.fromkeys(choices)]
    return consts[0] if len(consts) == 1 else {"type": "or", "elements": consts}


def regex_format(pattern: str) -> Format:
    """Text matching ``pattern`` as a whole (vLLM's ``regex``)."""
    return {"type": "regex", "pattern": pattern}


def grammar_format(ebnf: str) -> Format:
    """Text of the xgrammar EBNF grammar ``ebnf`` (vLLM's ``grammar``; its ``root`` rule)."""
    return {"type": "grammar", "grammar": ebnf}


def _seq(elements: list[Format]) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _const(text: str) -> Format:
    return {"type": "const_string", "value": text}


def _tag(begin: str, content: Format, end: str) -> Format:
    return {"type": "tag", "begin": begin, "content": content, "end": end}
