"""Dense projections: ``nn.Linear`` under the model's own class name.

:class:`Linear` is ``nn.Linear`` (same parameters, checkpoint names, hooks and forward). It is a class of its own
so that the CPU fast backend, once installed on a loaded model, recognises the model's projections and sends a
few tokens to its fused GEMV (issue 24); modules built as ``nn.Linear`` keep ATen's projection.
"""

from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, checkpoint names, hooks and forward): ``x [..., in] -> [..., out]``."""
