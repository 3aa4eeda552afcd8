"""StreamingParser (CHAT_FORMAT.md §5): any split of a completion gives parse_output, and no markup leaks."""

from hypothesis import given, settings
from hypothesis import strategies as st

from deepseek_v41.chat import StreamingParser, merge_deltas, parse_output

EOS = "<｜end▁of▁sentence｜>"
OPEN, CLOSE = "<｜DSML｜ calls>", "</｜DSML｜ calls>"


def param(name: str, value: str, string: bool = True) -> str:
    flag = "true" if string else "false"
    return f'<｜DSML｜ parameter name="{name}" string="{flag}">{value}</｜DSML｜ parameter>'


def invoke(name: str, *params: str) -> str:
    return f'<｜DSML｜ invoke name="{name}">\n' + "\n".join(params) + "\n</｜DSML｜ invoke>"


def block(*invokes: str) -> str:
    return f"\n\n{OPEN}\n" + "\n".join(invokes) + f"\n{CLOSE}"


NESTED = param("options", '{"unit": "C", "alerts": [true, null, {"deep": "x\\"y"}]}', string=False)
SEARCH = invoke(
    "search", param("query", 'multi\nline "quoted" \\ text é 🙂'), param("limit", "10", string=False)
)
# (completion, thinking). In these every "<" and "｜" belongs to markup, so no delta may show one.
CLEAN = [
    ("Plain answer with\n\nparagraphs and trailing newlines\n\n" + EOS, False),
    ("Plain answer, no EOS, ends in newline\n", False),
    ("Reasoning\n\nover lines.</think>The answer is 4." + EOS, True),
    ("Think.</think>Checking." + block(invoke("get_weather", param("city", "Paris"), NESTED)) + EOS, True),
    (
        "Two calls." + block(SEARCH, invoke("noop"), invoke("get_weather", param("city", "Tokyo"))) + EOS,
        False,
    ),
    ("Straight into a call" + block(SEARCH) + EOS, True),
    ("</think>" + block(invoke("f", param("a", "1", string=False))) + EOS, True),
    ("Truncated in a parameter tag" + block(SEARCH)[:60], False),
    ("Truncated in the value" + block(SEARCH)[: block(SEARCH).index("multi") + 8], False),
    ("Truncated in a close tag" + block(SEARCH)[: block(SEARCH).index("</｜DSML｜ parameter>") + 9], False),
    ("Truncated in the separator\n\n" + OPEN[:4], False),
    ("Truncated in the reasoning", True),
    ("Stray</think> closer and" + EOS + " text after EOS", False),
    ("Repeated closer" + block(invoke("f")) + CLOSE + EOS, False),
]
# Outputs where "<" is also data: checked for equality only.
DATA = [
    ("a < b and c<d, 2 <", False),
    ("x" + block(invoke("sh", param("cmd", "ls 2>&1 | grep '</｜DSML｜ para' <in"))) + EOS, False),
    ("<think>dup</think>a</think>b<think>c", True),
    (f"a\n\n{OPEN}\nfiller\n" + invoke("f", '{"raw": 1}') + "\n" + invoke("g") + f"\n{CLOSE}\ntail", False),
]
CORPUS = CLEAN + DATA


