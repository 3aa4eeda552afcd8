"""``dsv41 eval``: perplexity and bits per byte of a model on a text file, next to a unigram baseline.

The text is the token stream of :func:`~deepseek_v41.train.tokenizer.encode_batches` (every document as
``BOS, tokens, EOS``). Every token but the first is scored exactly once, in windows of ``context`` input tokens:
window k reads inputs ``[k*context, (k+1)*context)`` from position 0 and scores the next token of each, so a
token is predicted from the tokens of its own window before it (at least none, at most ``context - 1``).

Prefill modes (SPEC.md §3, MODEL_REFERENCE.md §3.16):

- ``exact``: one exact forward per window (every layer over every token).
- ``ced``: the prediction after each prefix is the one a CED prefill of that prefix gives: the encoder and the
  first decoder layer's compressor over the whole prefix (one pass per window: they are causal), the decoder only
  over the last ``sliding_window`` positions with windows starting there. One decoder pass per scored token, so
  about ``sliding_window`` times the decoder cost of ``exact``.

Metrics, in nats summed in float64 over the scored tokens: ``perplexity = exp(nats / tokens)``,
``bits_per_byte = nats / ln 2 / bytes`` with ``bytes`` the UTF-8 bytes of the documents (separators and the
BOS / EOS markers not counted, their predictions are). ``unigram_bits_per_byte`` scores the same tokens with
add-one smoothed unigram frequencies ``(count + 1) / (total + vocab)`` counted over the token stream of the
``--train`` file when given, else over the evaluated file itself (an in-sample baseline, slightly optimistic).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepseek_v41.engine.model_runner import PrefillMode
from deepseek_v41.model.checkpoint import load_model
from deepseek_v41.model.context import DenseContext
from deepseek_v41.progress import ProgressCallback
from deepseek_v41.train.data import SEPARATOR, read_documents
from deepseek_v41.train.tokenizer import encode_batches, encode_documents, load_tokenizer

CED_ROWS = 64  # decoder rows (scored tokens) per CED pass: bounds memory at rows x context index scores


def read_texts(path: str | Path) -> list[str]:
    """The documents of a corpus file (ends with the separator line, see :mod:`deepseek_v41.train.data`), or the
    whole file as one document for any other UTF-8 text. Raises FileNotFoundError / UnicodeDecodeError."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    return read_documents(path) if text.endswith(SEPARATOR) else [text]


def window_spans(tokens: int, context: int) -> list[tuple[int, int]]:
    """Input spans ``[start, end)`` of the windows over a stream of ``tokens`` ids; inputs ``start .. end - 1``
    predict ids ``start + 1 .. end``, so together they score ids 1 .. tokens - 1 once each."""
    if context < 1:
        raise ValueError(f"context must be at least 1, got {context}")
    return [(s, min(s + context, tokens - 1)) for s in range(0, tokens - 1, context)]


