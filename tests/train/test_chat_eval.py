"""``dsv41 eval-chat`` (deepseek_v41/train/chat_eval.py): the overlap metrics on hand-checked values, the tool-call
scoring on hand-written messages, and the evaluation end to end on four hand-written records
(tests/train/data/chat_heldout.jsonl) with the bundled checkpoint, which was never chat-tuned: its constrained
calls must still all be valid, and a wrong reference must score right-function 0."""

import json
import math
from pathlib import Path

import pytest
from optional_deps import require
from typer.testing import CliRunner

from deepseek_v41.chat import encode_messages
from deepseek_v41.cli import app
from deepseek_v41.engine import SamplingParams
from deepseek_v41.train import chat_eval
from deepseek_v41.train.chat_eval import (
    ChatEvalError,
    ConstrainedCallError,
    card_tables,
    check_constrained,
    evaluate_chat,
    lcs_length,
    read_records,
    rouge_l_f1,
    score_call,
    summarize,
    token_f1,
    words,
)

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "checkpoints" / "v41-tiny"
HELDOUT = Path(__file__).parent / "data" / "chat_heldout.jsonl"
BUDGET = 240  # max_tokens: the bundled model spells the constrained call's DSML byte by byte in ~180 tokens


# ---------------------------------------------------------------------------------------------- metrics
def test_words_are_lowercase_word_runs():
    assert words("Hello, World! it's re-used x_1") == ["hello", "world", "it", "s", "re", "used", "x_1"]


def test_token_f1_hand_checked():
    # pred 3 words, ref 6, shared 3: P 1, R 1/2 -> F1 2/3.
    assert token_f1("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    # Multiset overlap: "the" shared once. P 1/3, R 1/2 -> F1 2/5.
    assert token_f1("the the the", "the cat") == pytest.approx(0.4)
    assert token_f1("Hello, World!", "hello world") == 1.0
    assert token_f1("a b c d", "a c b d") == 1.0  # a bag of words: order does not count
    assert token_f1("x y", "a b") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("", "a") == 0.0 and token_f1("a", "...") == 0.0


def test_rouge_l_hand_checked():
    # Lin (2004), section 3.1: reference "police killed the gunman"; LCS 3 of 4 and 2 of 4.
    assert rouge_l_f1("police kill the gunman", "police killed the gunman") == pytest.approx(0.75)
    assert rouge_l_f1("the gunman kill police", "police killed the gunman") == pytest.approx(0.5)
    # Order counts: LCS of "a b c d" / "a c b d" is 3 -> P = R = 3/4.
    assert rouge_l_f1("a b c d", "a c b d") == pytest.approx(0.75)
    # pred 2 words, ref 5, LCS 2: P 1, R 2/5 -> F1 4/7.
    assert rouge_l_f1("cat mat", "the cat on the mat") == pytest.approx(4 / 7)
    assert rouge_l_f1("x y", "a b") == 0.0 and rouge_l_f1("", "") == 1.0 and rouge_l_f1("", "a") == 0.0
    assert lcs_length(list("abcbdab"), list("bdcaba")) == 4  # CLRS's example


# ---------------------------------------------------------------------------------------------- scoring calls
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}}}]
REFERENCE = {"name": "f", "arguments": {"n": 3}}


def _message(*calls: tuple[str, str]) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_x", "type": "function", "function": {"name": n, "arguments": a}}
                           for n, a in calls]}


@pytest.mark.parametrize(("message", "finish", "expected", "why"), [
    (_message(("f", '{"n": 3}')), "stop", (True, True, True, True), ""),
    (_message(("f", '{"n": 4}')), "stop", (True, True, True, False), ""),
    (_message(("g", '{"n": 3}')), "stop", (True, False, False, False), "calls 'g', not one of the tools"),
    (_message(("f", '{"n": 3')), "stop", (True, False, True, False), "are not a JSON object"),
    (_message(("f", '{"n": 12}')), "stop", (True, False, True, False), "break its schema: $.n: 12 > maximum 9"),
    (_message(("f", '{"n": "3"}')), "stop", (True, False, True, False), "break its schema"),
    (_message(("f", '{"n": 3}'), ("g", "{}")), "stop", (True, False, True, True), "calls 'g'"),
    (_message(("f", '{"n": 3')), "length", (True, False, True, False), "cut at max_tokens"),
    ({"role": "assistant", "content": "no"}, "stop", (False, False, False, False), "no tool call"),
])
def test_score_call(message, finish, expected, why):
    score = score_call(message, finish, TOOLS, REFERENCE)
    assert (score["called"], score["valid"], score["right_function"], score["exact_arguments"]) == expected
    assert why in score["why"] and bool(score["why"]) == bool(why)
    assert score["cut"] == (finish == "length")


