"""The indexer (``csrc/indexer.c``): its scores straight from the paged FP4 index keys, and its queries of a few
tokens."""

from __future__ import annotations

import ctypes

import torch

from deepseek_v41.kernels.checks import empty, ptr
from deepseek_v41.kernels.codecs import FP4_FORMATS
from deepseek_v41.kernels.loader import library, register

INDEX_LUT_ROWS = 1024  # from this many keys per row, index scores the even / odd path cannot take use a lookup table

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "dsv41_index_scores": ([_P, _P, _I, _I, _I, _I, ctypes.c_int, _P, _I, _I, _I, _P, _P, _I, _I, _I, _I,
                            ctypes.c_int, _P, _P], ctypes.c_int),
    "dsv41_indexer_queries": ([_P, _P, ctypes.c_int, _I, _I, _I, _P, _I, _I, _P, _P, _P, _I, ctypes.c_int,
                               ctypes.c_float, _P, _P], ctypes.c_int),
    "dsv41_index_select": ([_P, _P, _P, _I, _I, _I, _I, _I, _P, _I, _I, _I, _P, _P], ctypes.c_int),
}
register(SIGNATURES)


def index_scores(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str, tables: torch.Tensor, ratio: int,
                 block_size: int, q: torch.Tensor, w: torch.Tensor, n: int,
                 visible: torch.Tensor | None = None) -> torch.Tensor:
    """Indexer scores ``Σ_h w_h relu(q_h · k_s)`` fp32 [B, c, n] of queries q fp32 [B, c, H, di] with head weights
    w fp32 [B, c, H] against entries 0 .. n-1 of each row's FP4 index keys (a pool as in :func:`fp4_gather`),
    decoded on the fly; with ``visible`` int64 [B, c], -inf from each query's visible count on
    (:func:`~deepseek_v41.model.indexer.mask_invisible`). Raises IndexError when an entry lies past its block
    table."""
    if not (tables.numel() and q.numel() and w.numel() and (visible is None or visible.numel())):
        empty("index_scores", tables=tables, q=q, w=w, visible=visible)
    pages, per_page, half = codes.shape
    B, c, H, di = q.shape
    out = torch.empty((B, c, n), dtype=torch.float32)
    # A lookup table per query pays for itself over long rows (its size: see csrc/indexer.c dsv41_index_scores).
    lut = n >= INDEX_LUT_ROWS and H <= 64 and di // 2 * 256 * -(-H // 4) * 4 <= 1 << 16
    status = library().dsv41_index_scores(codes.data_ptr(), scales.data_ptr(), pages, per_page, 2 * half, block,
                                          FP4_FORMATS[fmt], tables.data_ptr(), tables.shape[1], ratio, block_size,
                                          q.data_ptr(), w.data_ptr(), B, c, H, n, int(lut), ptr(visible),
                                          out.data_ptr())
    if status == -2:
        raise MemoryError("index_scores kernel: no memory for its scratch")
    if status != 0:
        raise IndexError("an entry index lies past its block table")
    return out


def index_select(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, k: int,
                 pool: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:meth:`deepseek_v41.model.indexer.Indexer.select_entries` in one call (issue 25; ``csrc/indexer.c``
    dsv41_index_select): queries q fp32 [B, c, H, di] with head weights w fp32 [B, c, H], every index key keys
    fp32 [B, N, di], visible counts int64 [B, c] -> the top-k picks int64 [B, c, k] (``topk_entries`` of the
    ``mask_invisible`` scores: ascending, -1 where the pick is -inf) and with ``pool`` = (block, keep) the
    candidate-pool mask bool [B, c, ceil(N / block)] (``candidate_blocks``), else None. The scores are the torch
    code's bits where ATen's fp32 GEMM sums each dot as one multiply-add chain (MKL's kernels), so the picks are its
    picks; only each query's visible entries are scored, and the [B, c, N] scores are never written. None when a
    visible score is NaN (the caller takes the torch code). Raises ValueError when k > N or k < 0, or a block /
    keep below 1; MemoryError when the kernel's scratch cannot be had."""
    if not (q.numel() and w.numel() and keys.numel() and visible.numel()):
        empty("index_select", q=q, w=w, keys=keys, visible=visible)
    B, c, H, di = q.shape
    N = keys.shape[1]
    if not 0 <= k <= N:
        raise ValueError(f"k must be in [0, {N}] (the index keys), got {k}")
    block, keep = pool if pool is not None else (1, 1)
    if block < 1 or keep < 1:
        raise ValueError(f"the candidate pool's block and keep must be >= 1, got {block}, {keep}")
    picks = torch.empty((B, c, k), dtype=torch.int64)
    mask = torch.empty((B, c, -(-N // block)), dtype=torch.bool) if pool is not None else None
    status = library().dsv41_index_select(q.data_ptr(), w.data_ptr(), keys.data_ptr(), B, c, H, di, N,
                                          visible.data_ptr(), k, block, keep, picks.data_ptr(), ptr(mask))
    if status == -2:
        raise MemoryError("index_select kernel: no memory for its scratch")
    return (picks, mask) if status == 0 else None


def indexer_queries(q_lat: torch.Tensor, x: torch.Tensor, wq_b: torch.Tensor, heads: int, weights_proj: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, fake_quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`deepseek_v41.model.indexer.Indexer.queries` in one call: q_lat [B, T, qr], x [B, T, D] and the
    weights (``wq_b`` [heads * di, qr], ``weights_proj`` [heads, D]) all fp32 or all bf16, RoPE phases ``cos`` /
    ``sin`` fp32 [B, T, r] (r even, <= di; ``fake_quant``: di a multiple of 32) -> ``(q [B, T, heads, di], w [B, T,
    heads])`` fp32. RoPE and the FP4 (UE8M0 / 32) fake quant give the torch code's bits; the projections are rounded
    as in :func:`attn_prologue`, and w is scaled by ``di ** -0.5 * heads ** -0.5`` after them (MODEL_REFERENCE.md
    §3.9). Raises MemoryError when the kernel's scratch cannot be allocated."""
    if not (q_lat.numel() and x.numel() and cos.numel() and sin.numel()):
        empty("indexer_queries", q_lat=q_lat, x=x, cos=cos, sin=sin)
    B, T, qr = q_lat.shape
    di = wq_b.shape[0] // heads
    q = torch.empty((B, T, heads, di), dtype=torch.float32)
    w = torch.empty((B, T, heads), dtype=torch.float32)
    if library().dsv41_indexer_queries(q_lat.data_ptr(), x.data_ptr(), x.dtype == torch.bfloat16, B * T, qr,
                                       x.shape[-1], wq_b.data_ptr(), heads, di, weights_proj.data_ptr(),
                                       cos.data_ptr(), sin.data_ptr(), cos.shape[-1], int(fake_quant),
                                       di ** -0.5 * heads ** -0.5, q.data_ptr(), w.data_ptr()) != 0:
        raise MemoryError("indexer_queries kernel: no memory for its scratch")
    return q, w
