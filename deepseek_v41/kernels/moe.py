"""The MoE router, the clamped SwiGLU and the routed and shared experts of a few tokens (``csrc/moe.c``)."""

from __future__ import annotations

import ctypes

import torch

from deepseek_v41.kernels.checks import FP32_BF16, ROW_ON_STACK, empty, ptr, refuse
from deepseek_v41.kernels.loader import library, register

SMALL_ROWS = 256  # up to this many tokens the router kernel runs (beyond, ATen's threaded matmuls win)

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "dsv41_gate": ([_P, ctypes.c_int, _I, _I, _P, ctypes.c_int, _I, _P, _I, ctypes.c_int, ctypes.c_float, _P, _P, _P],
                   ctypes.c_int),
    "dsv41_swiglu": ([_P, _P, _I, _I, _I, ctypes.c_float, _P], None),
    "dsv41_moe": ([_P, ctypes.c_int, _I, _I, _P, _P, _I, ctypes.c_int, _P, _P, _P, _P, _I, _I, ctypes.c_float, _P,
                   _P, _P, ctypes.c_int, _I, _P, ctypes.c_int], ctypes.c_int),
}
register(SIGNATURES)


def gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, norm_topk: bool,
         route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router of :class:`deepseek_v41.model.moe.Gate` for text tokens x [N, D] with weight [E, D] (each
    fp32, or bf16 widened exactly inside, as ``upcast`` would: bf16 x up to D = ROW_ON_STACK) and fp32 bias [E]:
    ``(indices int64 [N, k], weights fp32 [N, k])``. Raises ValueError for other dtypes or wider bf16 tokens,
    MemoryError when the bf16 weight cannot be widened."""
    if not x.numel():
        empty("gate", x=x)
    N, D = x.shape
    E = weight.shape[0]
    if (x.dtype not in FP32_BF16 or weight.dtype not in FP32_BF16 or bias.dtype != torch.float32
            or (x.dtype == torch.bfloat16 and D > ROW_ON_STACK)):
        refuse("gate", (x, weight), (bias,), row=D)
    indices = torch.empty((N, k), dtype=torch.int64)
    weights = torch.empty((N, k), dtype=torch.float32)
    scratch = torch.empty((N, E), dtype=torch.float32)
    if library().dsv41_gate(x.data_ptr(), x.dtype == torch.bfloat16, N, D, weight.data_ptr(),
                            weight.dtype == torch.bfloat16, E, bias.data_ptr(), k, int(norm_topk), route_scale,
                            scratch.data_ptr(), indices.data_ptr(), weights.data_ptr()) != 0:
        raise MemoryError("gate kernel: no memory to widen the bf16 weight")
    return indices, weights


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """:func:`deepseek_v41.model.moe.clamped_swiglu` of contiguous fp32 gate / up [N, inter] -> fp32 [N, inter]."""
    if not (gate.numel() and up.numel()):
        empty("swiglu", gate=gate, up=up)
    N, inter = gate.shape
    out = torch.empty((N, inter), dtype=torch.float32)
    library().dsv41_swiglu(gate.data_ptr(), up.data_ptr(), N, inter, inter, limit, out.data_ptr())
    return out


def moe_bf16(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             limit: float, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Routed experts of fp32 or bf16 tokens x [N, D] routed by ``indices`` int64 / ``weights`` fp32 [N, k] with
    bf16 weights ``w13`` [E, 2 * inter, D] and ``w2`` [E, D, inter] (:meth:`deepseek_v41.model.moe.MoE.dispatch`),
    plus the shared expert when ``shared`` = its ``(w1 [s, D], w3 [s, D], w2 [D, s])`` weights (fp32 or bf16) are
    given: [N, D] summed in fp32, returned in ``out_dtype`` (fp32, or bf16 rounded once from the fp32 sums).
    Raises IndexError for an expert index outside [0, E)."""
    return _moe(x, indices, weights, 1, (w13, None, w2, None), w2.shape[0], w2.shape[2], limit, shared, out_dtype)


def moe_fp4(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, codes13: torch.Tensor,
            scales13: torch.Tensor, codes2: torch.Tensor, scales2: torch.Tensor, limit: float,
            shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`moe_bf16` with the routed experts in the checkpoint's FP4 format (MODEL_REFERENCE.md §4): E2M1 codes
    uint8 ``codes13`` [E, 2 * inter, D / 2] / ``codes2`` [E, D, inter / 2] with UE8M0 scales per 32 weights
    ``scales13`` [E, 2 * inter, D / 32] / ``scales2`` [E, D, inter / 32] (D and inter multiples of 32): a quarter of
    the bytes bf16 weights take, and the same result when they hold the same values. Raises ValueError when D or
    inter is not a multiple of 32 (the scales would be misread)."""
    D, inter = x.shape[1], 2 * codes2.shape[2]
    if D % 32 or inter % 32:
        raise ValueError(f"moe_fp4 takes widths D and inter that are multiples of 32, got D={D}, inter={inter}")
    return _moe(x, indices, weights, 2, (codes13, scales13, codes2, scales2), codes2.shape[0], inter, limit, shared,
                out_dtype)


def _moe(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, kind: int, routed: tuple, E: int,
         inter: int, limit: float, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
         out_dtype: torch.dtype) -> torch.Tensor:
    if not (x.numel() and indices.numel() and weights.numel()):
        empty("moe", x=x, indices=indices, weights=weights)
    N, D = x.shape
    k = indices.shape[1]
    s_inter = shared[0].shape[0] if shared is not None else 0
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"moe kernel: out_dtype fp32 or bf16, got {out_dtype}")
    out = torch.empty((N, D), dtype=out_dtype)
    s1, s3, s2 = (None, None, None) if shared is None else (t.data_ptr() for t in shared)
    s_bf16 = shared is not None and shared[0].dtype == torch.bfloat16
    w13, sc13, w2, sc2 = (ptr(t) for t in routed)
    status = library().dsv41_moe(x.data_ptr(), x.dtype == torch.bfloat16, N, D, indices.data_ptr(),
                                 weights.data_ptr(), k, kind, w13, sc13, w2, sc2, E, inter, limit, s1, s3, s2, s_bf16,
                                 s_inter, out.data_ptr(), out_dtype == torch.bfloat16)
    if status == -2:
        raise MemoryError("moe kernel: no memory for its scratch")
    if status != 0:
        raise IndexError(f"an expert index lies outside [0, {E})")
    return out