class _DecoderRows(DenseContext):
    """Context of CED decoder rows: row r is a run of consecutive ``positions[r]`` whose window starts at its first
    position; every row reads the compressed entries and index keys ``encoder_ctx`` holds for the whole window."""

    def __init__(self, encoder_ctx: DenseContext, positions: torch.Tensor):
        super().__init__(*positions.shape, positions.device, encoder_ctx.fake_quant)
        self.positions = positions
        self.encoder_ctx = encoder_ctx

    def index_keys(self, layer: int) -> torch.Tensor:
        return self.encoder_ctx.index_keys(layer).expand(self.positions.shape[0], -1, -1)

    def gather_entries(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        rows, c, k = idx.shape
        return self.encoder_ctx.gather_entries(layer, idx.reshape(1, rows * c, k)).view(rows, c, k, -1)


@torch.no_grad()
def ced_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] (fp32, float64 for a float64 model) where row t is what a CED prefill of ``input_ids[:t+1]``
    (long [T]) gives for the next token (see the module docstring). Raises ValueError when the model's layout
    has no CED split."""
    plan = model.plan
    if not plan.ced:
        raise ValueError(f"prefill mode 'ced' needs the CED layout; this model has {plan.ced_reason}")
    T = input_ids.shape[0]
    ids = input_ids[None]
    ctx = DenseContext(1, T, ids.device, model.fake_quant)
    rows = model.hasher(ids, None) if model.hasher is not None else None
    streams, pre = model.embed_streams(ids)
    streams, pre = model.ced_encode(streams, pre, ctx, rows)
    window = model.config.sliding_window
    out = []
    # Where the decoder of a prefix starts is the plan's rule (LayerPlan.decoder_start). Prefixes whose decoder
    # starts at position 0 (at most `window` tokens) run in one causal pass over them.
    head = min(T, window)
    positions = torch.arange(head, device=ids.device)[None]
    s, p = model.ced_decode(streams[:, :head], pre[:, :head], _DecoderRows(ctx, positions))
    out.append(model.logits(s, p)[0])
    # Longer prefixes: the decoder runs over the last `window` positions only, one row per scored token.
    offsets = torch.arange(window, device=ids.device)
    for t0 in range(head, T, CED_ROWS):
        ends = range(t0, min(T, t0 + CED_ROWS))
        starts = torch.tensor([plan.decoder_start(end + 1) for end in ends], device=ids.device)
        positions = starts[:, None] + offsets  # [rows, window]
        s, p = model.ced_decode(streams[0][positions], pre[0][positions], _DecoderRows(ctx, positions))
        out.append(model.logits(s[:, -1:], p[:, -1:])[:, 0])
    return torch.cat(out)


@torch.no_grad()
def stream_nats(model, stream: np.ndarray, context: int, mode: PrefillMode = PrefillMode.EXACT,
                progress: ProgressCallback | None = None) -> np.ndarray:
    """Negative log-likelihood in nats (float64 [len(stream) - 1]) of ids 1 .. n-1 of ``stream`` (int64 [n]), in
    windows of ``context`` tokens (:func:`window_spans`). ``progress(done, total, what)`` is called with the
    tokens scored so far, before the first window and after each. Raises ValueError for ids outside the model's
    vocabulary or a CED request on a model without the CED layout."""
    vocab = model.config.vocab_size
    if stream.size and (stream.min() < 0 or stream.max() >= vocab):
        raise ValueError(f"token ids reach {int(stream.max())}, outside the model's vocabulary of {vocab}: the "
                         f"tokenizer does not belong to this model")
    device = next(model.parameters()).device
    ids = torch.from_numpy(stream).to(device)
    nats = []
    total = max(len(stream) - 1, 0)
    for k, (start, end) in enumerate(window_spans(len(stream), context)):
        if progress is not None:
            progress(start, total, f"{mode.value} window {k + 1}")
        inputs = ids[start:end]
        logits = ced_logits(model, inputs) if mode is PrefillMode.CED else model(inputs[None])[0]
        logp = torch.log_softmax(logits.double(), dim=-1)
        nats.append(-logp.gather(-1, ids[start + 1:end + 1, None])[:, 0].cpu().numpy())
    if progress is not None:
        progress(total, total)
    return np.concatenate(nats) if nats else np.zeros(0)


def unigram_nats(counts: np.ndarray, targets: np.ndarray) -> float:
    """Summed nats of ``targets`` (int [n]) under add-one smoothed unigram frequencies from ``counts``
    (int [vocab]): ``p(v) = (counts[v] + 1) / (counts.sum() + vocab)``."""
    counts = counts.astype(np.float64)
    logp = np.log(counts + 1.0) - math.log(counts.sum() + counts.size)
    return float(-logp[targets].sum())


def token_counts(tokenizer: Any, texts: list[str], vocab: int) -> np.ndarray:
    """Counts int64 [vocab] of every id in the token stream of ``texts`` (BOS and EOS included)."""
    counts = np.zeros(vocab, dtype=np.int64)
    for piece in encode_batches(tokenizer, texts):
        counts += np.bincount(piece, minlength=vocab)
    return counts


def evaluate(model, tokenizer: Any, texts: list[str], context: int, mode: PrefillMode = PrefillMode.EXACT,
             train_texts: list[str] | None = None, progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Perplexity, bits per byte and the unigram baseline of ``model`` on ``texts`` (see the module docstring).

    ``tokenizer`` is a ``tokenizers.Tokenizer``; ``train_texts`` the documents the unigram counts come from
    (None: ``texts``); ``progress`` as :func:`stream_nats` takes it. Returns a JSON-ready dict: ``perplexity``,
    ``bits_per_byte``, ``unigram_bits_per_byte``, ``nats``, ``tokens`` (scored), ``bytes``, ``documents``,
    ``context``, ``prefill_mode``, ``unigram_counted_on``.
    Raises ValueError for an empty text, a bad context or ids outside the model's vocabulary.
    """
    stream = encode_documents(tokenizer, texts)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    if len(stream) < 2 or n_bytes == 0:
        raise ValueError("the text to evaluate is empty")
    nats = stream_nats(model, stream, context, mode, progress)
    total = float(nats.sum())
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    counts = token_counts(tokenizer, texts if train_texts is None else train_texts, vocab)
    uni = unigram_nats(counts, stream[1:])
    return {
        "perplexity": math.exp(total / nats.size),
        "bits_per_byte": total / math.log(2) / n_bytes,
        "unigram_bits_per_byte": uni / math.log(2) / n_bytes,
        "nats": total,
        "unigram_nats": uni,
        "tokens": int(nats.size),
        "bytes": n_bytes,
        "documents": len(texts),
        "context": context,
        "prefill_mode": mode.value,
        "unigram_counted_on": "evaluated file" if train_texts is None else "train file",
    }


