"""The dense projections of a few tokens (``csrc/gemv.c``)."""

from __future__ import annotations

import ctypes

import torch

from deepseek_v41.kernels.checks import empty
from deepseek_v41.kernels.loader import library, register

GEMV_MACS = 1 << 19  # up to this many multiply-adds (tokens x weights) a bf16 projection takes the kernel

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "dsv41_linear": ([_P, ctypes.c_int, _I, _I, _I, _P, ctypes.c_int, _I, _P], ctypes.c_int),
}
register(SIGNATURES)


def linear(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight)`` (no bias) for a few tokens: x [..., K] and weight [O, K], each
    fp32 or bf16, summed in fp32 and returned in x's dtype (bf16 rounded to nearest even, as ATen's bf16 GEMM
    rounds its fp32 sums): [..., O]. ``groups`` G > 1: x [..., G * K_g] and weight [G * O_g, K_g], group g's
    outputs from group g's inputs (``GroupedLinear``). ATen's bf16 GEMV costs ~20 µs at decode size here against
    a few µs for this (bench/README.md)."""
    if not (x.numel() and weight.numel()):
        empty("linear", x=x, weight=weight)
    K = x.shape[-1] // groups
    O = weight.shape[0] // groups
    N = x.shape[:-1].numel()  # not x.numel() // K: that is 0 for K = 0, leaving the output unwritten
    out = torch.empty((*x.shape[:-1], groups * O), dtype=x.dtype)
    if library().dsv41_linear(x.data_ptr(), x.dtype == torch.bfloat16, N, groups, K, weight.data_ptr(),
                              weight.dtype == torch.bfloat16, O, out.data_ptr()) != 0:
        raise MemoryError("linear kernel: no memory for its scratch")
    return out
