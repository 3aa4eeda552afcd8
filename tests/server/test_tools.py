"""Tool calls and thinking end to end with the official client, on a scripted-output backend (the real engine,
detokenizer, server and parser; only the sampler replays a fixed completion): a tool-call round trip
(call -> tool message -> final answer) streaming and not, tool_choice, parallel_tool_calls, reasoning_content."""

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serving_helpers import KEYS, MODEL, scripted

from deepseek_v41.chat.tokens import CALLS_CLOSE, CALLS_OPEN, EOS, INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE, PARAM_OPEN

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def invoke(city: str, days: int) -> str:
    return (f'{INVOKE_OPEN}get_weather">\n{PARAM_OPEN}city" string="true">{city}{PARAM_CLOSE}\n'
            f'{PARAM_OPEN}days" string="false">{days}{PARAM_CLOSE}\n{INVOKE_CLOSE}')


CALL = f"\n\n{CALLS_OPEN}\n{invoke('Paris', 2)}\n{CALLS_CLOSE}"
TWO_CALLS = f"Let me check.\n\n{CALLS_OPEN}\n{invoke('Paris', 2)}\n{invoke('Tokyo', 1)}\n{CALLS_CLOSE}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=KEYS[0], max_retries=0, timeout=60)


def streamed(client, **kwargs):
    """Concatenate a streamed chat answer: (content, reasoning, tool calls by index, finish reasons)."""
    content, reasoning, calls, finishes = "", "", {}, []
    for part in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        if not part.choices:
            continue
        choice = part.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = piece.id or call["id"]
            call["name"] = (piece.function.name if piece.function else None) or call["name"]
            call["arguments"] += (piece.function.arguments or "") if piece.function else ""
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    return content, reasoning, calls, finishes


def together(*calls):
    """Run the calls concurrently (the engine batches them) and return their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def test_tool_call_round_trip(server, client):
    with scripted(server, CALL + EOS):
        first, (content, _, calls, finishes) = together(
            lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=200),
            lambda: streamed(client, messages=QUESTION, tools=TOOLS, max_tokens=200))
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert finishes == ["tool_calls"] and content == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}

    history = [*QUESTION, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "11C and sunny"}]
    answer = "It is 11C and sunny in Paris."
    with scripted(server, answer + EOS):
        final, (content, _, calls, finishes) = together(
            lambda: client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=200),
            lambda: streamed(client, messages=history, tools=TOOLS, max_tokens=200))
    assert final.choices[0].message.content == answer and final.choices[0].finish_reason == "stop"
    assert not final.choices[0].message.tool_calls
    assert (content, calls, finishes) == (answer, {}, ["stop"])


def test_parallel_calls_and_tool_choice(server, client):
    with scripted(server, TWO_CALLS + EOS):
        both, none = together(
            lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=200),
            lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=200,
                                                   tool_choice="none"))
    assert both.choices[0].message.content == "Let me check."
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Paris", "Tokyo"]
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason == "stop"
    # parallel_tool_calls: false lets the grammar take one call only, so the script makes one.
    one_call = f"Let me check.\n\n{CALLS_OPEN}\n{invoke('Paris', 2)}\n{CALLS_CLOSE}"
    with scripted(server, one_call + EOS):
        one, (content, _, calls, _) = together(
            lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=200,
                                                   parallel_tool_calls=False),
            lambda: streamed(client, messages=QUESTION, tools=TOOLS, max_tokens=200, parallel_tool_calls=False))
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]
    assert content == "Let me check." and list(calls) == [0]


def test_named_and_required_tool_choice(server, client):
    """A named or required choice is decoded under the DSML grammar: the model writes the whole block."""
    script = (f'\n\n{CALLS_OPEN}\n{INVOKE_OPEN}get_weather">\n{PARAM_OPEN}city" string="true">Oslo{PARAM_CLOSE}\n'
              f"{INVOKE_CLOSE}\n{CALLS_CLOSE}")
    named = {"type": "function", "function": {"name": "get_weather"}}
    with scripted(server, script + EOS):
        full, (_, _, calls, finishes), required = together(
            lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=named,
                                                   max_tokens=60),
            lambda: streamed(client, messages=QUESTION, tools=TOOLS, tool_choice=named, max_tokens=60),
            lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                                   tool_choice="required", max_tokens=60))
    (call,) = full.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert full.choices[0].finish_reason == "tool_calls" and finishes == ["tool_calls"]
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    assert json.loads(required.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_thinking_reasoning_content(server, client):
    script = "The user greets; answer briefly.</think>Hello! 2 < 3 and a|b." + EOS
    kwargs = dict(messages=QUESTION, max_tokens=200, extra_body={"chat_template_kwargs": {"thinking": True}})
    with scripted(server, script):
        full, (content, reasoning, calls, finishes) = together(
            lambda: client.chat.completions.create(model=MODEL, **kwargs), lambda: streamed(client, **kwargs))
    message = full.choices[0].message
    assert message.model_extra["reasoning_content"] == "The user greets; answer briefly."
    assert message.content == "Hello! 2 < 3 and a|b."
    assert (content, reasoning, calls, finishes) == (message.content, message.model_extra["reasoning_content"], {},
                                                     ["stop"])