def test_read_records_checks_each_line(tmp_path):
    records = read_records(HELDOUT)
    assert [r["kind"] for r in records] == ["qa", "tool", "tool_result", "no_tool"]
    assert len(read_records(HELDOUT, limit=2)) == 2
    bad = dict(records[1], reference={"answer": "x"})
    for line, match in [(dict(records[0], kind="chat"), "kind 'chat' is not one of"),
                        (bad, "a tool record's reference is"),
                        (dict(records[0], messages=records[0]["messages"][:1]), "the assistant target"),
                        ({"id": "x"}, "missing")]:
        path = tmp_path / "h.jsonl"
        path.write_text(json.dumps(records[0]) + "\n" + json.dumps(line) + "\n")
        with pytest.raises(ChatEvalError, match=f"h.jsonl:2: .*{match}"):
            read_records(path)
    path.write_text(json.dumps(records[0]) + "\n" + json.dumps(records[0]) + "\n")
    with pytest.raises(ChatEvalError, match="appears twice"):
        read_records(path)


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def llm():
    require("xgrammar")
    from deepseek_v41.engine import LLM

    return LLM(BUNDLED, dtype="float32", max_model_len=1024, max_num_seqs=4)


@pytest.fixture(scope="module")
def report(llm):
    return evaluate_chat(llm, read_records(HELDOUT), max_tokens=BUDGET, batch_size=4)


def test_the_evaluation_runs_end_to_end(report):
    assert report["counts"] == {"qa": 1, "tool": 1, "tool_result": 1, "no_tool": 1}
    assert report["skipped_too_long"] == 0 and report["max_tokens"] == BUDGET
    for kind in ("qa", "tool_result", "no_tool"):
        answer = report["answers"][kind]
        assert answer["n"] == 1 and 0.0 <= answer["rouge_l_f1"] <= 1.0 and 0.0 <= answer["token_f1"] <= 1.0
    by_id = {r["id"]: r for r in report["records"]}
    qa = by_id["qa/textwrap.dedent"]["auto"]
    assert qa["rouge_l_f1"] == rouge_l_f1(qa["content"], "Remove any common leading whitespace from every line in "
                                                         "text.")
    assert set(by_id["tool/logging.disable/0"]) >= {"auto", "free", "required"}  # measured three ways
    assert "required" not in by_id["no_tool/textwrap.dedent"]
    assert report["no_tool"]["n"] == 1


def test_constrained_calls_are_all_valid(report):
    required = report["tool_calls"]["required"]
    # The schema admits one value: the grammar fixes the call entirely, so all three rates are 1.
    assert required == {"n": 1, "called": 1.0, "valid": 1.0, "right_function": 1.0, "exact_arguments": 1.0,
                        "cut": 0.0}
    call = next(r for r in report["records"] if r["kind"] == "tool")["required"]["tool_calls"][0]["function"]
    assert call["name"] == "logging_disable" and json.loads(call["arguments"]) == {"level": "CRITICAL"}


def test_a_wrong_reference_scores_right_function_zero(llm):
    record = read_records(HELDOUT)[1]
    record["reference"] = {"name": "textwrap_dedent", "arguments": {"level": "CRITICAL"}}
    report = evaluate_chat(llm, [record], max_tokens=BUDGET)
    assert report["tool_calls"]["required"]["valid"] == 1.0
    assert report["tool_calls"]["required"]["right_function"] == 0.0
    assert report["tool_calls"]["required"]["exact_arguments"] == 0.0


def test_an_invalid_constrained_answer_that_ended_raises(report):
    broken = json.loads(json.dumps(report))
    entry = next(r for r in broken["records"] if r["kind"] == "tool")["required"]
    entry.update(valid=False, why="arguments of 'logging_disable' break its schema")
    with pytest.raises(ConstrainedCallError, match="tool/logging.disable/0"):
        check_constrained(broken)
    entry.update(cut=True)  # a cut answer is counted apart, not a broken guarantee
    check_constrained(broken)


