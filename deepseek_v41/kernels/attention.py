"""The few-query attention and the attention's projections of a few tokens (``csrc/attention.c``)."""

from __future__ import annotations

import ctypes

import torch

from deepseek_v41.kernels.checks import FP32_BF16, ROW_ON_STACK, empty, ptr, refuse
from deepseek_v41.kernels.loader import library, register

MAX_ATTEND_HEADS = 256  # attend_few keeps one query's per-head softmax state on the stack

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "dsv41_attend_few": ([_P, ctypes.c_int, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _I, _P, ctypes.c_float, _P, _P],
                         None),
    "dsv41_attn_prologue": ([_P, ctypes.c_int, _I, _I, _P, _I, _P, ctypes.c_float, _P, _I, _I, _P, _P,
                             ctypes.c_float, _P, _P, _I, _P, _P, _P], ctypes.c_int),
    "dsv41_attn_epilogue": ([_P, ctypes.c_int, _I, _I, _I, _P, _P, _I, _P, _I, _I, _P, _I, _P], ctypes.c_int),
}
BAND_MAX_DIM = 256  # head dims band_logits takes (csrc/attention.c)
SIGNATURES["dsv41_band_logits"] = ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P, _P, _I, _P,
                                     ctypes.c_float, _P], ctypes.c_int)
SIGNATURES["dsv41_band_output"] = ([_P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _P, _I, _P], ctypes.c_int)
register(SIGNATURES)


def attend_few(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, window: int,
               selected: torch.Tensor | None, topk: torch.Tensor | None, sink: torch.Tensor,
               scale: float) -> torch.Tensor:
    """:func:`deepseek_v41.model.attention._attend_few` computed in fp32: q [B, T, H, d] fp32 or bf16 (widened
    exactly inside), q_pos int64 [B, T], fp32 keys [B, L, d], key_pos int64 [B, L], fp32 selected [B, T, k, d]
    with topk int64 [B, T, k] (or both None), fp32 sink [H] -> [B, T, H, d] in q's dtype (bf16 rounded once at
    the end, as casting the fp32 result would). Raises ValueError for more than MAX_ATTEND_HEADS heads, a sink
    that is not fp32, or bf16 queries wider than ROW_ON_STACK (H * d)."""
    if not (q.numel() and q_pos.numel() and keys.numel()
            and key_pos.numel() and (selected is None or selected.numel()) and (topk is None or topk.numel())):
        empty("attend_few", q=q, q_pos=q_pos, keys=keys, key_pos=key_pos, selected=selected, topk=topk)
    B, T, H, d = q.shape
    L = keys.shape[1]
    k = 0 if topk is None else topk.shape[-1]
    out = torch.empty_like(q)
    if H > MAX_ATTEND_HEADS:
        raise ValueError(f"attend_few kernel takes at most {MAX_ATTEND_HEADS} heads, got {H}")
    if q.dtype not in FP32_BF16 or keys.dtype != torch.float32 or (selected is not None
                                                                     and selected.dtype != torch.float32):
        refuse("attend_few", (q,), (keys, selected))
    if sink.dtype != torch.float32 or (q.dtype == torch.bfloat16 and H * d > ROW_ON_STACK):
        raise ValueError(f"attend_few kernel: a {sink.dtype} sink beside {q.dtype} queries of {H} x {d} (an fp32 "
                         f"sink; bf16 queries up to H * d = {ROW_ON_STACK})")
    scratch = torch.empty((B * T, H * (L + k)), dtype=torch.float32)
    library().dsv41_attend_few(q.data_ptr(), q.dtype == torch.bfloat16, q_pos.data_ptr(), keys.data_ptr(),
                               key_pos.data_ptr(), B, T, H, d, L, window, ptr(selected), ptr(topk), k,
                               sink.data_ptr(), scale, scratch.data_ptr(), out.data_ptr())
    return out




