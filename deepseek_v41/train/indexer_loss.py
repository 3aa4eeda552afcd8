"""What trains the lightning indexer, and how well it selects (MODEL_REFERENCE.md §3.9; issue 5).

The LM loss gives top-k selection no gradient, so the indexer learns from a KL loss alone, as DeepSeek trained
V3.2's lightning indexer: the main attention's probabilities of the selected entries (summed over heads,
renormalised, no gradient) are the target of the indexer's softmax over the same entries (:func:`indexer_kl`).
During the dense warm-up every visible entry is selected; the recall probe (:func:`indexer_recall`) then measures
which share of the dense attention mass the indexer's own selection would keep.

The model hands these pieces over through its context: a forward whose ``ctx.indexer_losses`` is an
:class:`IndexerLosses` makes every index-source layer call :meth:`IndexerLosses.add` with its attention's entry
probabilities and its indexer's scores of the same entries (:meth:`deepseek_v41.model.attention.Attention.forward`).
"""

from __future__ import annotations

import torch

from deepseek_v41.model.indexer import pool_entries, topk_entries


def indexer_kl(entry_probs: torch.Tensor, indexer_scores: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """KL(main attention || indexer) over the selected entries, averaged over queries with any entry.

    entry_probs [B, T, H, k]: the main attention's probabilities of the selected entries (summed over heads and
    renormalised into the target, no gradient); indexer_scores [B, T, k]: the indexer's scores of the same entries
    (softmax = the indexer's distribution); topk [B, T, k] (-1 = no entry). As DeepSeek trained V3.2's lightning
    indexer: the LM loss gives top-k selection no gradient, so the indexer learns from this KL alone.
    """
    valid = topk >= 0
    target = entry_probs.detach().sum(2).masked_fill(~valid, 0.0)
    total = target.sum(-1, keepdim=True)
    target = target / total.clamp_min(torch.finfo(target.dtype).tiny)
    log_q = torch.log_softmax(indexer_scores.masked_fill(~valid, float("-inf")), dim=-1)
    terms = torch.where(valid & (target > 0), target * (torch.log(target.clamp_min(1e-30)) - log_q), 0.0)
    rows = valid.any(-1) & (total[..., 0] > 0)
    kl = terms.sum(-1)
    return (kl * rows).sum() / rows.sum().clamp_min(1)


def indexer_recall(entry_probs: torch.Tensor, selection: torch.Tensor, visible: torch.Tensor) -> tuple[float, ...]:
    """Share of the dense attention mass over compressed entries that falls on the indexer's selection, summed
    over queries that see more entries than they select, with the share a random selection of the same size
    would get, and the number of such queries: ``(recall_sum, random_sum, queries)``.

    entry_probs [B, T, H, N] (dense attention over every entry); selection [B, T, k] (-1 = none); visible
    [B, T, N] (entry n in column n, -1 = not visible).
    """
    mass = entry_probs.detach().sum(2)
    total = mass.sum(-1)
    picked = (mass.gather(-1, selection.clamp(min=0)) * (selection >= 0)).sum(-1)
    n_visible = (visible >= 0).sum(-1)
    n_selected = (selection >= 0).sum(-1)
    rows = (n_visible > n_selected) & (total > 0)
    recall = (picked / total.clamp_min(1e-30))[rows]
    random = (n_selected / n_visible.clamp(min=1))[rows]
    return float(recall.sum()), float(random.sum()), int(rows.sum())


def inference_selection(attn, ctx, scores: torch.Tensor) -> torch.Tensor:
    """The entries [B, T, k] (-1 = none) that layer ``attn`` would select outside the dense warm-up, from its
    indexer's scores of every entry [B, T, N] (-inf where not visible): its top ``min(index_topk, N)``, inside
    the candidate pool of its candidate source (recorded in ``ctx.shared``) when that pool restricts anything."""
    spec, N = attn.spec, scores.shape[-1]
    block, keep = attn.candidate_block_size, attn.candidate_topk_blocks
    if spec.candidate_source is not None and keep * block < N:
        ids, valid = pool_entries(ctx.shared[("pool", spec.candidate_source)], block, keep, N)
        inside = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, valid)
        scores = scores.masked_fill(~inside, float("-inf"))
    return topk_entries(scores, min(attn.index_topk, N))


class IndexerLosses:
    """``ctx.indexer_losses`` of a training forward: each index-source layer's :func:`indexer_kl` in
    :attr:`losses` (tensors with gradient toward the indexer); with ``recall=True``, in the dense warm-up, also
    ``(layer, recall_sum, random_sum, queries)`` of :func:`indexer_recall` per layer in :attr:`recall`."""

    def __init__(self, recall: bool = False):
        self.losses: list[torch.Tensor] = []
        self.recall: list[tuple[int, float, float, int]] | None = [] if recall else None

    def add(self, attn, ctx, entry_probs: torch.Tensor, scores: torch.Tensor, topk: torch.Tensor) -> None:
        """Called by index-source layer ``attn`` (an :class:`~deepseek_v41.model.attention.Attention`) with its
        attention's probabilities of the selected entries [B, T, H, k], its indexer's scores of them [B, T, k] and
        the selection ``topk`` [B, T, k] (-1 = none; in the dense warm-up k = N, entry n in column n)."""
        self.losses.append(indexer_kl(entry_probs, scores, topk))
        if self.recall is not None and ctx.dense_indexer:
            selection = inference_selection(attn, ctx, scores.detach())
            self.recall.append((attn.spec.layer_id, *indexer_recall(entry_probs, selection, topk)))

    def total(self, like: torch.Tensor) -> torch.Tensor:
        """The sum of :attr:`losses` (zero, as ``like``'s dtype and device, when no layer added one)."""
        return torch.stack(self.losses).sum() if self.losses else like.new_zeros(())
