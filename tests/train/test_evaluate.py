"""``dsv41 eval`` on a tiny random model with a tiny trained tokenizer. Oracles: a loop of exact forwards over each
scored token's own prefix (exact mode), the engine's CED prefill of each prefix (ced mode), and unigram
arithmetic with collections.Counter."""

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deepseek_v41 import load_model
from deepseek_v41.cli import app
from deepseek_v41.config import tiny_config
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine.model_runner import PrefillMode
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.train.data import write_documents
from deepseek_v41.train.evaluate import evaluate, read_texts, stream_nats, unigram_nats, window_spans
from deepseek_v41.train.tokenizer import load_tokenizer, save_tokenizer, tokenizer_config_values, train_tokenizer

TRAIN = ["The quick brown fox jumps over the lazy dog. " * 3, "def add(a, b):\n    return a + b\n" * 3,
         "To be, or not to be, that is the question. " * 3] * 3
HELDOUT = ["The lazy dog sleeps; the quick fox runs.", "def sub(a, b):\n    return a - b", "Not to be."]
CONTEXT = 24  # > the tiny config's sliding window (16): CED's decoder rows really start late


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny tensors: the intra-op thread pool costs more than it saves (up to 100x on small CPU machines).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    save_tokenizer(train_tokenizer(TRAIN, vocab_size=400, show_progress=False), root)
    cfg = tiny_config().replace(**tokenizer_config_values(root))
    torch.manual_seed(0)
    Transformer(cfg).save_pretrained(root)
    write_documents(root / "heldout.txt", HELDOUT)
    write_documents(root / "train.txt", TRAIN)
    return root


def oracle_stream(tok, texts):
    out = []
    for text in texts:
        out += [0, *tok.encode(text, add_special_tokens=False).ids, 1]
    return out


def oracle_unigram_nats(tok, counted_on, targets):
    counts = Counter(oracle_stream(tok, counted_on))
    total, vocab = sum(counts.values()), tok.get_vocab_size()
    return -sum(math.log((counts[t] + 1) / (total + vocab)) for t in targets)


def test_windows_score_every_token_but_the_first_once():
    for n in range(2, 40):
        for context in (1, 3, 7, 16, 64):
            spans = window_spans(n, context)
            scored = [t for s, e in spans for t in range(s + 1, e + 1)]
            assert scored == list(range(1, n))
            assert all(0 < e - s <= context for s, e in spans)
    with pytest.raises(ValueError, match="context"):
        window_spans(10, 0)


def test_unigram_nats_arithmetic():
    counts = np.array([3, 0, 1])
    assert unigram_nats(counts, np.array([0, 1, 2, 0])) == pytest.approx(
        -(2 * math.log(4 / 7) + math.log(1 / 7) + math.log(2 / 7)))


