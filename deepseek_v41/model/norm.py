"""RMSNorm (MODEL_REFERENCE.md §3.2)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = w * x * rsqrt(mean(x^2) + eps)`` over the last dim, statistics in fp32, output in x's dtype.

    x: [..., dim] any float dtype. eps is the config's ``rms_norm_eps`` (1e-20 in V4.1: it only guards 0/0).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation in fp32 (mHC mixing, Engram gate): returns fp32 [..., dim]."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
