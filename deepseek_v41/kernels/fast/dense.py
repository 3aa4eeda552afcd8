"""Fast versions of the dense pieces: the few-token GEMV of :class:`~deepseek_v41.model.linear.Linear`, the fused
RMSNorm of :class:`~deepseek_v41.model.norm.RMSNorm` and the RoPE kernel of
:class:`~deepseek_v41.model.rope.RotaryEmbedding` (issue 24; bench/README.md for the measurements).

ATen's bf16 GEMM costs ~20 µs per call at decode size on a CPU whatever the matrix (against ~4 µs for fp32), so a
bf16 model's decode step spent most of its time in ~100 such calls. :func:`linear` sends a few bf16 tokens to
:func:`deepseek_v41.kernels.linear` instead (fp32 sums, the output rounded to bf16 as ATen rounds its fp32 sums:
the same to rounding) under ``torch.inference_mode`` on the CPU. fp32 projections of a few tokens take it for
large weights while the kernels' thread pool holds torch's threads (an engine decode step), where it reads the
weight on every core; everything else is ``torch.nn.functional.linear`` (:func:`gemv` says which).

The installers check a module once (exact class, no hooks: :func:`~deepseek_v41.kernels.fast.install`; no bias,
dtypes the kernels take) and replace that instance's ``forward`` (``rotate`` for RoPE); the fast versions check
only what depends on the input and otherwise run the reference method. :func:`gemv`, :func:`few_token_gemv` and
:func:`linear` are also what the other fast versions (grouped projections, experts, the LM head) use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepseek_v41 import kernels
from deepseek_v41.kernels.fast.registry import KERNEL_DTYPES, fused, override, plain_weight, register
from deepseek_v41.model.linear import Linear
from deepseek_v41.model.norm import RMSNorm, cast, upcast
from deepseek_v41.model.rope import RotaryEmbedding

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
    """``F.linear(x, weight, bias)``: x [..., K], weight [O, K], bias [O] or None -> [..., O] in x's dtype; the
    kernel where :func:`gemv` says so (no bias)."""
    if bias is None and gemv(x, weight):
        return kernels.linear(x, weight)
    return F.linear(x, weight, bias)


# ------------------------------------------------------------------------------------------------- Linear
@register(Linear)
def install_linear(m: Linear) -> bool:
    """A :class:`Linear` without bias and with an fp32 / bf16 weight [O, K]: ``forward`` is :func:`linear`."""
    weight = plain_weight(m, Linear)
    if weight is None or weight.dim() != 2 or weight.dtype not in KERNEL_DTYPES:
        return False
    override(m, "forward", _linear_forward)
    return True


def _linear_forward(self: Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self._parameters["weight"]  # (not self.weight: Module.__getattr__ costs ~1 µs a lookup)
    if gemv(x, weight):
        return kernels.linear(x, weight)
    return F.linear(x, weight)  # the reference (nn.Linear.forward) of a Linear without bias


# ------------------------------------------------------------------------------------------------ RMSNorm
@register(RMSNorm)
def install_rms_norm(m: RMSNorm) -> bool:
    """An :class:`RMSNorm` with an fp32 / bf16 weight [D]: fp32 / bf16 inputs of width D take
    :func:`kernels.rms_norm` in inference mode (bf16 x with an fp32 weight or the reverse: upcast, then cast back
    as the reference does)."""
    weight = m._parameters.get("weight")
    if weight is None or weight.dim() != 1 or weight.dtype not in KERNEL_DTYPES:
        return False
    override(m, "forward", _rms_norm_forward)
    return True


def _rms_norm_forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    weight = self._parameters["weight"]
    if x.dim() >= 1 and weight.shape == x.shape[-1:] and fused(x, weight):
        if x.dtype != weight.dtype:  # the kernel takes both fp32 or both bf16
            return cast(kernels.rms_norm(upcast(x), upcast(weight), self.eps), x.dtype)
        return kernels.rms_norm(x, weight, self.eps)
    return RMSNorm.forward(self, x)


# ------------------------------------------------------------------------------------------------- RoPE
@register(RotaryEmbedding)
def install_rope(m: RotaryEmbedding) -> bool:
    """A :class:`RotaryEmbedding` of an even, non-zero ``rope_dim``: ``rotate`` of fp32 / bf16 x [B, T, d] or
    [B, T, H, d] with fp32 phases [B, T, r] takes :func:`kernels.rope` — the same products and sums in C, so the
    same bits, in any grad mode (phases that broadcast, [1, T, r], take the reference)."""
    if m.rope_dim <= 0 or m.rope_dim % 2:
        return False
    override(m, "rotate", _rope_rotate)
    return True


def _rope_rotate(self: RotaryEmbedding, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 inverse: bool = False) -> torch.Tensor:
    r = self.rope_dim
    if (x.dtype in KERNEL_DTYPES and cos.dtype == torch.float32 and x.dim() in (3, 4) and x.shape[-1] >= r
            and cos.shape == (*x.shape[:2], r) and kernels.usable(x, cos, sin)):
        return kernels.rope(x, cos, sin, inverse)
    return RotaryEmbedding.rotate(self, x, cos, sin, inverse)
