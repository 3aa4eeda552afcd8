"""The V4.1 DSML tool-call grammar against CHAT_FORMAT.md's goldens, run through xgrammar's GrammarMatcher over the
token ids of the bundled tokenizer (checkpoints/v41-tiny, where ``｜DSML｜`` is one token): every golden tool-call
render is accepted, mutated ones (unspaced tags, V4 / V3.2 tags, a missing close tag, a wrong ``string`` flag, an
unknown tool, a missing required parameter, a value outside its schema) are rejected, and random walks through the
grammar always parse (our parser) into calls whose arguments are valid under the tool's schema (an independent
schema check)."""

import json
import random
from pathlib import Path

import pytest
from chat.test_encoding import EXAMPLE_3, WEATHER_TOOL
from optional_deps import require
from schema_oracle import errors

from deepseek_v41.chat import EOS, parse_output
from deepseek_v41.chat.dsml import render_tool_calls
from deepseek_v41.structured import dsml_grammar
from deepseek_v41.structured.dsml_grammar import (
    ToolGrammarError,
    choice_format,
    json_format,
    regex_format,
    structural_tag,
    tool_call_tag,
)

TOKENIZER = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny" / "tokenizer.json"
DSML_ID, EOS_ID = 8182, 1

# The assistant turn of CHAT_FORMAT.md §7 example 3 (thinking, two parallel calls), exactly as generated.
EXAMPLE_3_TURN = EXAMPLE_3.split("Weather in Paris and Tokyo?<｜Assistant｜><think>", 1)[1].split("<｜User｜>", 1)[0]


def tool(name, properties=None, required=(), **extra):
    parameters = {"type": "object", "properties": properties or {}, "required": list(required), **extra}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


F = tool("f", {"city": {"type": "string"}, "days": {"type": "integer"}})
F_ANY = tool("f", {"v": {}})
S = tool("f", {"s": {"type": "string"}}, ["s"])
A = tool("f", {"a": {"type": "integer"}})
G = tool("g")
OPTIONS = {"unit": {"enum": ["C", "F"]}, "alerts": {"type": "boolean"}}
PLAN = tool("plan", {
    "mode": {"enum": ["fast", "slow"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 9},
    "dry_run": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    "options": {"type": "object", "properties": OPTIONS, "required": ["unit"], "additionalProperties": False},
}, ["mode", "count"], additionalProperties=False)
PING = tool("ping", {"host": {"enum": ["x", "y"]}}, ["host"], additionalProperties=False)


@pytest.fixture(scope="module")
def xgr():
    return require("xgrammar")


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER))


@pytest.fixture(scope="module")
def compiler(xgr, tokenizer):
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = [""] * size  # "" is a special token to xgrammar (never produced by a grammar)
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        vocab[i] = token
    for i, added in tokenizer.get_added_tokens_decoder().items():
        if added.special:
            vocab[i] = ""
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=size, stop_token_ids=[EOS_ID])
    return xgr.GrammarCompiler(info, cache_enabled=False)


@pytest.fixture(scope="module")
def accepts(xgr, compiler, tokenizer):
    """accepts(tag, text): the compiled tag takes the token ids of ``text`` and is then terminated."""

    def run(tag: str, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(tag))
        return all(matcher.accept_token(i) for i in tokenizer.encode(text, add_special_tokens=False).ids) and \
            matcher.is_terminated()

    return run


def calls(*pairs, content=""):
    return content + render_tool_calls(pairs) + EOS


GOLDENS = [  # (tools, thinking, completion text, calls made)
    ([WEATHER_TOOL], True, EXAMPLE_3_TURN, 2),
    ([F], False, calls(("f", {"city": "Paris", "days": 2})), 1),
    ([F], False, calls(("f", {"city": "Paris", "days": 2}), content="Let me check."), 1),
    ([G], False, calls(("g", {})), 1),
    ([A, G], False, calls(("f", {"a": 1}), ("g", {})), 2),
    ([S], False, calls(("f", {"s": 'a < b && c > "d"\nline 2 \\n é'})), 1),
    *[([F_ANY], False, calls(("f", {"v": value})), 1)
      for value in (True, None, 3, 2.5, {"a": 1}, [1, 2], {"k": "é"}, [], "text")],
]


@pytest.mark.parametrize(("tools", "thinking", "text", "made"), GOLDENS)
def test_goldens_are_accepted(accepts, tokenizer, tools, thinking, text, made):
    assert DSML_ID in tokenizer.encode(text, add_special_tokens=False).ids  # the DSML tag is its own token
    assert accepts(tool_call_tag(tools, "auto", thinking=thinking), text)
    content = text.split("\n\n<｜DSML｜ calls>")[0].split("</think>")[-1]
    assert accepts(tool_call_tag(tools, "required", thinking=thinking), text) is (content == "")
    name = parse_output(text, thinking)["tool_calls"][0]["function"]["name"]
    assert accepts(tool_call_tag(tools, "named", name, thinking=thinking), text) is (content == "" and made == 1)


