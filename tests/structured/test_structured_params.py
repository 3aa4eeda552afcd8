"""StructuredOutputsParams (vLLM's names): exactly one constraint, checked types, and the (kind, spec) cache key."""

import pytest

from deepseek_v41.engine.sampling_params import SamplingParams, StructuredOutputsParams


def test_exactly_one_field_is_set():
    with pytest.raises(ValueError, match=r"exactly one of json, regex, choice, grammar, json_object, "
                                         r"structural_tag set; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"got json, regex"):
        StructuredOutputsParams(json={"type": "integer"}, regex="[0-9]+")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams(json_object=False)  # False is "not asked", as in vLLM


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"json": "{not json"}, r"structured_outputs.json must be a JSON schema"),
    ({"json": "[1, 2]"}, r"structured_outputs.json must be a JSON object schema, got list"),
    ({"json": 3}, r"structured_outputs.json must be a dict or a JSON string, got int"),
    ({"regex": ""}, r"structured_outputs.regex must be a non-empty string"),
    ({"grammar": 5}, r"structured_outputs.grammar must be a non-empty string"),
    ({"choice": "yes"}, r"structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": []}, r"structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, r"structured_outputs.choice must be a non-empty list of strings"),
    ({"json_object": "yes"}, r"structured_outputs.json_object must be True or None"),
])
def test_bad_fields_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_kind_and_spec_key_the_cache():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    p = StructuredOutputsParams(json=schema)
    assert p.kind == "json"
    assert p.spec == '{"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}'
    assert StructuredOutputsParams(json=p.spec).spec == p.spec  # text is used as given
    assert StructuredOutputsParams(choice=("x", "y")).spec == '["x", "y"]'
    assert StructuredOutputsParams(json_object=True).spec == "{}"
    assert StructuredOutputsParams(regex="a+").spec == "a+"


def test_sampling_params_take_it():
    p = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    assert p.structured_outputs.kind == "regex"
    assert SamplingParams().structured_outputs is None
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams or None, got dict"):
        SamplingParams(structured_outputs={"json": {}})


def test_exported_where_sampling_params_is():
    import deepseek_v41
    from deepseek_v41.engine import StructuredOutputsParams as FromEngine

    assert deepseek_v41.StructuredOutputsParams is FromEngine is StructuredOutputsParams