def test_card_tables_compare_checkpoints(report):
    other = json.loads(json.dumps(report))
    other["answers"]["qa"]["rouge_l_f1"] = None  # as written to JSON when a kind is absent
    table = card_tables({"v41-tiny": report, "v41-tiny-chat": other})
    assert "| v41-tiny | required (constrained) | 1 | 1.00 | 1.00 | 1.00 | 0.00 |" in table
    assert "| v41-tiny-chat | qa | 1 | - |" in table
    assert f"at most {BUDGET} tokens per answer" in table


def test_cli_writes_the_report_and_the_table(tmp_path):
    require("xgrammar")
    out = tmp_path / "plain.json"
    result = CliRunner().invoke(app, ["eval-chat", "--model", str(BUNDLED), "--data", str(HELDOUT), "--limit", "1",
                                      "--max-tokens", "8", "--out", str(out), "--threads", "1"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["limit"] == 1 and report["counts"]["qa"] == 1 and report["max_tokens"] == 8
    assert report["tool_calls"]["auto"]["valid"] is None  # no tool record: null in JSON, not NaN
    table = CliRunner().invoke(app, ["eval-chat-table", f"plain={out}"])
    assert table.exit_code == 0 and "| plain | qa | 1 |" in table.output
    missing = CliRunner().invoke(app, ["eval-chat", "--model", str(BUNDLED), "--data", str(tmp_path / "no.jsonl")])
    assert missing.exit_code == 2 and "error:" in missing.output


def test_nan_means_no_records_of_that_kind(report):
    assert not math.isnan(report["no_tool"]["answered_in_text"])
    empty = summarize([])
    assert math.isnan(empty["tool_calls"]["auto"]["valid"]) and empty["counts"]["tool"] == 0


def test_the_free_mode_renders_the_tools_and_applies_no_grammar(llm, monkeypatch):
    """FREE: the model alone. The prompt holds the tools as "auto" renders them; no structured output is set."""
    record = next(r for r in read_records(HELDOUT) if r["kind"] == "tool")
    seen = []
    original = llm.generate

    def spy(prompts, params, **kwargs):
        seen.append((prompts, params))
        return original(prompts, params, **kwargs)

    monkeypatch.setattr(llm, "generate", spy)
    out = list(chat_eval._generate(llm, [(record, chat_eval.FREE)], SamplingParams(temperature=0.0, max_tokens=8), 4))
    assert [choice for _, choice, _ in out] == [chat_eval.FREE]
    (prompts, params), = seen
    assert params.structured_outputs is None
    assert record["tools"][0]["function"]["name"] in prompts[0]
    assert prompts[0] == encode_messages(record["messages"][:-1], tools=record["tools"], thinking=record["thinking"])
    assert isinstance(out[0][2].message, dict)


@pytest.mark.parametrize("content", ['{"model": "x"}', "[1]"])
def test_eval_chat_table_refuses_what_is_not_a_report(tmp_path, content):
    path = tmp_path / "r.json"
    path.write_text(content)
    result = CliRunner().invoke(app, ["eval-chat-table", f"x={path}"])
    assert result.exit_code == 2 and "not an eval-chat report" in result.output


def test_eval_chat_table_refuses_a_name_given_twice(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(summarize([])))
    result = CliRunner().invoke(app, ["eval-chat-table", f"x={path}", f"x={path}"])
    assert result.exit_code == 2 and "given twice" in result.output


def test_the_running_line_reports_every_mode():
    call = {"called": True, "valid": True, "right_function": False, "exact_arguments": False, "cut": False}
    results = [{"id": "t", "kind": "tool", "thinking": False, chat_eval.FREE: dict(call, valid=False),
                "auto": dict(call), "required": dict(call, right_function=True)},
               {"id": "q", "kind": "qa", "thinking": False,
                "auto": {"rouge_l_f1": 0.5, "token_f1": 0.25, "tool_calls": [], "answered_in_text": True}}]
    line = chat_eval._running(results)
    assert line == ("answers n=1 ROUGE-L 0.500 token F1 0.250; tool calls free n=1 valid 0.00 right 0.00, "
                    "auto n=1 valid 1.00 right 0.00, required n=1 valid 1.00 right 1.00 cut 0.00")