def test_exact_eval_against_a_prefix_loop_and_counter_unigram(model_dir):
    result = CliRunner().invoke(app, ["eval", "--model", str(model_dir), "--data", str(model_dir / "heldout.txt"),
                                      "--json", "--context", str(CONTEXT)])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    stream = oracle_stream(tok, HELDOUT)
    nats = 0.0
    with torch.no_grad():
        for i in range(1, len(stream)):
            start = (i - 1) // CONTEXT * CONTEXT  # the window whose inputs end just before token i
            logits = model(torch.tensor([stream[start:i]]))[0, -1].double()
            nats -= torch.log_softmax(logits, -1)[stream[i]].item()
    n_bytes = sum(len(t.encode("utf-8")) for t in HELDOUT)
    uni = oracle_unigram_nats(tok, HELDOUT, stream[1:])
    assert got["tokens"] == len(stream) - 1 and got["bytes"] == n_bytes and got["documents"] == 3
    assert got["nats"] == pytest.approx(nats, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(nats / (len(stream) - 1)), rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    assert got["unigram_bits_per_byte"] == pytest.approx(uni / math.log(2) / n_bytes, rel=1e-12)
    assert got["unigram_counted_on"] == "evaluated file" and got["prefill_mode"] == "exact"


def test_train_file_sets_the_unigram_counts(model_dir):
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    got = evaluate(model, tok, HELDOUT, CONTEXT, train_texts=read_texts(model_dir / "train.txt"))
    uni = oracle_unigram_nats(tok, TRAIN, oracle_stream(tok, HELDOUT)[1:])
    assert got["unigram_nats"] == pytest.approx(uni, rel=1e-12)
    assert got["unigram_counted_on"] == "train file"


def test_ced_eval_matches_the_engines_ced_prefill_of_each_prefix(model_dir):
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    stream = np.array(oracle_stream(tok, HELDOUT[:2]))
    ours = stream_nats(model, stream, CONTEXT, PrefillMode.CED)
    llm = LLM(model, prefill_mode="ced", max_model_len=64)
    vocab = model.config.vocab_size
    ref = []
    for start, end in window_spans(len(stream), CONTEXT):
        for t in range(start, end):
            out = llm.generate({"prompt_token_ids": stream[start:t + 1].tolist()},
                               SamplingParams(temperature=0, max_tokens=1, logprobs=vocab))
            ref.append(-out[0].outputs[0].logprobs[0][int(stream[t + 1])].logprob)
    assert len(ref) == len(ours) > CONTEXT
    np.testing.assert_allclose(ours, ref, atol=1e-4)  # the engine reports fp32 logprobs
    exact = stream_nats(model, stream, CONTEXT, PrefillMode.EXACT)
    assert np.abs(exact - ours).max() > 1e-3  # CED really differs once the decoder starts late


def test_errors_are_clear(model_dir, tmp_path):
    model = load_model(model_dir)
    with pytest.raises(ValueError, match="vocabulary"):
        stream_nats(model, np.array([0, model.config.vocab_size]), 8)
    no_ced = Transformer(tiny_config().replace(num_hidden_layers=7, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 0],
                                                dspark_target_layer_ids=[4, 5, 6]))
    with pytest.raises(ValueError, match="CED layout"):
        stream_nats(no_ced, np.array([0, 5, 6]), 8, PrefillMode.CED)
    for args, message in ((["--prefill-mode", "fast"], "prefill mode"), (["--context", "0"], "context")):
        result = CliRunner().invoke(app, ["eval", "--model", str(model_dir), "--data",
                                          str(model_dir / "heldout.txt"), *args])
        assert result.exit_code == 2 and message in result.output
    default = CliRunner().invoke(app, ["eval", "--model", str(model_dir), "--data", str(model_dir / "heldout.txt")])
    assert default.exit_code == 0 and "perplexity" in default.stdout  # context 1024 = the tiny max positions
    plain = tmp_path / "plain.txt"
    plain.write_text("just some text, no separators", encoding="utf-8")
    assert read_texts(plain) == ["just some text, no separators"]


def test_progress_hears_every_window_with_increasing_counts(model_dir):
    model = load_model(model_dir)
    stream = np.arange(60) % 50
    calls = []
    stream_nats(model, stream, 16, progress=lambda done, total, what="": calls.append((done, total, what)))
    assert calls == [(0, 59, "exact window 1"), (16, 59, "exact window 2"), (32, 59, "exact window 3"),
                     (48, 59, "exact window 4"), (59, 59, "")]


def test_eval_without_a_terminal_logs_progress_to_stderr_and_keeps_stdout_json(model_dir):
    result = CliRunner().invoke(app, ["eval", "--model", str(model_dir), "--data", str(model_dir / "heldout.txt"),
                                      "--json", "--context", "8"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["context"] == 8
    lines = result.stderr.splitlines()
    assert lines[0] == "dsv41 eval: started" and lines[-1].startswith("dsv41 eval: done, ")
    assert "tokens (100%)" in lines[-1]
