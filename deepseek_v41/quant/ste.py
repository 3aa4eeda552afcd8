"""Straight-through estimator for quantization-aware training (MODEL_REFERENCE.md §4: the reference keeps
caches as values already on the FP4/FP8 grid, "fake-quant in place")."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class _StraightThrough(torch.autograd.Function):
    # An autograd.Function rather than ``x + (q - x).detach()``: that form is not bit-exact in bf16 and
    # gives NaN for infinite inputs (inf - inf).
    @staticmethod
    def forward(ctx, x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def straight_through(x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``fn(x)`` in the forward pass, identity gradient (d out / d x = I) in the backward pass.

    ``fn`` must return a tensor of the shape and dtype of ``x``; it runs without autograd tracking. When no
    gradient can flow (``x`` does not require one, or grad mode is off) ``fn(x)`` is returned directly: an
    ``autograd.Function`` call costs about 100 µs of Python, which inference pays on every decode step.
    """
    if not (x.requires_grad and torch.is_grad_enabled()):
        return fn(x)
    return _StraightThrough.apply(x, fn)
