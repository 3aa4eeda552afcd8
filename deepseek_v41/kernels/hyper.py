"""mHC, the manifold-constrained hyper-connections (``csrc/hyper.c``): mixing coefficients with Sinkhorn, collapse
and expand of the residual streams (model/hyper.py)."""

from __future__ import annotations

import ctypes

import torch

from deepseek_v41.kernels.checks import FP32_BF16, ROW_ON_STACK, empty, ptr, refuse
from deepseek_v41.kernels.loader import library, register

MAX_HC = 16  # hc_mix keeps one token's (2 + hc) * hc mixing logits on the stack

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "dsv41_hc_mix": ([_P, ctypes.c_int, _I, _I, _I, _P, _P, _P, ctypes.c_float, ctypes.c_float, _I, _P, _P, _P, _P],
                     None),
    "dsv41_hc_collapse": ([_P, ctypes.c_int, _P, _I, _I, _I, _P, ctypes.c_float, _P], None),
    "dsv41_hc_expand": ([_P, ctypes.c_int, _P, _P, _P, _I, _I, _I, _P], None),
}
register(SIGNATURES)


def hc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
           norm_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`deepseek_v41.model.hyper.hc_mix` for fp32 or bf16 streams [B, T, hc, D] (bf16 widened exactly, as
    ``upcast`` would) with fp32 ``fn`` / ``base`` / ``scale``: pre [B, T, hc], post [B, T, hc], comb [B, T, hc,
    hc] fp32. Raises ValueError for hc > MAX_HC."""
    if not streams.numel():
        empty("hc_mix", streams=streams)
    if hc > MAX_HC:
        raise ValueError(f"hc_mix kernel takes hc <= {MAX_HC}, got {hc}")
    if streams.dtype not in FP32_BF16 or not fn.dtype == base.dtype == scale.dtype == torch.float32:
        refuse("hc_mix", (streams,), (fn, base, scale))
    B, T, _, D = streams.shape
    pre = torch.empty((B, T, hc), dtype=torch.float32)
    post = torch.empty((B, T, hc), dtype=torch.float32)
    comb = torch.empty((B, T, hc, hc), dtype=torch.float32)
    # Each token's normalized row: on the kernel's stack up to ROW_ON_STACK floats, else here.
    scratch = torch.empty((B * T, hc * D), dtype=torch.float32) if hc * D > ROW_ON_STACK else None
    library().dsv41_hc_mix(streams.data_ptr(), streams.dtype == torch.bfloat16, B * T, hc, D, fn.data_ptr(),
                           base.data_ptr(), scale.data_ptr(), norm_eps, hc_eps, iters, ptr(scratch),
                           pre.data_ptr(), post.data_ptr(), comb.data_ptr())
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor | None = None,
                eps: float = 0.0) -> torch.Tensor:
    """``Σ_i w_i R_i`` of streams [B, T, hc, D] with fp32 weights [B, T, hc], RMS-normalised with
    ``norm_weight`` [D] when given: [B, T, D] in the streams' dtype. streams and norm_weight are both fp32 or
    both bf16; the sums are fp32 either way, bf16 rounded once at the end (as casting the fp32 result would).
    Raises ValueError for bf16 rows wider than ROW_ON_STACK or a norm weight of another dtype."""
    if not (streams.numel() and weights.numel()):
        empty("hc_collapse", streams=streams, weights=weights)
    B, T, hc, D = streams.shape
    if (streams.dtype not in FP32_BF16 or weights.dtype != torch.float32
            or (norm_weight is not None and norm_weight.dtype != streams.dtype)
            or (streams.dtype == torch.bfloat16 and D > ROW_ON_STACK)):
        refuse("hc_collapse", (streams,), (weights,), norm_weight, D)
    out = torch.empty((B, T, D), dtype=streams.dtype)
    library().dsv41_hc_collapse(streams.data_ptr(), streams.dtype == torch.bfloat16, weights.data_ptr(), B * T, hc,
                                D, ptr(norm_weight), eps, out.data_ptr())
    return out


def hc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``R'_j = post_j y + Σ_i comb[i, j] R_i``: streams [B, T, hc, D] and y [B, T, D] both fp32 or both bf16,
    fp32 post [B, T, hc] and comb [B, T, hc, hc] -> [B, T, hc, D] in the streams' dtype (fp32 sums, bf16 rounded
    once at the end). Raises ValueError as :func:`hc_collapse` does."""
    if not (streams.numel() and y.numel() and post.numel() and comb.numel()):
        empty("hc_expand", streams=streams, y=y, post=post, comb=comb)
    B, T, hc, D = streams.shape
    if (streams.dtype not in FP32_BF16 or not post.dtype == comb.dtype == torch.float32 or y.dtype != streams.dtype
            or (streams.dtype == torch.bfloat16 and D > ROW_ON_STACK)):
        refuse("hc_expand", (streams,), (post, comb), y, D)
    out = torch.empty_like(streams)
    library().dsv41_hc_expand(streams.data_ptr(), streams.dtype == torch.bfloat16, y.data_ptr(), post.data_ptr(),
                              comb.data_ptr(), B * T, hc, D, out.data_ptr())
    return out
