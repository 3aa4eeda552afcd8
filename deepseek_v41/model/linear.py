"""Dense projections: ``nn.Linear`` with the fused GEMV kernel for a few bf16 tokens (bench/README.md).

ATen's bf16 GEMM costs ~20 µs per call at decode size on a CPU whatever the matrix (against ~4 µs for fp32), so a
bf16 model's decode step spent most of its time in ~100 such calls. :func:`linear` sends a few bf16 tokens to
:func:`deepseek_v41.kernels.linear` instead (fp32 sums, the output rounded to bf16 as ATen rounds its fp32 sums:
the same to rounding) under ``torch.inference_mode`` on the CPU; everything else, and fp32 (ATen's fp32 GEMV is as
fast), is ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_v41 import kernels


def gemv(x: torch.Tensor, weight: torch.Tensor, fp32: bool = False) -> bool:
    """Whether :func:`linear` takes the kernel: bf16 (``fp32``: or fp32) x [..., K] and weight [O, K] on the CPU,
    contiguous, in inference mode, with at most ``kernels.GEMV_MACS`` multiply-adds (beyond that ATen's threaded
    GEMM wins). Mismatched widths take ``F.linear``, which raises (the kernel would read past the weight). fp32 is
    for callers whose torch code is several ops (``GroupedLinear``: reshapes and a batched matmul); a plain fp32
    ``F.linear`` is as fast as the kernel."""
    return (x.dtype == weight.dtype and (x.dtype == torch.bfloat16 or (fp32 and x.dtype == torch.float32))
            and torch.is_inference_mode_enabled() and x.dim() >= 1
            and weight.dim() == 2 and x.shape[-1] == weight.shape[1]
            and x.numel() * weight.shape[0] <= kernels.GEMV_MACS and kernels.usable(x, weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., K], weight [O, K], bias [O] or None -> [..., O] in x's dtype."""
    if bias is None and gemv(x, weight):
        return kernels.linear(x, weight)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, checkpoint names and hooks) whose forward is :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
