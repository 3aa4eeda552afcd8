"""Lightning indexer and hierarchical candidate pool (MODEL_REFERENCE.md §3.9, §3.10).

``score[t, s] = Σ_h w[t, h] ReLU(q[t, h] · k[s])`` with ``w = weights_proj(x) / sqrt(index_head_dim *
index_n_heads)``; queries and keys carry RoPE on their last ``qk_rope_head_dim`` dims and are FP4 (UE8M0 / 32)
fake-quantized. A query at position p sees entries ``0 .. floor((p + 1) / m) - 1``. The top
``min(index_topk, entries)`` visible entries are selected (-1 pads what is not visible).

The candidate source scores every visible entry, keeps per block of ``candidate_block_size`` entries the block
maximum, forces the block holding the newest visible entry, and keeps the top ``candidate_topk_blocks`` blocks:
the candidate pool. Reindex layers score only inside that pool. Scoring runs over chunks of queries so memory
stays O(chunk x entries).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepseek_v41.model.linear import Linear
from deepseek_v41.model.norm import RMSNorm, cast, upcast
from deepseek_v41.quant import fake_quant_fp4

QUERY_CHUNK = 256


class Indexer(nn.Module):
    """Indexer of an index-source layer; ``wk`` / ``k_norm`` exist only on kv sources (they make the keys)."""

    def __init__(self, dim: int, q_lora_rank: int, head_dim: int, n_heads: int, index_head_dim: int,
                 makes_keys: bool, eps: float):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = index_head_dim
        self.wq_b = Linear(q_lora_rank, n_heads * index_head_dim, bias=False)
        self.score = IndexScorer()
        self.weights_proj = Linear(dim, n_heads, bias=False)
        if makes_keys:
            self.wk = Linear(head_dim, index_head_dim, bias=False)
            self.k_norm = RMSNorm(index_head_dim, eps)

    def keys(self, latent: torch.Tensor, positions: torch.Tensor, rope: nn.Module) -> torch.Tensor:
        """Index keys [B, G, index_head_dim] from compressor latents [B, G, head_dim] (pre-RoPE, pre-quant) at
        entry positions g*m; the KV context stores them (FP4 with UE8M0 scales)."""
        return rope(self.k_norm(self.wk(latent)), positions)

    def queries(self, q_lat: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, rope: nn.Module,
                fake_quant: bool, rope_cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [B, T, Hi, di] and head weights [B, T, Hi], fp32 (float64 for a float64 model) of q_lat [B, T,
        q_lora_rank] and x [B, T, dim]; ``rope_cache`` as in :meth:`~deepseek_v41.model.rope.RotaryEmbedding.phases`.
        """
        B, T, _ = q_lat.shape
        q = rope(self.wq_b(q_lat).view(B, T, self.n_heads, self.head_dim), positions, cache=rope_cache)
        if fake_quant:
            q = fake_quant_fp4(q, 32, "ue8m0")
        w = upcast(self.weights_proj(x)) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return upcast(q), w

    # The selection rules, as methods so that a backend may compute them per instance (the same indices).
    def select_entries(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, k: int,
                       pool: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The picks of queries q [B, c, Hi, di] with head weights w [B, c, Hi] over every index key keys [B, N,
        di], given each query's visible count ``visible`` [B, c]: :func:`topk_entries` [B, c, k] of the
        :func:`mask_invisible` scores, and with ``pool`` = (block, keep) the :func:`candidate_blocks` mask [B, c,
        nblocks] of those scores (None without). A method so that a backend may fuse the scoring and the rules
        (issue 25: the same indices, without the [B, c, N] scores)."""
        scores = mask_invisible(self.score(q, w, keys), torch.arange(keys.shape[1], device=keys.device), visible)
        blocks = None if pool is None else self.candidate_blocks(scores, visible, *pool)
        return self.topk_entries(scores, k), blocks

    def topk_entries(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """:func:`topk_entries`."""
        return topk_entries(scores, k)

    def candidate_blocks(self, scores: torch.Tensor, visible: torch.Tensor, block: int, keep: int) -> torch.Tensor:
        """:func:`candidate_blocks`."""
        return candidate_blocks(scores, visible, block, keep)

    def pool_entries(self, blocks: torch.Tensor, block: int, keep: int,
                     n_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`pool_entries`."""
        return pool_entries(blocks, block, keep, n_entries)


class IndexScorer(nn.Module):
    """``score[t, s] = Σ_h w[t, h] ReLU(q[t, h] · k[s])`` (no parameters; a module so that FLOPs accounting can
    tell the FP4 indexer matmuls apart).

    q [B, c, Hi, di], w [B, c, Hi], keys [B, N, di] (shared by the queries) or [B, c, n, di] (each query its own,
    e.g. its candidate pool) -> scores [B, c, N or n] in q's dtype.
    """

    def forward(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        B, c, H, _ = q.shape
        keys = cast(keys, q.dtype)
        if keys.dim() == 3:  # one key set for every query: a single [c * H, di] x [di, N] product per row
            dots = (q.flatten(1, 2) @ keys.transpose(1, 2)).unflatten(1, (c, H))
        else:
            dots = q @ keys.transpose(-1, -2)
        return (cast(w, dots.dtype)[:, :, None, :] @ dots.relu_()).squeeze(2)


def mask_invisible(scores: torch.Tensor, entries: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """-inf where the entry id (``entries`` [N] or [B, c, n]) is not below the query's visible count [B, c]."""
    if entries.dim() == 1:
        entries = entries[None, None, :]
    return scores.masked_fill(entries >= visible[..., None], float("-inf"))


def topk_set(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the ``k`` largest ``scores`` [..., N], in ascending index order; ties at the k-th place
    go to the lowest indices.

    FP4-quantized queries and keys and the ReLU make exact ties common; ``torch.topk`` breaks them differently for
    different tensor sizes, which would make a sequence's picks depend on its batch, its chunking or the total
    length. This selection depends only on the scores. ``k = 0`` gives [..., 0]; ValueError for k outside
    [0, N].
    """
    if not 0 <= k <= scores.shape[-1]:
        raise ValueError(f"k must be in [0, {scores.shape[-1]}] (the number of scores), got {k}")
    if k == 0:
        return torch.empty((*scores.shape[:-1], 0), dtype=torch.long, device=scores.device)
    values, picked = torch.topk(scores, k, dim=-1)
    if scores.device.type == "meta" or scores.numel() < 1 << 16:  # small (decode): the plain rule is cheaper
        return _ties_to_lowest(scores, k, values[..., -1:])
    # A row whose k-th value has no equal outside the top k has one possible set: torch.topk's, sorted. Only
    # rows with a tie across the cut (typically fewer than k visible entries: a run of -inf) need the exact rule.
    threshold = values[..., -1:]
    ambiguous = (scores == threshold).sum(-1) > (values == threshold).sum(-1)
    picked = picked.sort(dim=-1).values
    if bool(ambiguous.any()):
        rows = ambiguous.nonzero(as_tuple=True)
        picked[rows] = _ties_to_lowest(scores[rows], k, threshold[rows])
    return picked


def _ties_to_lowest(scores: torch.Tensor, k: int, threshold: torch.Tensor) -> torch.Tensor:
    """:func:`topk_set` by its definition: every score above the k-th value ``threshold`` [..., 1], then the
    lowest-index scores equal to it; ascending indices [..., k]."""
    n = scores.shape[-1]
    greater = scores > threshold
    tied = scores == threshold
    chosen = greater | (tied & (tied.cumsum(-1) <= k - greater.sum(-1, keepdim=True)))
    key = torch.where(chosen, n - torch.arange(n, device=scores.device), 0)
    return torch.topk(key, k, dim=-1).indices


def topk_entries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The best ``k`` entries per query [B, c, k] long (ascending index); -1 where the pick is not visible."""
    idx = topk_set(scores, k)
    return idx.masked_fill(scores.gather(-1, idx) == float("-inf"), -1)


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, block: int, keep: int) -> torch.Tensor:
    """Candidate pool of each query as a block mask [B, c, nblocks] bool (MODEL_REFERENCE.md §3.10) from its scores
    [B, c, N] (-inf where not visible) and visible counts [B, c]."""
    B, c, N = scores.shape
    nblocks = -(-N // block)
    padded = torch.nn.functional.pad(scores, (0, nblocks * block - N), value=float("-inf"))
    block_scores = padded.view(B, c, nblocks, block).amax(-1)
    newest = ((visible - 1) // block).clamp(min=0)
    forced = torch.arange(nblocks, device=scores.device)[None, None, :] == newest[..., None]
    block_scores = block_scores.masked_fill(forced & (visible[..., None] > 0), float("inf"))
    chosen = topk_set(block_scores, min(keep, nblocks))
    mask = torch.zeros_like(block_scores, dtype=torch.bool)
    return mask.scatter_(-1, chosen, block_scores.gather(-1, chosen) > float("-inf"))


def pool_entries(blocks: torch.Tensor, block: int, keep: int, n_entries: int,
                 topk: Callable[[torch.Tensor, int], torch.Tensor] = topk_set) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of each query's candidate pool: ids [B, c, keep * block] (ascending) and their validity (in a
    chosen block and below ``n_entries``), from a block mask [B, c, nblocks] holding at most ``keep`` blocks.
    ``topk``: :func:`topk_set` or a computation of it (a backend's)."""
    # The pool's blocks, ascending (0 / 1 as fp32: a fused top-k takes fp32, and picks what any dtype would).
    chosen = topk(blocks.to(torch.float32), min(keep, blocks.shape[-1]))
    valid = blocks.gather(-1, chosen)
    ids = (chosen[..., None] * block + torch.arange(block, device=blocks.device)).flatten(-2)
    valid = valid.repeat_interleave(block, dim=-1) & (ids < n_entries)
    return ids.clamp(max=n_entries - 1), valid
