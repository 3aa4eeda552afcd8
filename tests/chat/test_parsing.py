"""parse_output (CHAT_FORMAT.md §4): the strict reading of well-formed output, then each tolerant fallback."""

import json
import re

import pytest

from deepseek_v41.chat import StreamingParser, parse_output

EOS = "<｜end▁of▁sentence｜>"
OPEN, CLOSE = "<｜DSML｜ calls>", "</｜DSML｜ calls>"


def invoke(name: str, *params: tuple[str, str, str]) -> str:
    body = "\n".join(
        f'<｜DSML｜ parameter name="{k}" string="{s}">{v}</｜DSML｜ parameter>' for k, s, v in params
    )
    return f'<｜DSML｜ invoke name="{name}">\n{body}\n</｜DSML｜ invoke>'


def block(*invokes: str) -> str:
    return f"\n\n{OPEN}\n" + "\n".join(invokes) + f"\n{CLOSE}"


def calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def message(content="", reasoning="", tool_calls=()) -> tuple[str, str, list]:
    return content, reasoning, list(tool_calls)


def summary(parsed: dict) -> tuple[str, str, list]:
    return parsed["content"], parsed["reasoning_content"], calls(parsed)


# --- well-formed output: the official strict reading ---------------------------------------------------

WEATHER = block(
    invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "2")),
    invoke("get_weather", ("city", "true", "Tokyo"), ("options", "false", '{"unit": "C", "alerts": true}')),
)
STRICT = [
    ("chat", "Hello!" + EOS, False, message("Hello!")),
    ("thinking", "Let me see.</think>4" + EOS, True, message("4", "Let me see.")),
    ("empty reasoning", "</think>4" + EOS, True, message("4")),
    (
        "example 3 turn",
        "Call the tool twice.</think>" + WEATHER + EOS,
        True,
        message(
            "",
            "Call the tool twice.",
            [
                ("get_weather", '{"city": "Paris", "days": 2}'),
                ("get_weather", '{"city": "Tokyo", "options": {"unit": "C", "alerts": true}}'),
            ],
        ),
    ),
    (
        "content kept unstripped",
        " a \n" + block(invoke("f")) + EOS,
        False,
        message(" a \n", "", [("f", "{}")]),
    ),
    (
        "only two newlines consumed",
        "a\n" + block(invoke("f")) + EOS,
        False,
        message("a\n", "", [("f", "{}")]),
    ),
    (
        "string values JSON-escaped",
        block(invoke("f", ("s", "true", 'say "hi"\n\\ é <b>'))) + EOS,
        False,
        message("", "", [("f", '{"s": "say \\"hi\\"\\n\\\\ é <b>"}')]),
    ),
    (
        "other values raw",
        block(invoke("f", ("n", "false", "1.50"), ("o", "false", '{"a":[1,2]}'))) + EOS,
        False,
        message("", "", [("f", '{"n": 1.50, "o": {"a":[1,2]}}')]),
    ),
    (
        "no validation of raw values",
        block(invoke("f", ("v", "false", "{oops"))) + EOS,
        False,
        message("", "", [("f", '{"v": {oops}')]),
    ),
    (
        "think tags are data in values",
        block(invoke("f", ("s", "true", "a</think>b<think>"))) + EOS,
        False,
        message("", "", [("f", '{"s": "a</think>b<think>"}')]),
    ),
    (
        "quote in a parameter name",
        block(invoke("f", ('a"b', "true", "v"))) + EOS,
        False,
        message("", "", [("f", '{"a\\"b": "v"}')]),
    ),
    ("no EOS", "Hello!", False, message("Hello!")),
]


@pytest.mark.parametrize(
    ("text", "thinking", "expected"), [c[1:] for c in STRICT], ids=[c[0] for c in STRICT]
)
def test_well_formed_output(text, thinking, expected):
    assert summary(parse_output(text, thinking=thinking)) == expected


def test_tool_call_shape_and_unique_ids():
    parsed = parse_output(WEATHER + EOS)
    ids = [c["id"] for c in parsed["tool_calls"]]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2
    assert all(c["type"] == "function" and set(c) == {"id", "type", "function"} for c in parsed["tool_calls"])
    assert [json.loads(c["function"]["arguments"]) for c in parsed["tool_calls"]] == [
        {"city": "Paris", "days": 2},
        {"city": "Tokyo", "options": {"unit": "C", "alerts": True}},
    ]
    assert set(parsed) == {"content", "reasoning_content", "tool_calls"}


# --- §4 tolerant fallbacks ------------------------------------------------------------------------------