MUTATIONS = {
    "unspaced invoke": ("<｜DSML｜ invoke", "<｜DSML｜invoke"),
    "unspaced parameter": ("<｜DSML｜ parameter", "<｜DSML｜parameter"),
    "V4 tool_calls tag": ("｜DSML｜ calls>", "｜DSML｜tool_calls>"),
    "V3.2 function_calls tag": ("｜DSML｜ calls>", "｜DSML｜function_calls>"),
    "missing invoke close": ("</｜DSML｜ invoke>\n</｜DSML｜ calls>", "</｜DSML｜ calls>"),
    "missing calls close": ("</｜DSML｜ calls>", ""),
    "non-JSON value with string=false": ('"city" string="true">Paris', '"city" string="false">Paris'),
    "JSON-only value with string=true": ('"days" string="false">2', '"days" string="true">2'),
    "value outside the schema": ('"days" string="false">2', '"days" string="false">"two"'),
    "unknown tool": ('name="get_weather"', 'name="get_time"'),
    "unknown parameter": ('name="days"', 'name="weeks"'),
    "missing required parameter": ('<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n', ""),
    "text after the block": ("</｜DSML｜ calls>", "</｜DSML｜ calls>Done."),
    "no separator line": ('">\n<｜DSML｜ parameter name="city"', '"><｜DSML｜ parameter name="city"'),
    "block inside the reasoning": ("</think>", ""),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_mutated_goldens_are_rejected(accepts, mutation, choice):
    old, new = MUTATIONS[mutation]
    assert old in EXAMPLE_3_TURN
    tag = tool_call_tag([WEATHER_TOOL], choice, thinking=True)
    assert accepts(tag, EXAMPLE_3_TURN)
    assert not accepts(tag, EXAMPLE_3_TURN.replace(old, new, 1))


def test_json_strings_cannot_hold_the_close_tag(accepts):
    """The parser ends a string="false" value at the first close tag, so a JSON string holding one would parse into
    broken arguments: the grammar refuses it (a raw string="true" value simply ends there, as the parser reads it)."""
    text = calls(("f", {"v": ["a</｜DSML｜ parameter>b"]}))
    assert not accepts(tool_call_tag([F_ANY], "required"), text)
    assert accepts(tool_call_tag([F_ANY], "required"), calls(("f", {"v": ["a</b>"]})))


def test_named_choice_takes_only_that_tool(accepts):
    text = calls(("ping", {"host": "x"}))
    assert accepts(tool_call_tag([PLAN, PING], "named", "ping"), text)
    assert not accepts(tool_call_tag([PLAN, PING], "named", "plan"), text)
    assert not accepts(tool_call_tag([PLAN, PING], "named", "ping"), calls(("ping", {"host": "x"}), ("ping", {})))


def test_parallel_false_allows_one_call(accepts):
    two = calls(("ping", {"host": "x"}), ("ping", {"host": "y"}))
    assert accepts(tool_call_tag([PING], "required"), two)
    assert not accepts(tool_call_tag([PING], "required", parallel=False), two)
    assert accepts(tool_call_tag([PING], "required", parallel=False), calls(("ping", {"host": "x"})))


def test_auto_leaves_text_alone(accepts):
    tag = tool_call_tag([PING], "auto")
    assert accepts(tag, "Just text, 2 < 3 and a|b." + EOS)
    assert accepts(tag, EOS)
    assert not accepts(tag, "text</think>" + EOS)
    thinking = tool_call_tag([PING], "auto", thinking=True)
    assert accepts(thinking, "Reason.</think>Answer in text." + EOS)
    assert not accepts(thinking, "Reason without an end" + EOS)


def test_required_and_named_need_a_call(accepts):
    for tag in (tool_call_tag([PING], "required"), tool_call_tag([PING], "named", "ping")):
        assert not accepts(tag, "No call." + EOS)
        assert not accepts(tag, EOS)


def test_bad_tools_name_the_field():
    with pytest.raises(ToolGrammarError) as info:
        tool_call_tag([PING, {"type": "function", "function": {"parameters": {}}}], "required")
    assert info.value.param == "tools[1].function.name"
    with pytest.raises(ToolGrammarError) as info:
        tool_call_tag([PING, PING], "auto")
    assert info.value.param == "tools[1].function.name"
    with pytest.raises(ToolGrammarError) as info:
        tool_call_tag([tool("f", {"a": {}}, ["b"])], "required")
    assert info.value.param == "tools[0].function.parameters.required"
    with pytest.raises(ToolGrammarError) as info:
        tool_call_tag([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "auto")
    assert info.value.param == "tools[0].function.parameters"
    with pytest.raises(ToolGrammarError) as info:
        tool_call_tag([PING], "named", "nope")
    assert info.value.param == "tool_choice.function.name"


def allowed_ids(xgr, matcher, vocab_size):
    import numpy as np

    mask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask)
    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()


def walk(xgr, compiler, tokenizer, tag, rng, limit=400):
    """A random path through the grammar (uniform over the allowed tokens): the decoded text, or None past
    ``limit`` tokens."""
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(tag))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = []
    for _ in range(limit):
        token = rng.choice(allowed_ids(xgr, matcher, size))
        assert matcher.accept_token(token)
        ids.append(token)
        if matcher.is_terminated():
            return tokenizer.decode(ids, skip_special_tokens=False)
    return None


