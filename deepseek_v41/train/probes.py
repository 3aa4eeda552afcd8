"""Probes of a trained model's long-range path (issue 5's model card): indexer recall and the compressed entries'
contribution to held-out loss.

- :func:`indexer_recall`: for every index-source layer, the share of the dense attention mass over compressed
  entries (attention over every visible entry, as in the indexer's warm-up) that falls on the entries the
  indexer selects at inference (its top-k, inside the candidate pool for Reindex layers), next to the share a
  random selection of the same size would get.
- :func:`long_range_nats`: held-out loss of tokens beyond the window with the compressed entries attended and
  with them masked (window attention only): the long-range path is used when the first is lower.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from deepseek_v41.model.attention import SparseAttention, sparse_attention
from deepseek_v41.model.context import DenseContext
from deepseek_v41.train.indexer_loss import IndexerLosses


def _windows(stream: np.ndarray, context: int, windows: int):
    for w in range(windows):
        ids = stream[w * context: (w + 1) * context + 1]
        if len(ids) < context + 1:
            return
        yield torch.from_numpy(ids.astype(np.int64))


@torch.no_grad()
def indexer_recall(model, stream: np.ndarray, context: int, windows: int) -> dict[int, dict[str, float]]:
    """Per index-source layer: ``recall`` and ``random`` (mean over queries that see more entries than they
    select) on ``windows`` held-out windows of ``context`` tokens."""
    totals: dict[int, list[float]] = {}
    for ids in _windows(stream, context, windows):
        inputs = ids[None, :-1]
        ctx = DenseContext(1, inputs.shape[1], inputs.device, model.fake_quant)
        ctx.indexer_losses, ctx.dense_indexer = IndexerLosses(recall=True), True
        rows = model.hasher(inputs) if model.hasher is not None else None
        streams, pre = model.embed_streams(inputs)
        model.run_layers(range(len(model.layers)), streams, pre, ctx, None, rows)
        for layer, recall, random, count in ctx.indexer_losses.recall:
            acc = totals.setdefault(layer, [0.0, 0.0, 0])
            acc[0] += recall
            acc[1] += random
            acc[2] += count
    return {layer: {"recall": r / max(n, 1), "random": q / max(n, 1), "queries": n}
            for layer, (r, q, n) in sorted(totals.items())}


@contextmanager
def window_only(model: torch.nn.Module) -> Iterator[None]:
    """Ablation: every layer's attention (its :class:`~deepseek_v41.model.attention.SparseAttention`) attends its
    window only, as if no compressed entry were selected (a forward pre-hook dropping ``topk``)."""
    signature = inspect.signature(sparse_attention)

    def drop_entries(module, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["topk"] = None
        return bound.args, bound.kwargs

    hooks = [m.register_forward_pre_hook(drop_entries, with_kwargs=True) for m in model.modules()
             if isinstance(m, SparseAttention)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def long_range_nats(model, stream: np.ndarray, context: int, windows: int) -> dict[str, float]:
    """Mean nats per token of the tokens at positions >= ``sliding_window`` of each window, with the compressed
    entries attended (``with_entries``) and masked (``window_only``)."""
    start = model.config.sliding_window
    sums = {"with_entries": 0.0, "window_only": 0.0}
    count = 0
    for ids in _windows(stream, context, windows):
        inputs, targets = ids[None, :-1], ids[1:]
        for key, drop in (("with_entries", False), ("window_only", True)):
            ctx = DenseContext(1, inputs.shape[1], inputs.device, model.fake_quant)
            rows = model.hasher(inputs) if model.hasher is not None else None
            streams, pre = model.embed_streams(inputs)
            with window_only(model) if drop else nullcontext():
                streams, pre = model.run_layers(range(len(model.layers)), streams, pre, ctx, None, rows)
            logp = torch.log_softmax(model.logits(streams, pre)[0].double(), -1)
            sums[key] -= float(logp[start:].gather(-1, targets[start:, None]).sum())
        count += len(targets) - start
    out = {k: v / max(count, 1) for k, v in sums.items()}
    out["tokens"] = count
    out["perplexity_with_entries"] = math.exp(out["with_entries"])
    out["perplexity_window_only"] = math.exp(out["window_only"])
    return out
