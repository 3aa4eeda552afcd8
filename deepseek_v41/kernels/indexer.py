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
