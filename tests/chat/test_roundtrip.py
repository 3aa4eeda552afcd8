"""Round trip: an assistant turn encoded into a prompt parses back to the same message, and back again."""

import json

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from deepseek_v41.chat import encode_messages, parse_output
from deepseek_v41.chat.tokens import RESERVED, RESERVED_IN_VALUES

USER = {"role": "user", "content": "Weather in Paris and Tokyo?"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def completion_of(assistant: dict, thinking: bool, tools=None) -> str:
    """The text a model would generate for ``assistant``: the conversation minus its prompt."""
    prompt = encode_messages([USER], tools=tools, thinking=thinking)
    full = encode_messages([USER, assistant], tools=tools, thinking=thinking)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def test_example_3_assistant_turn_round_trips():
    arguments = [{"city": "Paris", "days": 2}, {"city": "Tokyo", "options": {"unit": "C", "alerts": True}}]
    assistant = {
        "role": "assistant",
        "reasoning_content": "Call the tool twice.",
        "content": "",
        "tool_calls": [
            {
                "id": f"call_{k}",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(a)},
            }
            for k, a in enumerate(arguments)
        ],
    }
    parsed = parse_output(completion_of(assistant, thinking=True, tools=TOOLS), thinking=True)
    assert parsed["reasoning_content"] == "Call the tool twice." and parsed["content"] == ""
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed["tool_calls"]] == arguments


# Text rich in the pieces markup is made of; whatever the encoder accepts must come back unchanged.
_PIECES = list('ab <>/"\\\n{}é🙂｜') + [
    "<think",
    "</think",
    "<｜DSML",
    "DSML｜ calls>",
    "\n\n<",
    "｜ parameter>",
]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=20).map("".join)
_VALUE_TEXT = st.lists(st.sampled_from([*_PIECES, "</think>", "<think>"]), max_size=12).map("".join)
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _VALUE_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_VALUE_TEXT, inner, max_size=3),
    max_leaves=8,
)
_KEY = st.text(st.sampled_from(list("abc_<>/ é1")), max_size=8)
_CALL = st.tuples(
    st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True), st.dictionaries(_KEY, _JSON, max_size=4)
)


def _clean(text: str, reserved=RESERVED) -> bool:
    return not any(token in text for token in reserved)


@settings(max_examples=150, deadline=None)
@given(
    content=_TEXT,
    reasoning=_TEXT,
    calls=st.lists(_CALL, max_size=3),
    thinking=st.booleans(),
    as_strings=st.booleans(),
)
def test_encode_then_parse_then_encode(content, reasoning, calls, thinking, as_strings):
    assume(_clean(content) and _clean(reasoning))
    assume(all(_clean(json.dumps(a, ensure_ascii=False), RESERVED_IN_VALUES) for _, a in calls))
    assistant = {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": [
            {
                "id": f"c{k}",
                "type": "function",
                "function": {"name": n, "arguments": json.dumps(a) if as_strings else a},
            }
            for k, (n, a) in enumerate(calls)
        ],
    }
    tools = TOOLS if calls else None
    completion = completion_of(assistant, thinking, tools)
    parsed = parse_output(completion, thinking=thinking)

    assert parsed["content"] == content
    assert parsed["reasoning_content"] == (reasoning if thinking else "")
    # The official rule rebuilds exactly json.dumps(arguments, ensure_ascii=False) from the DSML.
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed["tool_calls"]] == [
        (n, json.dumps(a, ensure_ascii=False)) for n, a in calls
    ]
    # The parsed message, sent back as history, renders the same bytes.
    echoed = {"role": "assistant", **parsed}
    if not thinking:
        echoed["reasoning_content"] = reasoning
    assert completion_of(echoed, thinking, tools) == completion
