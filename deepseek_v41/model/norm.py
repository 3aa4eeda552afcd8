"""RMSNorm (MODEL_REFERENCE.md §3.2)."""

from __future__ import annotations

import torch
from torch import nn

_WIDE = (torch.float32, torch.float64)  # dtypes upcast leaves as they are


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
        xf = upcast(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return cast(y * cast(self.weight, xf.dtype), x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation in fp32 (mHC mixing, Engram gate): returns fp32 [..., dim] (float64 for
    float64 input)."""
    xf = upcast(x)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
