"""RMSNorm (MODEL_REFERENCE.md §3.2)."""

from __future__ import annotations

import torch
from torch import nn

from deepseek_v41 import kernels

_WIDE = (torch.float32, torch.float64)  # dtypes upcast leaves as they are
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # dtypes the fused CPU kernels take (bf16 upcast first)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32: fp32 for fp32 / bf16 / fp16, unchanged for float64. The reference computes
    statistics, router scores, attention and mixing in fp32; keeping float64 wide lets a float64 model run without
    any fp32 rounding (tests use it to compare two computation orders without quantization flips)."""
    return x if x.dtype in _WIDE else x.float()


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, skipping the call when ``x`` already has it (same result: ``Tensor.to`` returns ``x``
    itself then; a decode step makes hundreds of such calls, each a few µs of dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)


class RMSNorm(nn.Module):
    """``y = w * x * rsqrt(mean(x^2) + eps)`` over the last dim, statistics in fp32, output in x's dtype.

    x: [..., dim] any float dtype. eps is the config's ``rms_norm_eps`` (1e-20 in V4.1: it only guards 0/0).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() >= 1 and self.weight.shape == x.shape[-1:] and fused(x, self.weight):
            if x.dtype != self.weight.dtype:  # the kernel takes both fp32 or both bf16
                return cast(kernels.rms_norm(upcast(x), upcast(self.weight), self.eps), x.dtype)
            return kernels.rms_norm(x, self.weight, self.eps)
        xf = upcast(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return cast(y * cast(self.weight, xf.dtype), x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation in fp32 (mHC mixing, Engram gate): returns fp32 [..., dim] (float64 for
    float64 input)."""
    if fused(x):
        return kernels.rms_norm(upcast(x), None, eps)
    xf = upcast(x)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def fused(*tensors: torch.Tensor) -> bool:
    """Whether the fused CPU kernels (:mod:`deepseek_v41.kernels`) take these fp32 or bf16 tensors: CPU,
    contiguous, and under ``torch.inference_mode`` (the engine's forwards). The kernels compute in fp32, so
    callers pass them ``upcast`` tensors and cast the result back where the torch code does (for bf16 its
    ``upcast`` / ``cast`` pairs). They add in another order than ATen and skip the bf16 roundings between the
    steps they fuse, so they agree with the torch code to rounding, not bit for bit; outside inference mode
    (training, the exact forward with or without ``no_grad``) the torch code runs, so those results never depend
    on the grad mode."""
    if not torch.is_inference_mode_enabled():
        return False
    for t in tensors:  # a plain loop: this runs ~100 times a decode step
        if t.dtype not in KERNEL_DTYPES:
            return False
    return kernels.usable(*tensors)
