"""``LLM.chat(tools=..., tool_choice=...)`` on the bundled checkpoint (never taught DSML: every call is the grammar's
doing), mapped as ``/v1/chat/completions`` maps it: "required" and a named function -> a parsed call whose
arguments are valid under the tool's schema; "auto" -> free text with the tools rendered; "none" -> the tools not
rendered and no calls. Oracles: json.loads and tests/schema_oracle.py for the arguments, the encoder for the
prompts, an unconstrained run for "none"."""

import json
from pathlib import Path

import pytest
from schema_oracle import errors

from deepseek_v41.chat import encode_messages
from deepseek_v41.engine import SamplingParams, StructuredOutputsParams

PING = {"type": "function", "function": {
    "name": "ping", "description": "Ping a host.",
    "parameters": {"type": "object", "properties": {"host": {"enum": ["alpha", "beta"]},
                                                    "count": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["host"], "additionalProperties": False}}}
MODE = {"type": "function", "function": {
    "name": "set_mode", "description": "Set the mode.",
    "parameters": {"type": "object", "properties": {"mode": {"enum": ["fast", "safe"]}}, "required": ["mode"],
                   "additionalProperties": False}}}
TOOLS = [PING, MODE]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Ping the alpha host."}]
BUDGET = 400  # the bundled model spells DSML tags byte by byte: a call takes ~170-300 tokens


@pytest.fixture(scope="module")
def llm(grammar_engines):
    """The bundled checkpoint with room for the ~420-token tools prompt and a call."""
    from deepseek_v41.engine import LLM

    return LLM(Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny", dtype="float32", max_model_len=1024,
               max_num_seqs=8)


def _calls(output) -> list[dict]:
    completion = output.outputs[0]
    assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
    calls = completion.message.get("tool_calls", [])
    for call in calls:
        name = call["function"]["name"]
        assert errors(json.loads(call["function"]["arguments"]), SCHEMAS[name]) == [], call
    return calls


def test_required_and_named_give_schema_valid_calls(llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=BUDGET) for s in range(3)]
    outs = llm.chat([MESSAGES] * 3, params, tools=TOOLS, tool_choice="required", use_tqdm=False)
    for out in outs:
        assert out.prompt == encode_messages(MESSAGES, tools=TOOLS)
        calls = _calls(out)
        assert calls and all(c["function"]["name"] in SCHEMAS for c in calls)
        assert out.outputs[0].message["content"] is None  # nothing before the block
    named = {"type": "function", "function": {"name": "set_mode"}}
    for out in llm.chat([MESSAGES] * 3, params, tools=TOOLS, tool_choice=named, use_tqdm=False):
        assert [c["function"]["name"] for c in _calls(out)] == ["set_mode"]


def test_required_in_thinking_mode_keeps_the_reasoning_apart(llm):
    out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24), tools=TOOLS, tool_choice="required",
                   thinking=True, use_tqdm=False)[0]
    assert out.prompt == encode_messages(MESSAGES, tools=TOOLS, thinking=True)
    message = out.outputs[0].message
    assert "reasoning_content" in message  # the bundled model never closes </think>: all of it is reasoning
    assert message["reasoning_content"] and "tool_calls" not in message


def test_auto_answers_in_text_with_the_tools_rendered(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    out = llm.chat(MESSAGES, greedy, tools=TOOLS, use_tqdm=False)[0]  # None = "auto" with tools
    assert out.prompt == encode_messages(MESSAGES, tools=TOOLS)
    message = out.outputs[0].message
    assert message["content"] and "tool_calls" not in message
    # Free text is the model's own: the same as the prompt generated without any constraint.
    free = llm.generate(out.prompt, greedy, use_tqdm=False, add_special_tokens=False)[0].outputs[0]
    assert out.outputs[0].token_ids == free.token_ids


def test_none_renders_no_tools_and_returns_no_calls(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    out = llm.chat(MESSAGES, greedy, tools=TOOLS, tool_choice="none", use_tqdm=False)[0]
    plain = llm.chat(MESSAGES, greedy, use_tqdm=False)[0]
    assert out.prompt == plain.prompt == encode_messages(MESSAGES)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.outputs[0].message == {"role": "assistant", "content": plain.outputs[0].message["content"]}


def test_an_explicit_constraint_wins_over_auto_and_conflicts_with_required(llm):
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes"]))
    out = llm.chat(MESSAGES, params, tools=TOOLS, tool_choice="auto", use_tqdm=False)[0]
    assert out.outputs[0].text == "yes"
    with pytest.raises(ValueError, match="tool_choice 'required' constrains the answer to a tool call"):
        llm.chat(MESSAGES, params, tools=TOOLS, tool_choice="required")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice must be 'auto', 'none', 'required' or a named function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     r"tool_choice names 'nope', which is not in tools \['ping', 'set_mode'\]"),
    ({"tools": TOOLS, "tool_choice": {"function": "ping"}}, "a named tool_choice is"),
    ({"tools": [PING, PING], "tool_choice": "required"}, "two tools are named 'ping'"),
    ({"tools": TOOLS, "tool_choice": "required", "continue_final_message": True,
      "add_generation_prompt": False}, "continue_final_message does not start"),
])
def test_bad_tool_choices_are_refused_naming_what_is_allowed(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(MESSAGES, SamplingParams(max_tokens=4), use_tqdm=False, **kwargs)
