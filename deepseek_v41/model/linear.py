"""Dense projections: ``nn.Linear`` under the model's own class name.

:class:`Linear` is ``nn.Linear`` (same parameters, checkpoint names, hooks and forward). It is a class of its own
so that the CPU fast backend, once installed on a loaded model, recognises the model's projections and sends a
few tokens to its fused GEMV (issue 24); modules built as ``nn.Linear`` keep ATen's projection.

:class:`LMHead` is the text model's output projection as a module, so that a sharded model (issue 28) can put a
vocab-parallel head in its place and every caller (the exact forward, the engine, the fast backend) goes through it.
"""

from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, checkpoint names, hooks and forward): ``x [..., in] -> [..., out]``."""


class LMHead(nn.Linear):
    """The LM head (``head.weight`` [V, D], no bias): x [..., D] fp32 (float64 stays) -> logits [..., V] in x's
    dtype, the weight widened to x's dtype (MODEL_REFERENCE.md §3.15). A module of its own so that tensor
    parallelism can replace it by a vocab-parallel head (``deepseek_v41.distributed.layers.ParallelLMHead``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.to(x.dtype).t()