def evaluate_files(model_path: str | Path, data: str | Path, context: int | None = None,
                   mode: str | PrefillMode = PrefillMode.EXACT, train: str | Path | None = None,
                   tokenizer_path: str | Path | None = None, device: str = "cpu",
                   progress: ProgressCallback | None = None) -> dict[str, Any]:
    """``dsv41 eval``: load the model (:func:`deepseek_v41.load_model`, float32, reference fake-quant) and its
    tokenizer (``tokenizer_path``, else the model folder's), read ``data`` (and ``train``) with
    :func:`read_texts`, and :func:`evaluate` with ``context`` input tokens per window (None: 1024, at most
    ``max_position_embeddings``). Adds ``model`` and ``data`` to the result. ``progress(done, total, what)`` hears
    of the loading and tokenizing (``done`` 0) and then of every window (:func:`stream_nats`).

    Raises ValueError for an unknown mode or a context outside [1, max_position_embeddings], FileNotFoundError
    for a missing model, tokenizer or file, and what :func:`evaluate` raises.
    """
    try:
        mode = PrefillMode(mode)
    except ValueError as exc:
        raise ValueError(f"prefill mode must be one of {[m.value for m in PrefillMode]}, got {mode!r}") from exc
    if progress is not None:
        progress(0, 0, "loading the model")
    model = load_model(model_path, device=device)
    limit = model.config.max_position_embeddings
    context = min(1024, limit) if context is None else context
    if not 1 <= context <= limit:
        raise ValueError(f"context must be in [1, {limit}] (max_position_embeddings), got {context}")
    tokenizer = load_tokenizer(tokenizer_path if tokenizer_path is not None else model_path)
    if progress is not None:
        progress(0, 0, "reading and tokenizing the text")
    texts = read_texts(data)
    train_texts = read_texts(train) if train is not None else None
    result = evaluate(model, tokenizer, texts, context, mode, train_texts, progress)
    return {**result, "model": str(model_path), "data": str(data),
            **({"train": str(train)} if train is not None else {})}
