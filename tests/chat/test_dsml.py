"""DSML rendering (CHAT_FORMAT.md §3(c), §3(d)): block layout, value typing, argument decoding."""

import pytest

from deepseek_v41.chat import encode_messages
from deepseek_v41.chat.dsml import decode_arguments, render_tool_calls

P_OPEN, P_CLOSE = '<｜DSML｜ parameter name="', "</｜DSML｜ parameter>"


def history_with(arguments, content="") -> str:
    """The assistant turn rendered for one call to ``f`` (chat mode: no thinking part)."""
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            ],
        },
    ]
    return encode_messages(messages).split("<｜Assistant｜></think>", 1)[1]


def test_block_layout_with_content():
    assert history_with({"city": "Paris", "days": 2}, content="Let me check.") == (
        'Let me check.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        f'{P_OPEN}city" string="true">Paris{P_CLOSE}\n{P_OPEN}days" string="false">2{P_CLOSE}\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>"
    )


def test_call_without_arguments_renders_an_empty_line():
    assert history_with("{}") == (
        '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n\n</｜DSML｜ invoke>\n'
        "</｜DSML｜ calls><｜end▁of▁sentence｜>"
    )


def test_parallel_calls_share_one_block():
    block = render_tool_calls([("f", {"a": 1}), ("g", {})])
    assert block == (
        '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        f'{P_OPEN}a" string="false">1{P_CLOSE}\n</｜DSML｜ invoke>\n'
        '<｜DSML｜ invoke name="g">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    )


def test_string_values_go_in_verbatim():
    raw = 'a < b && c > "d"\nline 2 \\n é'
    assert f'{P_OPEN}s" string="true">{raw}{P_CLOSE}' in history_with({"s": raw})


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (True, "true"),
        (None, "null"),
        (3, "3"),
        (2.5, "2.5"),
        ({"a": 1}, '{"a": 1}'),
        ([1, 2], "[1, 2]"),
        ({"k": "é"}, '{"k": "é"}'),
        ([], "[]"),
    ],
)
def test_other_values_are_json_with_default_separators(value, text):
    assert f'{P_OPEN}v" string="false">{text}{P_CLOSE}' in history_with({"v": value})


@pytest.mark.parametrize(
    ("arguments", "decoded"),
    [
        ({"a": 1}, {"a": 1}),
        ('{"a": 1, "b": "x"}', {"a": 1, "b": "x"}),
        ('"{\\"a\\": 1}"', {"a": 1}),  # double-encoded JSON is unwrapped
        ("[1, 2]", {"arguments": "[1, 2]"}),  # not an object: wrapped, original string kept
        ('"just text"', {"arguments": '"just text"'}),
        ("3", {"arguments": "3"}),
        ("", {"arguments": ""}),
        ("{not json", {"arguments": "{not json"}),
        (
            '"\\"{\\\\\\"a\\\\\\": 1}\\""',
            {"arguments": '"\\"{\\\\\\"a\\\\\\": 1}\\""'},
        ),  # triple: only two passes
    ],
)
def test_argument_decoding(arguments, decoded):
    assert decode_arguments(arguments) == decoded


def test_wrapped_arguments_render_as_a_string_parameter():
    assert f'{P_OPEN}arguments" string="true">[1, 2]{P_CLOSE}' in history_with("[1, 2]")


def test_key_order_kept_as_sent():
    assert history_with('{"z": 1, "a": 2}').index('name="z"') < history_with('{"z": 1, "a": 2}').index(
        'name="a"'
    )


def test_thinking_part_precedes_the_block():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "reasoning_content": "r",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
        },
    ]
    assert "<｜Assistant｜><think>r</think>\n\n<｜DSML｜ calls>\n" in encode_messages(messages, thinking=True)
