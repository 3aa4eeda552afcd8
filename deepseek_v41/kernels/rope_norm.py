"""RoPE and RMSNorm over rows of fp32 or bf16 values (``csrc/rope_norm.c``)."""

from __future__ import annotations

import ctypes

import torch

from deepseek_v41.kernels.checks import empty, ptr
from deepseek_v41.kernels.loader import library, register

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "dsv41_rope": ([_P, _P, _P, _I, _I, _I, _I, ctypes.c_int, _P], None),
    "dsv41_rope_bf16": ([_P, _P, _P, _I, _I, _I, _I, ctypes.c_int, _P], None),
    "dsv41_rms_norm": ([_P, _I, _I, _P, ctypes.c_float, _P], None),
    "dsv41_rms_norm_bf16": ([_P, _I, _I, _P, ctypes.c_float, _P, _P], None),
}
register(SIGNATURES)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """RoPE on the last ``r`` dims of fp32 or bf16 ``x`` [B, T, d] or [B, T, H, d] with phases ``cos`` / ``sin``
    fp32 [B, T, r] (:meth:`~deepseek_v41.model.rope.RotaryEmbedding.phases`), in x's dtype (bf16: rotated in fp32
    and rounded, as the torch code does); the bits of the torch code."""
    if not (x.numel() and cos.numel() and sin.numel()):
        empty("rope", x=x, cos=cos, sin=sin)
    B, T = x.shape[:2]
    H = x.shape[2] if x.dim() == 4 else 1
    out = torch.empty_like(x)
    fn = library().dsv41_rope_bf16 if x.dtype == torch.bfloat16 else library().dsv41_rope
    fn(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), B * T, H, x.shape[-1], cos.shape[-1], -1 if inverse else 1,
       out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) (* weight)`` over the last dim of ``x`` [..., D] with weight [D] (or None), both
    fp32 or both bf16: in x's dtype (bf16: normalised in fp32 and rounded once)."""
    if not x.numel():
        empty("rms_norm", x=x)
    D = x.shape[-1]
    out = torch.empty_like(x)
    if x.dtype == torch.bfloat16:
        scratch = torch.empty(D, dtype=torch.float32)
        library().dsv41_rms_norm_bf16(x.data_ptr(), x.numel() // max(D, 1), D, ptr(weight), eps, scratch.data_ptr(),
                                      out.data_ptr())
    else:
        library().dsv41_rms_norm(x.data_ptr(), x.numel() // max(D, 1), D, ptr(weight), eps, out.data_ptr())
    return out
