"""The compressed entries and index keys of a few tokens (``csrc/compressor.c``; MODEL_REFERENCE.md §3.8, §3.9)."""

from __future__ import annotations

import ctypes

import torch

from deepseek_v41.kernels.checks import empty, ptr
from deepseek_v41.kernels.loader import library, register

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "dsv41_compress": ([_P, ctypes.c_int, _I, _I, _I, _P, _I, _P, _P, _I, _P, ctypes.c_float, _P, _P, _I, _P, _P, _I,
                        _P, _I, _P, ctypes.c_float, _P, _P, _P, _P, _P], ctypes.c_int),
}
register(SIGNATURES)


def compress(x: torch.Tensor, positions: torch.Tensor, ratio: int, pending: tuple[torch.Tensor, torch.Tensor] | None,
             phases: tuple[torch.Tensor, torch.Tensor] | None, wkv: torch.Tensor, wgate: torch.Tensor | None,
             norm: torch.Tensor, eps: float, wk: torch.Tensor, k_norm: torch.Tensor, k_eps: float
             ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None,
                        torch.Tensor | None]:
    """:meth:`deepseek_v41.model.attention.Attention.compress` for a few tokens in one call (the compressor of
    MODEL_REFERENCE.md §3.8, the entry RoPE and the index keys of §3.9): x [B, T, D] (T >= 1) at positions int64
    [B, T] (each row consecutive); ``wkv`` / ``wgate`` (ratio 2; None for ratio 1) [d, D], ``norm`` [d], ``wk``
    [di, d], ``k_norm`` [di], all of x's dtype (fp32 or bf16); ``pending``: the open pairs' ``(kv, score)`` fp32
    [B, d] each (rows may lie apart, elements adjacent), or None (zeros). ``phases``: RoPE ``(cos, sin)`` fp32 [B,
    T, r] at the positions (ratio 1) or [B, T + 1, r] at positions ``start - 1 .. start + T - 1`` of each row
    (ratio 2), r <= min(d, di) even; None skips the entries and keys (no row completes one).

    Returns ``(latent [B, G, d], group int64 [B, G], new_pending, entries [B, G, d], index_keys [B, G, di])``: the
    :class:`~deepseek_v41.model.compressor.Compressor`'s three outputs (ratio 1: G = T, group = ``positions``,
    new_pending None; ratio 2: G = (T + 1) // 2 and new_pending fp32 [B, d] each), then ``rope(latent)`` and
    ``rope(k_norm(wk(latent)))`` at the entry positions ``group.clamp(min=0) * ratio`` (None without
    ``phases``), in x's dtype. bf16: the same bits as the module calls wherever those run their projections in
    this library's GEMV (ratio 1's ``wkv``, ``wk``), else to rounding. Raises MemoryError when the scratch
    cannot be had."""
    if not (x.numel() and positions.numel()):
        empty("compress", x=x, positions=positions)
    B, T, D = x.shape
    d, di = wkv.shape[0], wk.shape[0]
    G = (T + 1) // 2 if ratio == 2 else T
    latent = torch.empty((B, G, d), dtype=x.dtype)
    group = torch.empty((B, G), dtype=torch.int64) if ratio == 2 else None  # ratio 1: the positions
    new_pending = torch.empty((B, 2, d), dtype=torch.float32) if ratio == 2 else None
    entries = keys = None
    if phases is not None:
        entries, keys = torch.empty((B, G, d), dtype=x.dtype), torch.empty((B, G, di), dtype=x.dtype)
    pk, ps = (None, None) if pending is None else pending
    cos, sin = (None, None) if phases is None else phases
    if library().dsv41_compress(x.data_ptr(), x.dtype == torch.bfloat16, B, T, D, positions.data_ptr(), ratio,
                                wkv.data_ptr(), ptr(wgate), d, norm.data_ptr(), eps, ptr(pk), ptr(ps),
                                0 if pk is None else pk.stride(0), ptr(cos), ptr(sin), 0 if cos is None else
                                cos.shape[-1], wk.data_ptr(), di, k_norm.data_ptr(), k_eps, latent.data_ptr(),
                                ptr(group), ptr(new_pending), ptr(entries), ptr(keys)) != 0:
        raise MemoryError("compress kernel: no memory for its scratch")
    if ratio == 1:
        return latent, positions, None, entries, keys
    return latent, group, (new_pending[:, 0], new_pending[:, 1]), entries, keys
