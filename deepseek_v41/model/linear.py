"""Dense projections: ``nn.Linear`` under the model's own class name.

:class:`Linear` is ``nn.Linear`` (same parameters, checkpoint names, hooks and forward). It is a class of its own
so that the CPU fast backend, once installed on a loaded model, recognises the model's projections and sends a
few tokens to its fused GEMV (issue 24); modules built as ``nn.Linear`` keep ATen's projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_v41 import kernels

# --- kept for model/attention.py and model/moe.py only, until their fast paths move to kernels/fast (issue 24);
# --- the same functions live in deepseek_v41/kernels/fast/dense.py. Remove when nothing in model/ imports them.
FP32_GEMV_WEIGHTS = 1 << 16


def gemv(x: torch.Tensor, weight: torch.Tensor, fp32: bool = False) -> bool:
    """Deprecated here: :func:`deepseek_v41.kernels.fast.dense.gemv`."""
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Deprecated here: :func:`deepseek_v41.kernels.fast.dense.linear`."""
    if bias is None and gemv(x, weight):
        return kernels.linear(x, weight)
    return F.linear(x, weight, bias)
# --- end of the part kept for attention.py / moe.py


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, checkpoint names, hooks and forward): ``x [..., in] -> [..., out]``."""
