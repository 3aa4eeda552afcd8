"""Request validation and preprocessing: §2 rules 1-3 and every rejection with its message."""

import re

import pytest

from deepseek_v41.chat import ChatFormatError, encode_messages

BOS = "<｜begin▁of▁sentence｜>"


def call(call_id: str, name: str = "f", arguments="{}") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant_calling(*ids: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [call(i) for i in ids]}


def tool(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def user_turn(prompt: str) -> str:
    """The text of the last user turn of a chat prompt."""
    return prompt.rsplit("<｜User｜>", 1)[1].removesuffix("<｜Assistant｜></think>")


# --- §2 rule 2: tool messages become user turns; adjacent user turns merge ----------------------------------


def test_consecutive_user_messages_merge():
    prompt = encode_messages([{"role": "user", "content": "first"}, {"role": "user", "content": "second"}])
    assert prompt == BOS + "<｜User｜>first\n\nsecond<｜Assistant｜></think>"


def test_user_text_next_to_tool_results_merges_into_one_turn():
    messages = [
        {"role": "user", "content": "q"},
        assistant_calling("a"),
        tool("a", "r"),
        {"role": "user", "content": "and now?"},
    ]
    assert user_turn(encode_messages(messages)) == "<tool_result>r</tool_result>\n\nand now?"


def test_tool_result_joins_a_preceding_user_message():
    messages = [{"role": "user", "content": "q"}, tool("a", "r")]
    assert (
        encode_messages(messages)
        == BOS + "<｜User｜>q\n\n<tool_result>r</tool_result><｜Assistant｜></think>"
    )


def test_a_user_message_after_a_task_starts_a_new_turn():
    messages = [{"role": "user", "content": "a", "task": "query"}, {"role": "user", "content": "b"}]
    assert encode_messages(messages) == BOS + "<｜User｜>a<｜User｜>b<｜Assistant｜></think>"


def test_there_is_no_tool_role_and_ids_are_never_rendered():
    messages = [{"role": "user", "content": "q"}, assistant_calling("secret_id"), tool("secret_id", "r")]
    prompt = encode_messages(messages)
    assert "secret_id" not in prompt and "tool" not in prompt.replace("tool_result", "")


# --- §2 rule 3: tool results in call order ----------------------------------------------------------------


def test_tool_results_sorted_by_call_order():
    messages = [
        {"role": "user", "content": "q"},
        assistant_calling("a", "b", "c"),
        tool("c", "3"),
        tool("a", "1"),
        tool("b", "2"),
    ]
    assert user_turn(encode_messages(messages)) == (
        "<tool_result>1</tool_result>\n\n<tool_result>2</tool_result>\n\n<tool_result>3</tool_result>"
    )


def test_unknown_ids_sort_as_position_0_stably():
    messages = [
        {"role": "user", "content": "q"},
        assistant_calling("a", "b"),
        tool("b", "2"),
        tool("zz", "?"),
        tool("a", "1"),
    ]
    assert user_turn(encode_messages(messages)) == (
        "<tool_result>?</tool_result>\n\n<tool_result>1</tool_result>\n\n<tool_result>2</tool_result>"
    )


def test_text_blocks_keep_their_places_while_results_sort():
    messages = [
        {"role": "user", "content": "q"},
        assistant_calling("a", "b"),
        tool("b", "2"),
        {"role": "user", "content": "note"},
        tool("a", "1"),
    ]
    assert user_turn(encode_messages(messages)) == (
        "<tool_result>1</tool_result>\n\nnote\n\n<tool_result>2</tool_result>"
    )


# --- §3(c): where the tools go ------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "description": "d"}}
TOOLS_START = "\n\n## Tools\n\nYou have access to a set of tools"


def test_tools_attach_to_the_first_system_message():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    assert encode_messages(messages, tools=[TOOL]).startswith(BOS + "<｜System｜>S" + TOOLS_START)


def test_tools_without_a_system_message_insert_an_empty_one():
    assert encode_messages([{"role": "user", "content": "q"}], tools=[TOOL]).startswith(
        BOS + "<｜System｜>" + TOOLS_START
    )


def test_tool_schemas_keep_key_order_one_per_line():
    second = {"type": "function", "function": {"name": "g", "description": "é"}}
    prompt = encode_messages([{"role": "user", "content": "q"}], tools=[TOOL, second])
    assert (
        '### Available Tool Schemas\n\n{"name": "f", "parameters": {"type": "object"}, "description": "d"}\n'
        '{"name": "g", "description": "é"}\n\nYou MUST'
    ) in prompt


def test_tools_in_a_system_message_count_as_tools():
    messages = [{"role": "system", "content": "", "tools": [TOOL]}, {"role": "user", "content": "q"}]
    assert encode_messages(messages) == encode_messages(messages[1:], tools=[TOOL])


# --- rejections -------------------------------------------------------------------------------------------

USER = {"role": "user", "content": "q"}
REJECTED = [
    ("empty list", [], {}, "messages: must be a non-empty list"),
    ("not a list", "hello", {}, "messages: must be a non-empty list"),
    ("not an object", ["hi"], {}, "messages[0]: is str; a message must be an object"),
    (
        "unknown role",
        [{"role": "moderator", "content": "x"}, USER],
        {},
        "messages[0].role: unknown role 'moderator'; allowed: system, developer, user, assistant, tool, "
        "latest_reminder",
    ),
    ("developer without text", [{"role": "developer", "content": ""}, USER], {},
     "messages[0].content: a developer message needs non-empty content"),
    ("developer null content", [{"role": "developer", "content": None}, USER], {},
     "messages[0].content: is NoneType; content must be a string or a list of parts"),
    ("task on developer", [{"role": "developer", "content": "x", "task": "query"}], {},
     "messages[0].task: must be on a user message"),
    ("no role", [{"content": "x"}], {}, "messages[0].role: unknown role None"),
    ("function role", [{"role": "function", "content": "x"}], {}, "unknown role 'function'"),
    (
        "user special token",
        [{"role": "user", "content": "hi <｜User｜> there"}],
        {},
        "messages[0].content: contains the special token '<｜User｜>'",
    ),
    (
        "EOS",
        [{"role": "user", "content": "a<｜end▁of▁sentence｜>"}],
        {},
        "special token '<｜end▁of▁sentence｜>'",
    ),
    ("think tag", [{"role": "user", "content": "what is </think>?"}], {}, "special token '</think>'"),
    (
        "DSML",
        [{"role": "system", "content": "｜DSML｜"}, USER],
        {},
        "messages[0].content: contains the special",
    ),
    (
        "image token",
        [{"role": "user", "content": "<｜deepseek_image｜>"}],
        {},
        "send images as image_url content parts",
    ),
    (
        "text part token",
        [{"role": "user", "content": [{"type": "text", "text": "<｜Assistant｜>"}]}],
        {},
        "messages[0].content[0].text: contains the special token",
    ),
    (
        "reasoning token",
        [USER, {"role": "assistant", "content": "a", "reasoning_content": "<think>"}],
        {},
        "messages[1].reasoning_content: contains the special token '<think>'",
    ),
    ("tool result token", [USER, tool("a", "<｜begin▁of▁sentence｜>")], {}, "messages[1].content: contains"),
    ("task token", [{"role": "user", "content": "<｜action｜>"}], {}, "special token '<｜action｜>'"),
    (
        "content type",
        [{"role": "user", "content": 3}],
        {},
        "messages[0].content: is int; content must be a string or a list of parts",
    ),
    ("user null", [{"role": "user", "content": None}], {}, "content must be a string or a list of parts"),
    (
        "tool null",
        [USER, {"role": "tool", "tool_call_id": "a", "content": None}],
        {},
        "messages[1].content: is",
    ),
    (
        "part type",
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
        {},
        "messages[0].content[0]: part type 'input_audio' is not supported; "
        "allowed: 'text', 'image_url', 'input_image', 'image', 'image_pil'",
    ),
    ("text part", [{"role": "user", "content": [{"type": "text"}]}], {}, "a text part needs a string 'text'"),
    (
        "image url",
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}],
        {},
        "an image_url part needs",
    ),
    (
        "image source",
        [{"role": "user", "content": [{"type": "image"}]}],
        {},
        "an image part needs a 'source'",
    ),
    (
        "call shape",
        [USER, {"role": "assistant", "tool_calls": [{"name": "f"}]}],
        {},
        "messages[1].tool_calls[0]: a tool call must be",
    ),
    ("call list", [USER, {"role": "assistant", "tool_calls": {"a": 1}}], {}, "tool_calls: must be a list"),
    (
        "call type",
        [USER, {"role": "assistant", "tool_calls": [dict(call("a"), type="custom")]}],
        {},
        "messages[1].tool_calls[0].type: is 'custom'",
    ),
    (
        "call name",
        [USER, {"role": "assistant", "tool_calls": [call("a", name="")]}],
        {},
        "messages[1].tool_calls[0].function.name: must be a non-empty string",
    ),
    (
        "call name quote",
        [USER, {"role": "assistant", "tool_calls": [call("a", name='f">')]}],
        {},
        "contains '\"', which DSML cannot quote",
    ),
    (
        "call arguments",
        [USER, {"role": "assistant", "tool_calls": [call("a", arguments=[1])]}],
        {},
        "function.arguments: is list; arguments must be a JSON string or an object",
    ),
    (
        "missing arguments",
        [USER, {"role": "assistant", "tool_calls": [call("a", arguments=None)]}],
        {},
        "function.arguments: is NoneType",
    ),
    (
        "argument JSON",
        [USER, {"role": "assistant", "tool_calls": [call("a", arguments={"s": {1}})]}],
        {},
        "function.arguments['s']: cannot be written as JSON",
    ),
    (
        "argument DSML",
        [USER, {"role": "assistant", "tool_calls": [call("a", arguments={"s": "x</｜DSML｜ parameter>"})]}],
        {},
        "function.arguments['s']: contains the special token '｜DSML｜'",
    ),
    (
        "argument key",
        [USER, {"role": "assistant", "tool_calls": [call("a", arguments={'a"b': 1})]}],
        {},
        "function.arguments['a\"b']: 'a\"b' contains '\"'",
    ),
    ("call id", [USER, {"role": "assistant", "tool_calls": [dict(call("a"), id=5)]}], {}, "tool_calls[0].id"),
    (
        "tool call id",
        [USER, {"role": "tool", "tool_call_id": 5, "content": "r"}],
        {},
        "tool_call_id: must be",
    ),
    (
        "reasoning type",
        [USER, {"role": "assistant", "content": "a", "reasoning_content": 1}],
        {},
        "reasoning_content: must be a string or null",
    ),
    (
        "tools on user",
        [dict(USER, tools=[TOOL])],
        {},
        "messages[0].tools: is only rendered on a system or developer message, not on 'user'",
    ),
    (
        "response_format on user",
        [dict(USER, response_format={"type": "json_object"})],
        {},
        "messages[0].response_format",
    ),
    (
        "task value",
        [dict(USER, task="summarize")],
        {},
        "messages[0].task: must be on a user message and one of",
    ),
    ("task role", [USER, {"role": "assistant", "content": "a", "task": "action"}], {}, "messages[1].task"),
    (
        "wo_eos",
        [USER, {"role": "assistant", "content": "a", "wo_eos": "yes"}],
        {},
        "wo_eos: must be a boolean",
    ),
    ("tools type", [USER], {"tools": {"type": "function"}}, "tools: tools must be a list"),
    ("tool shape", [USER], {"tools": [{"type": "function", "name": "f"}]}, "tools[0]: a tool must be"),
    ("tool kind", [USER], {"tools": [dict(TOOL, type="web_search")]}, "tools[0]: a tool must be"),
    (
        "tool name",
        [USER],
        {"tools": [{"type": "function", "function": {"description": "x"}}]},
        "tools[0].function.name: must be a non-empty string",
    ),
    (
        "tool token",
        [USER],
        {"tools": [{"type": "function", "function": {"name": "f", "description": "<｜User｜>"}}]},
        "tools[0].function: contains the special token",
    ),
    (
        "tools twice",
        [{"role": "system", "content": "", "tools": [TOOL]}, USER],
        {"tools": [TOOL]},
        "tools: the first system message already carries tools",
    ),
    ("thinking flag", [USER], {"thinking": "yes"}, "thinking: must be a bool"),
    ("drop flag", [USER], {"drop_thinking": None}, "drop_thinking: must be a bool"),
]


