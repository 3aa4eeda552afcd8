"""The SWA window ring of FP8 rows (``csrc/window.c``): one layer's window step read, quantized and written in one
call."""

from __future__ import annotations

import ctypes

import torch

from deepseek_v41.kernels.checks import empty
from deepseek_v41.kernels.loader import library, register

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "dsv41_window_step": ([_P, _P, _P, _I, _I, _I, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P], None),
}
register(SIGNATURES)


def window_step(ring_codes: torch.Tensor, ring_scales: torch.Tensor, ring_pos: torch.Tensor, layer: int,
                slots: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's SWA window step over the FP8 rings (codes uint8 [S, L, R, d], scales [S, L, R, d / 32], pos
    int32 [S, L, R]) for rows ``slots`` int64 [B] with new rows ``kv`` fp32 [B, T, d] at ``positions`` int64
    [B, T]: returns ``(keys fp32 [B, R + T, d], key_pos int64 [B, R + T])`` as
    :meth:`~deepseek_v41.cache.paged_context.PagedContext.window` does, and stores the new rows in the rings."""
    if not (slots.numel() and positions.numel() and kv.numel()):
        empty("window_step", slots=slots, positions=positions, kv=kv)
    S, L, R, d = ring_codes.shape
    B, T, _ = kv.shape
    keys = torch.empty((B, R + T, d), dtype=torch.float32)
    key_pos = torch.empty((B, R + T), dtype=torch.int64)
    new_codes = torch.empty((B, T, d), dtype=torch.uint8)
    new_scales = torch.empty((B, T, d // 32), dtype=torch.uint8)
    library().dsv41_window_step(ring_codes.data_ptr(), ring_scales.data_ptr(), ring_pos.data_ptr(), L, layer, R, d,
                                slots.data_ptr(), B, positions.data_ptr(), T, kv.data_ptr(), new_codes.data_ptr(),
                                new_scales.data_ptr(), keys.data_ptr(), key_pos.data_ptr())
    return keys, key_pos
