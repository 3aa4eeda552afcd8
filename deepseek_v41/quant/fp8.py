"""FP8 E4M3FN block quantization with UE8M0 scales: SWA window rows and fp8 GEMM activations
(MODEL_REFERENCE.md §4, the reference's ``act_quant``).

One scale per ``block_size`` (32) consecutive channels of the last dimension:
``scale = 2**ceil(log2(max(amax, 1e-4) / 448))``, stored as its UE8M0 byte (biased exponent). Elements are
``clamp(x / scale, -448, 448)`` cast round-to-nearest-even to E4M3FN. NaN / inf / -0 follow the package
policy (:mod:`deepseek_v41.quant`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from deepseek_v41 import kernels
from deepseek_v41.quant.formats import (
    E4M3_MAX,
    check_blocks,
    check_codes,
    e4m3_decode,
    e4m3_encode,
    ue8m0_decode,
    ue8m0_encode_ceil,
)
from deepseek_v41.quant.ste import straight_through

FP8_AMAX_FLOOR = 1e-4  # keeps the scale of an all-zero block finite (2**-22)


def quantize_fp8(x: Tensor, block_size: int = 32, scale_format: str = "ue8m0") -> tuple[Tensor, Tensor]:
    """Quantize ``x`` [..., n] (any float dtype, any device) to block-scaled FP8 E4M3FN.

    Returns ``(codes, scales)``: codes uint8 [..., n] (E4M3FN bits), scales uint8 [..., n // block_size]
    (UE8M0 bytes). Raises ValueError when ``x`` is not floating point, ``n`` is not a multiple of
    ``block_size``, or ``scale_format`` is not ``"ue8m0"``. Source: MODEL_REFERENCE.md §4.
    """
    if _fast(x, block_size, scale_format):
        return kernels.fp8_quantize_values(x.float())[:2]
    codes, scale_bytes, _ = _quantize_blocks(x, block_size, scale_format)
    return codes.flatten(-2), scale_bytes


def quantize_fp8_values(x: Tensor, block_size: int = 32, scale_format: str = "ue8m0") -> tuple[Tensor, Tensor, Tensor]:
    """:func:`quantize_fp8` and the values its result decodes to, in one pass: ``(codes, scales, values)`` with
    ``values`` = ``dequantize_fp8(codes, scales, block_size, scale_format, x.dtype)`` [..., n] (what the SWA
    window keeps and attention reads). Raises ValueError as :func:`quantize_fp8`. Source: MODEL_REFERENCE.md §4.
    """
    if _fast(x, block_size, scale_format):
        codes, scale_bytes, values = kernels.fp8_quantize_values(x.float())
        return codes, scale_bytes, values.to(x.dtype)
    codes, scale_bytes, scale = _quantize_blocks(x, block_size, scale_format)
    values = (e4m3_decode(codes) * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)
    return codes.flatten(-2), scale_bytes, values


def dequantize_fp8(
    codes: Tensor,
    scales: Tensor,
    block_size: int = 32,
    scale_format: str = "ue8m0",
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Decode ``codes`` uint8 [..., n] (E4M3FN bits) and ``scales`` uint8 [..., n // block_size] (UE8M0) to
    ``dtype`` [..., n]. Scale byte 255 decodes its block to NaN. Raises ValueError on non-uint8 inputs,
    shapes that do not fit ``block_size``, or ``scale_format`` other than ``"ue8m0"``.
    Source: MODEL_REFERENCE.md §4.
    """
    _check_ue8m0(scale_format)
    n = check_codes(codes, scales, block_size, elements_per_byte=1)
    if block_size == 32 and codes.numel() > 0 and kernels.usable(codes, scales):
        return kernels.fp8_dequantize(codes, scales).to(dtype)
    values = e4m3_decode(codes).unflatten(-1, (n // block_size, block_size))
    return (values * ue8m0_decode(scales).unsqueeze(-1)).flatten(-2).to(dtype)


def fake_quant_fp8(x: Tensor, block_size: int = 32) -> Tensor:
    """``dequantize_fp8(*quantize_fp8(x, block_size))`` computed in fp32 and cast back to ``x.dtype``; same
    shape, dtype and device as ``x`` (``meta`` included). The gradient is straight-through (identity).
    Raises ValueError as :func:`quantize_fp8`. Source: MODEL_REFERENCE.md §4.
    """
    return straight_through(x, functools.partial(_fake_quant, block_size=block_size))


def _fake_quant(x: Tensor, block_size: int) -> Tensor:
    return quantize_fp8_values(x, block_size)[2]


def _quantize_blocks(x: Tensor, block_size: int, scale_format: str) -> tuple[Tensor, Tensor, Tensor]:
    """The one FP8 rounding: ``x`` [..., n] -> (codes uint8 [..., n/b, b], scale bytes uint8 [..., n/b],
    scales float32 [..., n/b])."""
    _check_ue8m0(scale_format)
    blocks = check_blocks(x, block_size, pairs=False)
    xb = x.float().reshape(*x.shape[:-1], blocks, block_size)
    amax = xb.abs().amax(-1)  # NaN propagates; an infinite amax gives scale byte 255 (NaN) too
    scale_bytes = ue8m0_encode_ceil(amax.clamp(min=FP8_AMAX_FLOOR) / E4M3_MAX)
    scale = ue8m0_decode(scale_bytes)
    codes = e4m3_encode((xb / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX))
    return codes, scale_bytes, scale


def _fast(x: Tensor, block_size: int, scale_format: str) -> bool:
    """Whether the fused CPU kernel quantizes ``x`` (after the same checks as the torch code, so errors are the
    same): blocks of 32, a float dtype that widens exactly to fp32 (the torch code rounds in fp32 too), at least one
    element (the kernels refuse empty tensors; the torch code takes them)."""
    _check_ue8m0(scale_format)
    check_blocks(x, block_size, pairs=False)
    return block_size == 32 and x.dtype in kernels.WIDENS_TO_FP32 and x.numel() > 0 and kernels.usable(x)


def _check_ue8m0(scale_format: str) -> None:
    if scale_format != "ue8m0":
        raise ValueError(f"FP8 blocks use UE8M0 scales only; got scale_format {scale_format!r}")
