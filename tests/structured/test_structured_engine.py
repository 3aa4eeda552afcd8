"""Constrained decoding in the engine, on the bundled checkpoint (which was never taught JSON: every valid output
is the mask's doing). Each kind at temperature 1 over several seeds, a batch mixing constrained and free
requests, DSpark (greedy output identical with and without speculation), llguidance's fallback, refused input.

Oracles: json.loads plus a small schema validator (json_schema_oracle.py), Python's ``re.fullmatch`` for the regex
and the grammar (the grammar's language written as a regex), membership for choices, and the engine's own output
for the free requests run alone (the sampler is batch invariant) and for non-speculative decoding."""

import json
import logging
import re

import pytest
from schema_oracle import errors

from deepseek_v41.engine import SamplingParams, StructuredOutputsParams

PROMPT = "The configuration of the engine is"
SEEDS = range(4)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z][a-z ]{0,11}$"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["cache", "draft", "page"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "count", "ok"],
    "additionalProperties": False,
}


def constrained(seed: int | None = None, temperature: float = 1.0, max_tokens: int = 160, **kind) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kind))


def texts(llm, params: list[SamplingParams], prompt: str = PROMPT) -> list[str]:
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for o in outs:  # the grammar ended every output (EOS after a complete value), never max_tokens
        assert o.outputs[0].finish_reason == "stop", (o.outputs[0].finish_reason, o.outputs[0].text)
    return [o.outputs[0].text for o in outs]


# ---------------------------------------------------------------------------------------------- each kind
def test_json_schema_outputs_parse_and_validate(llm):
    for text in texts(llm, [constrained(s, json=SCHEMA) for s in SEEDS]):
        assert errors(json.loads(text), SCHEMA) == [], text


def test_json_schema_given_as_text(llm):
    # Bounded values: an unbounded "number" lets the bundled model write digits until max_tokens.
    schema = {"type": "object", "properties": {"v": {"type": "integer", "minimum": -50, "maximum": 50},
                                               "unit": {"enum": ["ms", "s"]}}, "required": ["v", "unit"]}
    for text in texts(llm, [constrained(s, json=json.dumps(schema)) for s in SEEDS]):
        assert errors(json.loads(text), schema) == [], text


def test_json_object_outputs_are_objects(llm):
    """Any object: its keys and strings are unbounded, and the bundled model sometimes writes one until
    max_tokens (finish_reason "length", as vLLM); every output the grammar ended is an object."""
    outs = llm.generate([PROMPT] * 8, [constrained(s, max_tokens=64, json_object=True) for s in range(8)],
                        use_tqdm=False)
    done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(done) >= 4
    assert all(isinstance(json.loads(text), dict) for text in done), done
    assert all(o.outputs[0].text.startswith("{") for o in outs)


def test_regex_outputs_match(llm):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{2})?"
    for text in texts(llm, [constrained(s, regex=pattern) for s in SEEDS]):
        assert re.fullmatch(pattern, text), text


def test_choice_outputs_are_one_of_the_choices(llm):
    choices = ["Paris", "London", 'a "quoted" one', "back\\slash", "new\nline", "日本"]
    outs = texts(llm, [constrained(s, choice=choices) for s in range(8)])
    assert all(text in choices for text in outs), outs


def test_ebnf_grammar_outputs_are_in_its_language(llm):
    grammar = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-z]{1,3} | [0-9]{1,3}'
    language = r"\((?:[a-z]{1,3}|[0-9]{1,3})(?:,(?:[a-z]{1,3}|[0-9]{1,3})){0,3}\)"
    for text in texts(llm, [constrained(s, grammar=grammar) for s in SEEDS]):
        assert re.fullmatch(language, text), text


def test_structural_tag_text_then_json(llm):
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        # A structural tag's JSON allows free whitespace unless bounded (max_whitespace_cnt)
        {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1}]}}
    for text in texts(llm, [constrained(s, structural_tag=json.dumps(tag)) for s in SEEDS]):
        assert text.startswith("Answer: "), text
        assert errors(json.loads(text[len("Answer: "):]), SCHEMA) == [], text


def test_greedy_and_n_samples(llm):
    out = llm.generate(PROMPT, SamplingParams(n=3, seed=7, max_tokens=160, temperature=1.0,
                                              structured_outputs=StructuredOutputsParams(json=SCHEMA)),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert errors(json.loads(c.text), SCHEMA) == [], c.text
    (greedy,) = texts(llm, [constrained(temperature=0, json=SCHEMA)])
    assert errors(json.loads(greedy), SCHEMA) == [], greedy


def test_grammar_end_stops_even_with_ignore_eos(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=100, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert out.token_ids[-1] == llm.engine.config.eos_token_id  # the grammar's stop token ended it


def test_llguidance_fallback_outputs_satisfy_the_constraint(llm):
    """Constraints auto sends to llguidance: a length bound beside a pattern (xgrammar would drop it) and a regex
    with a Unicode class (xgrammar refuses it)."""
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2,
                                                        "maxLength": 5}},
              "required": ["code"], "additionalProperties": False}
    manager = llm.engine.structured_output_manager
    assert manager.compile(StructuredOutputsParams(json=schema)).backend == "guidance"
    for text in texts(llm, [constrained(s, json=schema) for s in SEEDS]):
        assert errors(json.loads(text), schema) == [], text
    regex = r"\p{Lu}[a-z]{2,6}"
    assert manager.compile(StructuredOutputsParams(regex=regex)).backend == "guidance"
    for text in texts(llm, [constrained(s, regex=regex) for s in SEEDS]):
        assert text[:1].isupper() and re.fullmatch("[a-z]{2,6}", text[1:]), text


