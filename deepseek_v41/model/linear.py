"""Dense projections: ``nn.Linear`` with the fused GEMV kernel for a few tokens (bench/README.md).

ATen's bf16 GEMM costs ~20 µs per call at decode size on a CPU whatever the matrix (against ~4 µs for fp32), so a
bf16 model's decode step spent most of its time in ~100 such calls. :func:`linear` sends a few bf16 tokens to
:func:`deepseek_v41.kernels.linear` instead (fp32 sums, the output rounded to bf16 as ATen rounds its fp32 sums:
the same to rounding) under ``torch.inference_mode`` on the CPU. fp32 projections of a few tokens take it for
large weights while the kernels' thread pool holds torch's threads (an engine decode step), where it reads the
weight on every core; everything else is ``torch.nn.functional.linear`` (:func:`gemv` says which).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_v41 import kernels

FP32_GEMV_WEIGHTS = 1 << 16  # fp32 weights from this size take the kernel in a few-token step (see gemv)


def gemv(x: torch.Tensor, weight: torch.Tensor, fp32: bool = False) -> bool:
    """Whether :func:`linear` takes the kernel for x [..., K] and weight [O, K] of one dtype, on the CPU,
    contiguous, in inference mode (mismatched widths take ``F.linear``, which raises: the kernel would read past
    the weight):

    - bf16: up to ``kernels.FEW_ROWS`` tokens, or up to ``kernels.GEMV_MACS`` multiply-adds (ATen's bf16 GEMV costs
      ~20 µs a call at any small size; beyond, its threaded GEMM wins);
    - fp32: with ``fp32`` (callers whose torch code is several ops: ``GroupedLinear``) up to ``GEMV_MACS``
      multiply-adds; else up to ``FEW_ROWS`` tokens of a weight of at least ``FP32_GEMV_WEIGHTS`` values while the
      kernels have at least torch's threads (as :func:`few_token_gemv` explains)."""
    if not (x.dtype == weight.dtype and torch.is_inference_mode_enabled() and x.dim() >= 1 and weight.dim() == 2
            and x.shape[-1] == weight.shape[1]):
        return False
    if x.dtype == torch.bfloat16:
        take = x.shape[:-1].numel() <= kernels.FEW_ROWS or x.numel() * weight.shape[0] <= kernels.GEMV_MACS
    elif x.dtype == torch.float32:
        take = ((fp32 and x.numel() * weight.shape[0] <= kernels.GEMV_MACS)
                or (weight.numel() >= FP32_GEMV_WEIGHTS and x.shape[:-1].numel() <= kernels.FEW_ROWS
                    and kernels.threads() >= torch.get_num_threads()))
    else:
        return False
    return take and kernels.usable(x, weight)


def few_token_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether fp32 x [..., K] (at most ``kernels.FEW_ROWS`` tokens, inference mode) times an fp32 or bf16 weight
    [O, K] is faster in the kernel than in ATen: when the kernels' pool has at least torch's threads (a few-token
    engine step hands torch's threads to it, engine/model_runner.py, and the pool keeps them after), the kernel
    reads the weight on as many cores and ATen's fp32 GEMV is no faster per core (bench/README.md); a bf16 weight
    also skips ATen's copy to fp32."""
    return (x.dtype == torch.float32 and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.is_inference_mode_enabled() and x.dim() >= 1 and weight.dim() == 2
            and x.shape[-1] == weight.shape[1] and x.shape[:-1].numel() <= kernels.FEW_ROWS
            and (weight.dtype == torch.bfloat16 or kernels.threads() >= torch.get_num_threads())
            and kernels.usable(x, weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., K], weight [O, K], bias [O] or None -> [..., O] in x's dtype."""
    if bias is None and gemv(x, weight):
        return kernels.linear(x, weight)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, checkpoint names and hooks) whose forward is :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
