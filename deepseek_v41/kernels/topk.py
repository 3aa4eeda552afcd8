"""The indexer's top-k, the sampler's argmax, and the candidate pool: its blocks and a Reindex layer's picks inside
them (``csrc/topk.c``)."""

from __future__ import annotations

import ctypes

import torch

from deepseek_v41.kernels.checks import empty
from deepseek_v41.kernels.codecs import FP4_FORMATS
from deepseek_v41.kernels.loader import library, register

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "dsv41_topk_set": ([_P, _I, _I, _I, ctypes.c_int, _P, _P], ctypes.c_int),
    "dsv41_argmax": ([_P, _I, _I, _P], None),
    "dsv41_candidate_blocks": ([_P, _P, _I, _I, _I, _I, _P], ctypes.c_int),
    "dsv41_pool_select": ([_P, _P, _I, _I, _I, _I, ctypes.c_int, _P, _I, _I, _I, _P, _P, _I, _I, _I, _I, _P, _I, _I,
                           _I, _P, _I, _P], ctypes.c_int),
}
register(SIGNATURES)


def topk_set(scores: torch.Tensor, k: int, drop_neg_inf: bool = False) -> torch.Tensor | None:
    """:func:`deepseek_v41.model.indexer.topk_set` of fp32 ``scores`` [..., N]: indices int64 [..., k] of the k
    largest, ascending, ties at the k-th value to the lowest indices (exactly the torch code's result);
    ``drop_neg_inf``: -1 where the picked score is -inf (``topk_entries``). None when a row holds a NaN or
    k > N (the caller takes the torch code, which ranks NaN first / raises)."""
    if not scores.numel():
        empty("topk_set", scores=scores)
    N = scores.shape[-1]
    out = torch.empty((*scores.shape[:-1], k), dtype=torch.int64)
    rows = scores.numel() // max(N, 1)
    heap = torch.empty((rows, max(k, 1)), dtype=torch.float32)
    status = library().dsv41_topk_set(scores.data_ptr(), rows, N, k, int(drop_neg_inf),
                                      heap.data_ptr(), out.data_ptr())
    return out if status == 0 else None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.max(dim=-1).indices`` of contiguous fp32 rows x [..., V] (V >= 1): int64 [...], the first index of each
    row's largest value, NaN counting as the largest; exactly torch's indices. ATen's takes ~40-90 µs for 8 x 8192
    on one thread (its max-with-index reduction is not vectorized), this ~15 with its Python."""
    if not x.numel():
        empty("argmax", x=x)
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    library().dsv41_argmax(x.data_ptr(), out.numel(), x.shape[-1], out.data_ptr())
    return out


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, block: int, keep: int) -> torch.Tensor | None:
    """:func:`deepseek_v41.model.indexer.candidate_blocks` of fp32 ``scores`` [B, c, N] (-inf where not visible)
    with visible counts int64 [B, c]: the candidate pool's block mask bool [B, c, nblocks], exactly the torch
    code's. None when a row holds a NaN (the caller takes the torch code)."""
    if not (scores.numel() and visible.numel()):
        empty("candidate_blocks", scores=scores, visible=visible)
    B, c, N = scores.shape
    mask = torch.empty((B, c, -(-N // block)), dtype=torch.bool)
    status = library().dsv41_candidate_blocks(scores.data_ptr(), visible.data_ptr(), B * c, N, block, keep,
                                              mask.data_ptr())
    if status == -2:
        raise MemoryError("candidate_blocks kernel: no memory for its scratch")
    return mask if status == 0 else None


def pool_select(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str, tables: torch.Tensor, ratio: int,
                block_size: int, q: torch.Tensor, w: torch.Tensor, n: int, blocks: torch.Tensor, pool_block: int,
                keep: int, visible: torch.Tensor, k: int) -> torch.Tensor | None:
    """A Reindex layer's picks inside its candidate pool (:meth:`deepseek_v41.model.attention.Attention.select`):
    for queries q fp32 [B, c, H, di] with head weights w fp32 [B, c, H], the entries of the pool given by the
    block mask ``blocks`` bool [B, c, nblocks] (blocks of ``pool_block`` entries, at most ``keep`` of them:
    :func:`~deepseek_v41.model.indexer.pool_entries`) that lie below ``n`` and below the query's visible count
    int64 [B, c], scored straight from the FP4 index keys (as :func:`index_scores` scores one query), and their
    top ``k`` (<= min(keep, nblocks) * pool_block) by the top-k rule: global entry ids int64 [B, c, k], ascending
    among the pool's positions, -1 where fewer are valid. None when a score is NaN (the caller takes the torch
    code). Raises IndexError as :func:`fp4_gather`."""
    if not (tables.numel() and q.numel() and w.numel() and blocks.numel() and visible.numel()):
        empty("pool_select", tables=tables, q=q, w=w, blocks=blocks, visible=visible)
    pages, per_page, half = codes.shape
    B, c, H, _ = q.shape
    out = torch.empty((B, c, k), dtype=torch.int64)
    status = library().dsv41_pool_select(codes.data_ptr(), scales.data_ptr(), pages, per_page, 2 * half, block,
                                         FP4_FORMATS[fmt], tables.data_ptr(), tables.shape[1], ratio, block_size,
                                         q.data_ptr(), w.data_ptr(), B, c, H, n, blocks.data_ptr(), blocks.shape[-1],
                                         pool_block, keep, visible.data_ptr(), k, out.data_ptr())
    if status == -1:
        raise IndexError("an entry index lies past its block table")
    if status == -2:
        raise MemoryError("pool_select kernel: no memory for its scratch")
    if status == -4:
        raise ValueError(f"k = {k} exceeds the pool's {min(keep, blocks.shape[-1]) * pool_block} entries")
    return out if status == 0 else None