# ---------------------------------------------------------------------------------------------- batches
def test_batch_mixing_constrained_and_free_requests(llm):
    free = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(3)]
    alone = llm.generate([PROMPT] * 3, free, use_tqdm=False)
    cons = [constrained(s, json=SCHEMA) for s in SEEDS]
    mixed = llm.generate([PROMPT] * 7, [free[0], cons[0], cons[1], free[1], cons[2], free[2], cons[3]],
                         use_tqdm=False)
    # The free requests' tokens do not depend on their batch: identical to running them alone.
    assert [mixed[i].outputs[0].token_ids for i in (0, 3, 5)] == [o.outputs[0].token_ids for o in alone]
    for i in (1, 2, 4, 6):
        assert errors(json.loads(mixed[i].outputs[0].text), SCHEMA) == [], mixed[i].outputs[0].text


def test_a_preempted_constrained_request_resumes_in_its_grammar(llm):
    """Preemption recomputes the prompt and the output so far; the matcher keeps its state (no token is fed
    twice, none skipped), so the output still validates."""
    engine = llm.engine
    engine.add_request("pre", llm.tokenizer.encode(PROMPT).ids, constrained(5, json=SCHEMA))
    seq = engine.requests["pre"][0]
    preempted = False
    while engine.has_unfinished_requests():
        if not preempted and len(seq.output_token_ids) >= 6:
            engine.scheduler.preempt(seq)
            preempted = True
        engine.step()
    out = engine.request_output("pre").outputs[0]
    engine.release("pre")
    assert preempted and out.finish_reason == "stop"
    assert errors(json.loads(out.text), SCHEMA) == [], out.text


# ---------------------------------------------------------------------------------------------- DSpark
def test_speculative_greedy_output_equals_plain(llm, spec_llm):
    kinds = [dict(json=SCHEMA), dict(regex=r"[a-z]{3,6}( [a-z]{3,6}){2,4}\."), dict(json_object=True)]
    params = [constrained(temperature=0, max_tokens=200, **k) for k in kinds]
    plain = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    before = spec_llm.stats["spec_decode_num_drafts"]
    spec = spec_llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert spec_llm.stats["spec_decode_num_drafts"] > before  # it did speculate
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].finish_reason for o in spec] == ["stop"] * 3


def test_speculative_sampling_outputs_are_valid(spec_llm):
    free = SamplingParams(temperature=1.0, seed=1, max_tokens=24)
    outs = spec_llm.generate([PROMPT] * 5, [free] + [constrained(s, json=SCHEMA) for s in SEEDS], use_tqdm=False)
    for o in outs[1:]:
        assert o.outputs[0].finish_reason == "stop"
        assert errors(json.loads(o.outputs[0].text), SCHEMA) == [], o.outputs[0].text


# ---------------------------------------------------------------------------------------------- refused input
@pytest.mark.parametrize("kind", [dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
                                  dict(regex="[unclosed"), dict(grammar="root ::= undefined_rule"),
                                  dict(structural_tag='{"type": "structural_tag"}')])
def test_a_bad_constraint_is_refused_with_nothing_queued(llm, kind):
    engine = llm.engine
    prompt = llm.tokenizer.encode(PROMPT).ids
    with pytest.raises(ValueError, match=r"structured_outputs\.\w+ is not a valid constraint"):
        engine.add_request("bad", prompt, constrained(0, **kind))
    assert "bad" not in engine.requests and not engine.has_unfinished_requests()
    # The engine still serves: the same id with a good constraint runs.
    engine.add_request("bad", prompt, constrained(0, json=SCHEMA))
    while engine.has_unfinished_requests():
        engine.step()
    assert errors(json.loads(engine.request_output("bad").outputs[0].text), SCHEMA) == []
    engine.release("bad")


def test_an_engine_without_tokenizer_refuses_structured_outputs(grammar_engines):
    from deepseek_v41.config import tiny_config
    from deepseek_v41.engine import LLM
    from deepseek_v41.model.transformer import Transformer

    llm = LLM(Transformer(tiny_config()), dtype="float32", max_model_len=64, max_num_seqs=1)
    with pytest.raises(ValueError, match="structured_outputs needs the model's tokenizer"):
        llm.generate({"prompt_token_ids": [5, 6]}, constrained(0, regex="a"), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_min_tokens_past_the_grammar_end_stops_without_crashing(llm, caplog):
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=20, min_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["ok"]))
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.engine.engine"):
        out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("ok") and out.finish_reason == "stop"
    assert "outside its structured output's grammar" in caplog.text


def test_structured_outputs_config_is_checked_at_engine_start(llm):
    from deepseek_v41.config import tiny_config
    from deepseek_v41.engine import LLM
    from deepseek_v41.model.transformer import Transformer

    with pytest.raises(ValueError, match=r"structured_outputs_config has unknown keys \['bogus'\]"):
        LLM(Transformer(tiny_config()), dtype="float32", max_model_len=64, structured_outputs_config={"bogus": 1})
    with pytest.raises(ValueError, match="structured_outputs_config backend must be one of"):
        LLM(Transformer(tiny_config()), dtype="float32", max_model_len=64,
            structured_outputs_config={"backend": "outlines"})
    assert llm.engine.structured_output_manager.config.disable_any_whitespace  # the default here