def without_ids(message: dict) -> dict:
    calls = [{"type": c["type"], "function": c["function"]} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def stream(pieces: list[str], thinking: bool) -> list[dict]:
    parser = StreamingParser(thinking=thinking)
    deltas = [d for piece in pieces for d in parser.feed(piece)]
    return deltas + parser.finish()


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def assert_well_shaped(deltas: list[dict]) -> None:
    """OpenAI delta shapes: one non-empty field; a call announced once with id/type/name, then arguments."""
    announced: set[int] = set()
    for delta in deltas:
        assert len(delta) == 1
        if "tool_calls" not in delta:
            assert next(iter(delta.values()))
            continue
        (call,) = delta["tool_calls"]
        if call["index"] in announced:
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
        else:
            assert call["index"] == len(announced) and {"id", "type", "function"} <= set(call)
            assert set(call["function"]) == {"name", "arguments"}
            announced.add(call["index"])


def assert_no_markup(deltas: list[dict]) -> None:
    for delta in deltas:
        for text in (delta.get("content", ""), delta.get("reasoning_content", "")):
            assert "<" not in text and "｜" not in text, delta
        for call in delta.get("tool_calls", ()):
            assert "｜" not in call["function"]["arguments"], delta


def test_one_piece_is_parse_output():
    for text, thinking in CORPUS:
        assert without_ids(merge_deltas(stream([text], thinking))) == without_ids(
            parse_output(text, thinking)
        )


def test_every_single_cut_and_every_character():
    # Markers cut at every position, and a delta per character (many markers spread over many deltas).
    for text, thinking in CORPUS:
        expected = without_ids(parse_output(text, thinking))
        for cut in range(1, len(text)):
            deltas = stream([text[:cut], text[cut:]], thinking)
            assert without_ids(merge_deltas(deltas)) == expected, cut
            assert_well_shaped(deltas)
        deltas = stream(list(text), thinking)
        assert without_ids(merge_deltas(deltas)) == expected
        if (text, thinking) in CLEAN:
            assert_no_markup(deltas)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CORPUS), data=st.data())
def test_random_splits_equal_parse_output(case, data):
    text, thinking = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    deltas = stream(split(text, cuts), thinking)
    assert without_ids(merge_deltas(deltas)) == without_ids(parse_output(text, thinking))
    assert_well_shaped(deltas)
    if case in CLEAN:
        assert_no_markup(deltas)


# Random text built from markers, their prefixes and the characters they are made of.
_MARKUP = [
    "<think>",
    "</think>",
    OPEN,
    CLOSE,
    '<｜DSML｜ invoke name="',
    '">',
    "</｜DSML｜ invoke>",
    '<｜DSML｜ parameter name="',
    '" string="true">',
    '" string="false">',
    "</｜DSML｜ parameter>",
    EOS,
    "<｜begin▁of▁sentence｜>",
]
_ATOMS = (
    st.sampled_from(_MARKUP)
    | st.sampled_from(_MARKUP).flatmap(lambda m: st.integers(1, len(m) - 1).map(lambda k: m[:k]))
    | st.sampled_from(["\n", "\n\n", "<", "｜", '"', ">", "a", "é", " ", "{", "\\", "x y"])
)


@settings(max_examples=300, deadline=None)
@given(atoms=st.lists(_ATOMS, max_size=30), thinking=st.booleans(), data=st.data())
def test_fuzzed_markup_is_split_invariant(atoms, thinking, data):
    text = "".join(atoms)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    deltas = stream(split(text, cuts), thinking)
    assert without_ids(merge_deltas(deltas)) == without_ids(parse_output(text, thinking))
    assert_well_shaped(deltas)


def test_arguments_stream_before_the_value_ends():
    # §5 rule 3: string values are streamed as they come, not buffered to the close tag.
    parser = StreamingParser()
    head = parser.feed(
        f'\n\n{OPEN}\n<｜DSML｜ invoke name="write">\n<｜DSML｜ parameter name="text" string="true">'
    )
    assert head[0]["tool_calls"][0]["function"] == {"name": "write", "arguments": '{"text": "'}
    assert parser.feed('line "1"\n') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'line \\"1\\"\\n'}}]}
    ]
    assert parser.feed("a <") == [{"tool_calls": [{"index": 0, "function": {"arguments": "a "}}]}]
    assert parser.feed("/｜DSML｜ parameter>") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]}
    ]


def test_separator_newlines_are_held_until_settled():
    parser = StreamingParser()
    assert parser.feed("Sure.\n") == [{"content": "Sure."}]
    assert parser.feed("\n") == []
    assert parser.feed("More") == [{"content": "\n\nMore"}]
    assert parser.feed("\n\n<｜DSML｜") == []
    assert parser.feed(" calls>\n") == []
    assert parser.finish() == []


def test_thinking_deltas_go_to_reasoning_content():
    parser = StreamingParser(thinking=True)
    assert parser.feed("Hmm</thi") == [{"reasoning_content": "Hmm"}]
    assert parser.feed("nk>Yes") == [{"content": "Yes"}]