PARIS = invoke("get_weather", ("city", "true", "Paris"))
FALLBACKS = [
    # Truncated output: markup never leaks into content; a call cut inside its body keeps what was generated.
    ("truncated content", "Hello wor", False, message("Hello wor")),
    ("truncated reasoning", "I am thin", True, message("", "I am thin")),
    ("no </think> before EOS", "only thoughts" + EOS, True, message("", "only thoughts")),
    ("cut in the separator", "Hi\n\n<｜DSML｜ ca", False, message("Hi")),
    ("cut in the opener", "Hi\n\n" + OPEN + "\n<｜DSML｜ inv", False, message("Hi")),
    ("cut in the invoke name", "Hi\n\n" + OPEN + '\n<｜DSML｜ invoke name="get_wea', False, message("Hi")),
    (
        "cut in a parameter name",
        "\n\n" + OPEN + '\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="ci',
        False,
        message("", "", [("f", "")]),
    ),
    (
        "cut in a string value",
        "\n\n" + OPEN + '\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="c" string="true">Par',
        False,
        message("", "", [("f", '{"c": "Par')]),
    ),
    (
        "held text flushed at the end",
        "\n\n" + OPEN + '\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="c" string="true">echo 2 <',
        False,
        message("", "", [("f", '{"c": "echo 2 <')]),
    ),
    (
        "cut in a close tag",
        "\n\n" + OPEN + '\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="c" string="true">'
        "x</｜DSML｜ param",
        False,
        message("", "", [("f", '{"c": "x')]),
    ),
    (
        "cut after one call",
        block(PARIS)[: -len(CLOSE) - 1] + '\n<｜DSML｜ invoke name="g',
        False,
        message("", "", [("get_weather", '{"city": "Paris"}')]),
    ),
    ("content ending in <", "x <", False, message("x <")),
    ("content ending in newlines", "x\n\n", False, message("x\n\n")),
    # A tool block opened inside <think> ends the reasoning.
    (
        "block inside think",
        "I should call it." + block(PARIS) + EOS,
        True,
        message("", "I should call it.", [("get_weather", '{"city": "Paris"}')]),
    ),
    # Stray markers are absorbed.
    ("stray </think> in content", "</think>Answer</think>." + EOS, False, message("Answer.")),
    ("duplicate <think> in reasoning", "<think>r</think>a", True, message("a", "r")),
    (
        "repeated block closer",
        block(PARIS) + CLOSE + EOS,
        False,
        message("", "", [("get_weather", '{"city": "Paris"}')]),
    ),
    ("empty block", "a" + block() + EOS, False, message("a")),
    ("stray closers", "a</｜DSML｜ invoke>b</｜DSML｜ parameter>c", False, message("abc")),
    ("BOS and EOS", "<｜begin▁of▁sentence｜>a" + EOS + "b", False, message("ab")),
    # Only the full spaced marker starts a block.
    ("bare DSML token", "see <｜DSML｜ here", False, message("see <｜DSML｜ here")),
    ("V4 spelling stays text", "a<｜DSML｜tool_calls>", False, message("a<｜DSML｜tool_calls>")),
    # No text is lost.
    (
        "text after the block",
        "a" + block(PARIS) + "\nb",
        False,
        message("a\nb", "", [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        "text between invokes",
        f"\n\n{OPEN}\nNow:\n{PARIS}\n{CLOSE}",
        False,
        message("Now:", "", [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        "JSON-object invoke body",
        f'\n\n{OPEN}\n<｜DSML｜ invoke name="f">{{"a": 1}}</｜DSML｜ invoke>\n{CLOSE}',
        False,
        message("", "", [("f", '{"a": 1}')]),
    ),
    (
        "missing invoke closer",
        f'\n\n{OPEN}\n<｜DSML｜ invoke name="f">\n<｜DSML｜ invoke name="g">\n{CLOSE}',
        False,
        message("", "", [("f", "{}"), ("g", "{}")]),
    ),
    (
        "duplicate parameter names",
        block(invoke("f", ("a", "false", "1"), ("a", "false", "2"))),
        False,
        message("", "", [("f", '{"a": 1, "a": 2}')]),
    ),
]


@pytest.mark.parametrize(
    ("text", "thinking", "expected"), [c[1:] for c in FALLBACKS], ids=[c[0] for c in FALLBACKS]
)
def test_fallbacks(text, thinking, expected):
    assert summary(parse_output(text, thinking=thinking)) == expected


@pytest.mark.parametrize(
    ("text", "completed"),
    [
        (block(PARIS, PARIS) + EOS, 2),
        (block(PARIS)[:-20], 0),
        ("no calls", 0),
    ],
)
def test_completed_tool_calls_tells_truncation_apart(text, completed):
    parser = StreamingParser()
    parser.feed(text)
    parser.finish()
    assert parser.completed_tool_calls == completed


def test_parser_is_single_use():
    parser = StreamingParser()
    parser.finish()
    with pytest.raises(RuntimeError, match="one StreamingParser per completion"):
        parser.feed("x")
    with pytest.raises(RuntimeError, match="finish\\(\\) called twice"):
        parser.finish()
