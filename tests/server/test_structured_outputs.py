"""Structured outputs end to end with the official client, on the tiny random model at temperature 1 (whatever it
samples, the grammar must hold): response_format json_schema / json_object -> json.loads and schema-valid content;
tool_choice "required" and named -> tool_calls whose arguments are valid under the tool's schema, streamed and
not; "auto" still answers in text; vLLM's structured_outputs / guided_* extra body on both endpoints; and the 400s
of malformed or conflicting constraints. Schemas are checked by an independent oracle (tests/schema_oracle.py)."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from schema_oracle import errors
from serving_helpers import KEYS, MODEL, scripted

from deepseek_v41.chat.tokens import CALLS_CLOSE, CALLS_OPEN, EOS, INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE, PARAM_OPEN

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
PLAN = {"type": "function", "function": {"name": "plan", "description": "Plan a run", "parameters": {
    "type": "object", "properties": {"mode": {"enum": ["fast", "slow"]}, "dry_run": {"type": "boolean"},
                                     "level": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["mode", "dry_run"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping", "description": "Ping a host", "parameters": {
    "type": "object", "properties": {"host": {"enum": ["alpha", "beta"]}}, "required": ["host"],
    "additionalProperties": False}}}
TOOLS = [PLAN, PING]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "Plan a fast run, then ping alpha."}]
BUDGET = 400  # max_tokens: far more than the schemas need (whitespace between JSON tokens included), so a
# finished answer ended by itself


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=KEYS[0], max_retries=0, timeout=120)


def many(count, call):
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda _: call(), range(count)))


def json_answers(client, count):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    replies = many(count, lambda: client.chat.completions.create(
        model=MODEL, messages=QUESTION, response_format=fmt, temperature=1.0, max_tokens=BUDGET))
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        assert errors(json.loads(choice.message.content), SCHEMA) == [], choice.message.content
    for content, calls, finishes in many(count, lambda: streamed(
            client, messages=QUESTION, response_format=fmt, temperature=1.0, max_tokens=BUDGET)):
        assert finishes == ["stop"] and not calls
        assert errors(json.loads(content), SCHEMA) == [], content


def test_json_schema_5_of_5(client):
    json_answers(client, 5)


@pytest.mark.slow
def test_json_schema_50_of_50(client):
    json_answers(client, 50)


def test_json_object(client):
    for reply in many(3, lambda: client.chat.completions.create(
            model=MODEL, messages=QUESTION, response_format={"type": "json_object"}, max_tokens=BUDGET)):
        if reply.choices[0].finish_reason == "stop":  # any object: it may run past the budget
            assert isinstance(json.loads(reply.choices[0].message.content), dict)


def streamed(client, **kwargs):
    """A streamed answer: (content, tool calls by index, finish reasons)."""
    content, calls, finishes = "", {}, []
    for part in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in part.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"name": None, "arguments": ""})
                call["name"] = (piece.function.name if piece.function else None) or call["name"]
                call["arguments"] += (piece.function.arguments or "") if piece.function else ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return content, [calls[i] for i in sorted(calls)], finishes


def check_calls(calls, name=None):
    assert calls
    for call in calls:
        assert call["name"] in SCHEMAS and name in (None, call["name"])
        assert errors(json.loads(call["arguments"]), SCHEMAS[call["name"]]) == [], call


def tool_answers(client, count, tool_choice, name=None, parallel=None):
    kwargs = dict(messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, max_tokens=BUDGET)
    if parallel is not None:
        kwargs["parallel_tool_calls"] = parallel
    for reply in many(count, lambda: client.chat.completions.create(model=MODEL, **kwargs)):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
        check_calls(calls, name)
        assert parallel is not False or len(calls) == 1
    for content, calls, finishes in many(count, lambda: streamed(client, **kwargs)):
        assert finishes == ["tool_calls"] and content == ""
        check_calls(calls, name)


NAMED = {"type": "function", "function": {"name": "ping"}}


# A random model may chain parallel calls until max_tokens (each further call has a fixed chance), which is a cut
# answer, not a grammar failure: the counted runs allow one call (the grammar tests cover parallel blocks).
def test_tool_choice_required_and_named(client):
    tool_answers(client, 3, "required", parallel=False)
    tool_answers(client, 3, NAMED, "ping")


@pytest.mark.slow
def test_tool_choice_required_and_named_50_of_50(client):
    tool_answers(client, 50, "required", parallel=False)
    tool_answers(client, 50, NAMED, "ping")


def test_auto_still_answers_in_text(client):
    replies = many(4, lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                                             tool_choice="auto", max_tokens=24))
    texts = [r for r in replies if not r.choices[0].message.tool_calls]
    assert texts and all(r.choices[0].message.content for r in texts)
    for reply in replies:
        if reply.choices[0].message.tool_calls and reply.choices[0].finish_reason == "tool_calls":
            check_calls([{"name": c.function.name, "arguments": c.function.arguments}
                         for c in reply.choices[0].message.tool_calls])


THINKING = {"chat_template_kwargs": {"thinking": True}}


def test_thinking_stays_free_and_the_constraint_follows_it(server, client):
    """In thinking mode the grammar starts after </think>: a scripted answer (the real engine and grammar, only the
    sampler replays the text) with reasoning, then the JSON / the tool call, goes through whole."""
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    with scripted(server, 'Colours: "red" is fine.</think>{"ok": true, "color": "red"}' + EOS):
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, response_format=fmt, max_tokens=60,
                                               extra_body=THINKING)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop" and json.loads(message.content) == {"ok": True, "color": "red"}
    assert message.model_extra["reasoning_content"] == 'Colours: "red" is fine.'
    call = (f'\n\n{CALLS_OPEN}\n{INVOKE_OPEN}ping">\n{PARAM_OPEN}host" string="true">beta{PARAM_CLOSE}\n'
            f"{INVOKE_CLOSE}\n{CALLS_CLOSE}")
    with scripted(server, "Ping beta.</think>" + call + EOS):
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                               max_tokens=80, extra_body=THINKING)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] == "Ping beta."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("ping", {"host": "beta"})]


def test_vllm_structured_outputs_and_guided_fields(client):
    colors = ["red", "green", "blue"]
    for extra in ({"structured_outputs": {"choice": colors}}, {"guided_choice": colors}):
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, extra_body=extra)
        assert reply.choices[0].message.content in colors
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                           extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", reply.choices[0].message.content)
    reply = client.completions.create(model=MODEL, prompt="Colour:", max_tokens=BUDGET,
                                      extra_body={"guided_json": json.dumps(SCHEMA)})
    if reply.choices[0].finish_reason == "stop":
        assert errors(json.loads(reply.choices[0].text), SCHEMA) == []
    reply = client.completions.create(model=MODEL, prompt="Colour:", max_tokens=8,
                                      extra_body={"structured_outputs": {"choice": colors}})
    assert reply.choices[0].text in colors


def error_of(exc):
    return exc.response.json()["error"]


BAD = [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"extra_body": {"structured_outputs": {"json": SCHEMA, "regex": "a"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"whitespace_pattern": " "}}}, "structured_outputs.whitespace_pattern"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "structured_outputs.json"),
    ({"extra_body": {"guided_regex": 5}}, "guided_regex"),
    ({"extra_body": {"guided_json": SCHEMA, "guided_regex": "a"}}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [PING, PING], "tool_choice": "required"}, "tools[1].function.name"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": "{"}], "response_format": {"type": "json_object"},
      "extra_body": {"continue_final_message": True, "add_generation_prompt": False}}, "continue_final_message"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD)
def test_malformed_or_conflicting_constraints_name_the_field(client, kwargs, param):
    kwargs = {"messages": QUESTION, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, **kwargs)
    assert error_of(info.value)["param"] == param, error_of(info.value)
