"""The request -> StructuredOutputsParams mapping without a server: response_format, vLLM's structured_outputs and
guided_* fields, tool_choice, and thinking (the constraint moves after ``</think>``)."""

import json

import pytest

from deepseek_v41.server.errors import APIError
from deepseek_v41.server.protocol import ChatCompletionRequest, CompletionRequest
from deepseek_v41.server.structured import request_constraint, tool_constraint

HI = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {
    "host": {"type": "string"}}, "required": ["host"]}}}


def kwargs_of(thinking=False, **fields):
    constraint = request_constraint(ChatCompletionRequest(messages=HI, **fields))
    return None if constraint is None else constraint.engine_kwargs(thinking)


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "v"}}}, {"json": {"type": "object"}}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"json": SCHEMA}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
    ({"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, {"grammar": 'root ::= "x"'}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
    ({"structured_outputs": {"json_object": False, "regex": "a"}}, {"regex": "a"}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ({"guided_regex": "a+"}, {"regex": "a+"}),
    ({"guided_choice": ["x"]}, {"choice": ["x"]}),
    ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),
])
def test_chat_mode_maps_one_to_one(fields, expected):
    assert kwargs_of(**fields) == expected


def test_completions_take_the_same_fields():
    req = CompletionRequest(prompt="x", structured_outputs={"choice": ["a"]})
    assert request_constraint(req).engine_kwargs(False) == {"choice": ["a"]}
    req = CompletionRequest(prompt="x", response_format={"type": "json_object"})
    assert request_constraint(req).engine_kwargs(False) == {"json_object": True}


@pytest.mark.parametrize(("fields", "inner"), [
    ({"response_format": {"type": "json_object"}},
     {"type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": 1}),
    ({"guided_json": SCHEMA}, {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1}),
    ({"guided_regex": "a+"}, {"type": "regex", "pattern": "a+"}),
    ({"guided_choice": ["x", "y"]}, {"type": "or", "elements": [{"type": "const_string", "value": "x"},
                                                                {"type": "const_string", "value": "y"}]}),
    ({"structured_outputs": {"structural_tag": json.dumps(
        {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}})}},
     {"type": "const_string", "value": "x"}),
])
def test_thinking_mode_constrains_after_the_reasoning(fields, inner):
    (tag,) = kwargs_of(thinking=True, **fields).values()
    fmt = json.loads(tag)["format"]
    assert fmt["type"] == "sequence" and fmt["elements"][1] == inner
    assert fmt["elements"][0]["end"] == "</think>" and fmt["elements"][0]["content"]["type"] == "any_text"


def test_legacy_structural_tag_is_refused_in_thinking_mode():
    legacy = {"type": "structural_tag", "structures": [], "triggers": []}
    assert kwargs_of(structured_outputs={"structural_tag": legacy}) == {"structural_tag": json.dumps(legacy)}
    with pytest.raises(APIError) as info:
        kwargs_of(thinking=True, structured_outputs={"structural_tag": legacy})
    assert info.value.param == "structured_outputs.structural_tag"


def test_tool_constraint_is_a_structural_tag_with_its_own_reasoning_prefix():
    for thinking in (False, True):
        constraint = tool_constraint([PING], "required", None, thinking, True)
        (kind, tag), = constraint.engine_kwargs(thinking).items()
        assert kind == "structural_tag" and constraint.param == "tools"  # a tag that does not compile: a schema
        elements = json.loads(tag)["format"]["elements"]
        assert (elements[0].get("end") == "</think>") is thinking
    with pytest.raises(APIError) as info:
        tool_constraint([PING], "named", "nope", False, True)
    assert info.value.param == "tool_choice.function.name"
