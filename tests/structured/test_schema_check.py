"""The package's JSON-schema validator (deepseek_v41/structured/schema_check.py), the oracle of the structured-output
tests and of ``dsv41 eval-chat``: hand-checked verdicts from JSON Schema's validation rules, one keyword at a time."""

import pytest

from deepseek_v41.structured.schema_check import schema_errors

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                                           "name": {"type": "string", "pattern": "^[a-z]+$"}},
          "required": ["n"], "additionalProperties": False, "description": "d", "default": {"n": 1}}


@pytest.mark.parametrize(("value", "problem"), [
    ({"n": 1}, None),
    ({"n": 9, "tags": ["a", "b"], "name": "abc"}, None),
    ({}, "$: missing 'n'"),
    ({"n": 0}, "$.n: 0 < minimum 1"),
    ({"n": 1.5}, "$.n: 1.5 is not of type ['integer']"),
    ({"n": True}, "is not of type ['integer']"),  # a bool is not an integer in JSON
    ({"n": 2, "x": 1}, "$: unexpected property 'x'"),
    ({"n": 2, "tags": ["c"]}, "$.tags[0]: 'c' not in ['a', 'b']"),
    ({"n": 2, "tags": ["a", "a", "a"]}, "$.tags: 3 items outside"),
    ({"n": 2, "name": "ABC"}, "does not match"),
    ([1], "is not of type ['object']"),
])
def test_verdicts(value, problem):
    found = schema_errors(value, SCHEMA)
    assert (found == []) if problem is None else any(problem in p for p in found), found


def test_absent_additional_properties_allows_extras_and_unknown_keywords_are_refused():
    assert schema_errors({"x": 1}, {"type": "object", "properties": {"n": {"type": "integer"}}}) == []
    with pytest.raises(ValueError, match=r"does not know \['anyOf'\]"):
        schema_errors(1, {"anyOf": [{"type": "integer"}]})