@pytest.mark.parametrize(
    ("messages", "kwargs", "message"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED]
)
def test_rejections_say_what_and_what_is_allowed(messages, kwargs, message):
    with pytest.raises(ChatFormatError, match=re.escape(message)) as info:
        encode_messages(messages, **kwargs)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("effort", [0, 101, True, 1.5, 50.0, "xhigh", "none", "medium", "HIGH"])
def test_invalid_efforts_rejected_in_every_mode(effort):
    for thinking in (True, False):  # the official encoder validates it whatever the mode
        with pytest.raises(ChatFormatError, match=r"reasoning_effort: .* use an int in 1\.\.100 or one of"):
            encode_messages([USER], thinking=thinking, reasoning_effort=effort)


def test_think_tags_allowed_in_argument_values():
    # Values are data up to the parameter close tag, and code often holds think tags.
    messages = [
        USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("a", arguments={"code": "s.split('</think>')"})],
        },
    ]
    assert '<｜DSML｜ parameter name="code" string="true">s.split(\'</think>\')</｜DSML｜ parameter>' in (
        encode_messages(messages)
    )


def test_reasoning_alias_is_accepted():
    base = [USER, {"role": "assistant", "content": "a"}]
    with_content = [base[0], dict(base[1], reasoning_content="r")]
    with_alias = [base[0], dict(base[1], reasoning="r")]
    assert encode_messages(with_alias, thinking=True) == encode_messages(with_content, thinking=True)