@pytest.mark.parametrize(("choice", "name"), [("required", None), ("named", "plan")])
def test_random_walks_parse_into_schema_valid_calls(xgr, compiler, tokenizer, choice, name):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (PLAN, PING)}
    tag = tool_call_tag([PLAN, PING], choice, name)
    rng = random.Random(0)
    finished = 0
    for _ in range(12):
        text = walk(xgr, compiler, tokenizer, tag, rng)
        if text is None:
            continue
        finished += 1
        message = parse_output(text)
        assert message["content"] == "" and message["tool_calls"], text
        for call in message["tool_calls"]:
            function = call["function"]
            assert name in (None, function["name"])
            arguments = json.loads(function["arguments"])
            assert errors(arguments, schemas[function["name"]]) == [], text
    assert finished >= 6


def test_json_after_the_reasoning(accepts):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    thinking = structural_tag(json_format(schema), thinking=True)
    assert accepts(thinking, 'Think it over.</think>{"ok": true}' + EOS)
    assert not accepts(thinking, '{"ok": true}' + EOS)
    assert not accepts(thinking, 'Think.</think>{"ok": 1}' + EOS)
    assert accepts(structural_tag(json_format(schema)), '{"ok": false}' + EOS)
    assert accepts(structural_tag(json_format(None), thinking=True), '</think>{"any": [1]}' + EOS)
    assert not accepts(structural_tag(json_format(None)), "[1]" + EOS)
    assert accepts(structural_tag(choice_format(["yes", "no"]), thinking=True), "Hm.</think>no" + EOS)
    assert accepts(structural_tag(regex_format("[0-9]+"), thinking=True), "</think>42" + EOS)
    assert not accepts(structural_tag(regex_format("[0-9]+"), thinking=True), "</think>4a" + EOS)


def test_additional_properties(accepts):
    """Other parameter names only where additionalProperties allows them: absent means false next to declared
    properties and true without any (xgrammar's reading of an object schema)."""
    free = tool("f")
    free["function"]["parameters"].pop("properties")
    extra = calls(("f", {"anything": "x", "n": 2}))
    assert accepts(tool_call_tag([free], "required"), extra)
    assert accepts(tool_call_tag([free], "required"), calls(("f", {})))
    assert not accepts(tool_call_tag([PING], "required"), calls(("ping", {"host": "x", "n": 2})))
    typed = tool("f", {"a": {"type": "integer"}}, additionalProperties={"type": "integer"})
    assert accepts(tool_call_tag([typed], "required"), calls(("f", {"a": 1, "b": 2})))
    assert accepts(tool_call_tag([typed], "required"), calls(("f", {"b": 2})))
    assert not accepts(tool_call_tag([typed], "required"), calls(("f", {"a": 1, "b": "x"})))


def test_string_length_bounds_are_dropped_inside_tags_so_values_stay_json():
    """xgrammar 0.2.9 compiles a bounded JSON string inside a structural tag into a rule that admits raw control
    characters; the tool grammar drops minLength / maxLength at every depth (a property named like a keyword
    stays)."""
    schema = {"type": "object", "properties": {"maxLength": {"type": "string", "maxLength": 3},
                                               "tags": {"type": "array", "items": {"type": "string", "minLength": 1}},
                                               "alt": {"anyOf": [{"type": "string", "maxLength": 2},
                                                                 {"type": "null"}]}},
              "required": ["maxLength"]}
    out = dsml_grammar.without_string_lengths(schema)
    assert out == {"type": "object", "properties": {"maxLength": {"type": "string"},
                                                    "tags": {"type": "array", "items": {"type": "string"}},
                                                    "alt": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
                   "required": ["maxLength"]}
    assert schema["properties"]["maxLength"] == {"type": "string", "maxLength": 3}  # the request's schema is kept
    fmt = json.loads(dsml_grammar.structural_tag(dsml_grammar.json_format(schema)))["format"]
    assert "maxLength" not in json.dumps(fmt["json_schema"]["properties"]["tags"])