def attn_prologue(x: torch.Tensor, wq_a: torch.Tensor, q_norm: torch.Tensor, q_eps: float, wq_b: torch.Tensor,
                  heads: int, wkv: torch.Tensor, kv_norm: torch.Tensor, kv_eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query and window-KV side of :meth:`deepseek_v41.model.attention.Attention.forward` in one call: x [B, T,
    D] and the weights (``wq_a`` [qr, D], ``q_norm`` [qr], ``wq_b`` [H * d, qr], ``wkv`` [d, D], ``kv_norm`` [d])
    all fp32 or all bf16, RoPE phases ``cos`` / ``sin`` fp32 [B, T, r] -> ``(q_lat [B, T, qr], q [B, T, H, d], kv
    [B, T, d])`` in x's dtype (bf16: rounded where the torch code rounds)."""
    if not (x.numel() and cos.numel() and sin.numel()):
        empty("attn_prologue", x=x, cos=cos, sin=sin)
    B, T, D = x.shape
    qr, d = wq_a.shape[0], wkv.shape[0]
    q_lat = torch.empty((B, T, qr), dtype=x.dtype)
    q = torch.empty((B, T, heads, d), dtype=x.dtype)
    kv = torch.empty((B, T, d), dtype=x.dtype)
    if library().dsv41_attn_prologue(x.data_ptr(), x.dtype == torch.bfloat16, B * T, D, wq_a.data_ptr(), qr,
                                     q_norm.data_ptr(), q_eps, wq_b.data_ptr(), heads, d, wkv.data_ptr(),
                                     kv_norm.data_ptr(), kv_eps, cos.data_ptr(), sin.data_ptr(), cos.shape[-1],
                                     q_lat.data_ptr(), q.data_ptr(), kv.data_ptr()) != 0:
        raise MemoryError("attn_prologue kernel: no memory for its scratch")
    return q_lat, q, kv


def attn_epilogue(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor, groups: int,
                  wo_b: torch.Tensor) -> torch.Tensor:
    """``wo_b(wo_a(inverse RoPE of o))`` of :meth:`deepseek_v41.model.attention.Attention.forward` in one call: o
    [B, T, H, d], ``wo_a`` [G * rank, H * d / G] (grouped), ``wo_b`` [D, G * rank], all fp32 or all bf16, phases
    as in :func:`attn_prologue` -> [B, T, D] in o's dtype."""
    if not (o.numel() and cos.numel() and sin.numel()):
        empty("attn_epilogue", o=o, cos=cos, sin=sin)
    B, T, H, d = o.shape
    D, rank = wo_b.shape[0], wo_a.shape[0] // groups
    y = torch.empty((B, T, D), dtype=o.dtype)
    if library().dsv41_attn_epilogue(o.data_ptr(), o.dtype == torch.bfloat16, B * T, H, d, cos.data_ptr(),
                                     sin.data_ptr(), cos.shape[-1], wo_a.data_ptr(), groups, rank, wo_b.data_ptr(),
                                     D, y.data_ptr()) != 0:
        raise MemoryError("attn_epilogue kernel: no memory for its scratch")
    return y


def band_logits(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, prev: int,
                start: int, window: int, selected: torch.Tensor | None, topk: torch.Tensor | None, sink: torch.Tensor,
                scale: float) -> torch.Tensor:
    """The concatenated logits of :func:`~deepseek_v41.model.attention.sparse_attention` (causal, banded) for the
    queries ``start .. start + c - 1`` of a forward's T new rows (issue 25; ``csrc/attention.c``): q fp32 [B, c, H,
    d], q_pos int64 [B, c], keys fp32 [B, prev + T, d] with key_pos int64 [B, prev + T] (``prev`` earlier rows,
    then the new ones), selected fp32 [B, c, k, d] with topk int64 [B, c, k] (-1 = none) or both None, sink fp32
    [H] -> fp32 [B, c, H, prev + band + k + 1] (band = min(window, T)): earlier rows, band, selected entries (each a
    dot times ``scale``, -inf where masked as the torch code masks), then the sink. The torch code's bits where
    ATen's batched GEMMs sum each dot as one chain of multiply-adds from 0 (MKL's kernels; tests/kernels checks
    it). Raises ValueError for a window below 1, queries outside the new rows or d > BAND_MAX_DIM; MemoryError when
    the scratch cannot be had."""
    if not (q.numel() and q_pos.numel() and keys.numel() and key_pos.numel() and sink.numel()):
        empty("band_logits", q=q, q_pos=q_pos, keys=keys, key_pos=key_pos, sink=sink)
    B, c, H, d = q.shape
    L = keys.shape[1]
    T = L - prev
    if d > BAND_MAX_DIM:
        raise ValueError(f"band_logits: head dim {d} above the kernel's {BAND_MAX_DIM}")
    if window < 1 or not (prev >= 0 and start >= 0 and start + c <= T):
        raise ValueError(f"band_logits: window {window} (>= 1), queries {start} .. {start + c - 1} must lie in the "
                         f"{T} new rows after {prev} earlier ones")
    k = 0 if topk is None or selected is None else topk.shape[-1]
    band = min(window, T)
    out = torch.empty((B, c, H, prev + band + k + 1), dtype=torch.float32)
    status = library().dsv41_band_logits(q.data_ptr(), q_pos.data_ptr(), keys.data_ptr(), key_pos.data_ptr(), B, c,
                                         H, d, L, prev, start, band, window, ptr(selected if k else None),
                                         ptr(topk if k else None), k, sink.data_ptr(), scale, out.data_ptr())
    if status != 0:
        raise MemoryError("band_logits kernel: no memory for its scratch")
    return out


def band_output(probs: torch.Tensor, keys: torch.Tensor, prev: int, start: int, window: int,
                selected: torch.Tensor | None) -> torch.Tensor:
    """The weighted sums of :func:`~deepseek_v41.model.attention.sparse_attention` (causal, banded) for queries
    ``start ..`` of a forward's new rows, from the softmax ``probs`` fp32 [B, c, H, n] of :func:`band_logits`'s
    logits (n = prev + band + k + 1), keys fp32 [B, prev + T, d] and selected fp32 [B, c, k, d] or None ->
    o fp32 [B, c, H, d] = (probs . earlier rows + probs . band rows) + probs . selected, each a chain of
    multiply-adds over its rows in order (the torch code's einsums' bits, as :func:`band_logits`). Raises
    ValueError when probs is not of that width; MemoryError when the scratch cannot be had."""
    if not (probs.numel() and keys.numel()):
        empty("band_output", probs=probs, keys=keys)
    B, c, H, n = probs.shape
    L, d = keys.shape[1:]
    band = min(window, L - prev)
    k = 0 if selected is None else selected.shape[2]
    if n != prev + band + k + 1 or not 0 <= start <= L - prev - c:
        raise ValueError(f"band_output: probs of width {n} for {prev} earlier rows, a band of {band} and {k} "
                         f"selected entries (+1 sink), queries from {start} among {L - prev} new rows")
    out = torch.empty((B, c, H, d), dtype=torch.float32)
    status = library().dsv41_band_output(probs.data_ptr(), keys.data_ptr(), B, c, H, d, L, prev, start, band,
                                         ptr(selected), k, out.data_ptr())
    if status != 0:
        raise MemoryError("band_output kernel: no memory for its scratch")
    return out
