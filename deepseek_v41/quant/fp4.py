"""FP4 E2M1 block quantization: main compressed KV entries and indexer keys / queries
(MODEL_REFERENCE.md §4).

E2M1 values are {0, 0.5, 1, 1.5, 2, 3, 4, 6}; a code is the sign in bit 3 and the index of the magnitude in
bits 0-2. Two codes per byte, element ``2i`` in the low nibble and ``2i + 1`` in the high nibble. One scale
per ``block_size`` consecutive channels of the last dimension:

- ``"e4m3"`` (main KV, block 16): ``scale = e4m3_RNE(clamp(amax / 6, 2**-9, 448))``, the byte is E4M3FN bits;
- ``"ue8m0"`` (indexer, block 32): ``scale = 2**ceil(log2(max(amax, 6 * 2**-126) / 6))``, the byte is the
  biased exponent.

Each element is ``x / scale`` (fp32 division) clamped to ±6 and rounded to the nearest E2M1 value, ties to
the even code. NaN / inf / -0 follow the package policy (:mod:`deepseek_v41.quant`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from deepseek_v41 import kernels
from deepseek_v41.quant.formats import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    E4M3_NAN,
    ScaleFormat,
    check_blocks,
    check_codes,
    check_scale_format,
    device_constant,
    e4m3_decode,
    ue8m0_decode,
    ue8m0_encode_ceil,
)
from deepseek_v41.quant.ste import straight_through

# The UE8M0 amax floor keeps the scale at or above 2**-126 (byte 1), the smallest normal fp32 power of two.
_UE8M0_AMAX_FLOOR = E2M1_MAX * 2.0**-126


def quantize_fp4(x: Tensor, block_size: int, scale_format: ScaleFormat) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` [..., n] (any float dtype, any device) to block-scaled FP4 E2M1.

    Returns ``(codes, scales)``: codes uint8 [..., n // 2] (element 2i in the low nibble), scales uint8
    [..., n // block_size] (E4M3FN bits for ``"e4m3"``, the UE8M0 biased exponent for ``"ue8m0"``).
    Raises ValueError when ``x`` is not floating point, ``n`` is not a multiple of ``block_size`` or of 2,
    or ``scale_format`` is unknown. Source: MODEL_REFERENCE.md §4.
    """
    if _fast(x, block_size, scale_format):
        return kernels.fp4_quantize(x.float(), block_size, scale_format)[:2]
    q, scale_bytes, _ = _quantize_blocks(x, block_size, scale_format)
    return _pack_nibbles(_e2m1_code(q.flatten(-2))), scale_bytes


def dequantize_fp4(
    codes: Tensor,
    scales: Tensor,
    block_size: int,
    scale_format: ScaleFormat,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Decode ``codes`` uint8 [..., n // 2] and ``scales`` uint8 [..., n // block_size] to ``dtype`` [..., n].

    A NaN scale (E4M3 0x7F / 0xFF, UE8M0 255) decodes its whole block to NaN. Raises ValueError on
    non-uint8 inputs, shapes that do not fit ``block_size``, or an unknown ``scale_format``.
    Source: MODEL_REFERENCE.md §4.
    """
    fmt = check_scale_format(scale_format)
    n = check_codes(codes, scales, block_size, elements_per_byte=2)
    if block_size % 2 == 0 and codes.numel() > 0 and kernels.usable(codes, scales):
        return kernels.fp4_dequantize(codes, scales, block_size, fmt).to(dtype)
    values = _decode_bytes(codes).unflatten(-1, (n // block_size, block_size))
    scale = e4m3_decode(scales) if fmt == "e4m3" else ue8m0_decode(scales)
    return (values * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def fake_quant_fp4(x: Tensor, block_size: int, scale_format: ScaleFormat) -> Tensor:
    """``dequantize_fp4(*quantize_fp4(x, ...))`` computed in fp32 and cast back to ``x.dtype``, without
    packing; same shape, dtype and device as ``x`` (``meta`` included). The gradient is straight-through
    (identity). Raises ValueError as :func:`quantize_fp4`. Source: MODEL_REFERENCE.md §4.
    """
    return straight_through(
        x, functools.partial(_fake_quant, block_size=block_size, scale_format=scale_format)
    )


def _fake_quant(x: Tensor, block_size: int, scale_format: ScaleFormat) -> Tensor:
    if _fast(x, block_size, scale_format):
        return kernels.fp4_quantize(x.float(), block_size, scale_format, codes=False, values=True)[2].to(x.dtype)
    q, _, scale = _quantize_blocks(x, block_size, scale_format)
    return (q * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)


def _quantize_blocks(x: Tensor, block_size: int, scale_format: ScaleFormat) -> tuple[Tensor, Tensor, Tensor]:
    """The one FP4 rounding: ``x`` [..., n] -> (q float32 [..., n/b, b] on the signed E2M1 grid, scale bytes
    uint8 [..., n/b], scales float32 [..., n/b]). ``q`` is +0 for zeros and for blocks with a NaN scale."""
    fmt = check_scale_format(scale_format)
    blocks = check_blocks(x, block_size, pairs=True)
    xb = x.float().reshape(*x.shape[:-1], blocks, block_size)
    amax = xb.abs().amax(-1)  # NaN propagates: a NaN anywhere makes the block's scale NaN
    if fmt == "e4m3":
        scale_bytes = (amax / E2M1_MAX).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
        scale_bytes = torch.where(amax.isnan(), E4M3_NAN, scale_bytes.view(torch.uint8))
        scale = e4m3_decode(scale_bytes)
    else:
        scale_bytes = ue8m0_encode_ceil(amax.clamp(min=_UE8M0_AMAX_FLOOR) / E2M1_MAX)
        scale = ue8m0_decode(scale_bytes)
    q = _round_e2m1((xb / scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
    return q, scale_bytes, scale


def _fast(x: Tensor, block_size: int, scale_format: ScaleFormat) -> bool:
    """Whether the fused CPU kernel quantizes ``x`` (after the torch code's checks, so errors are the same): a
    float dtype that widens exactly to fp32 (the torch code rounds in fp32 too), at least one element (the kernels
    refuse empty tensors; the torch code takes them)."""
    check_scale_format(scale_format)
    check_blocks(x, block_size, pairs=True)
    return block_size % 2 == 0 and x.dtype in kernels.WIDENS_TO_FP32 and x.numel() > 0 and kernels.usable(x)


def _round_e2m1(y: Tensor) -> Tensor:
    """Nearest E2M1 value of float32 ``y`` in [-6, 6], ties to the even code; -0 and NaN become +0."""
    a = y.abs()
    # The grid spacing is 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6]. Dividing by that power of two is exact
    # and puts the grid on the integers with the code's parity, so torch.round's ties-to-even is RNE here.
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    q = torch.round(y / step) * step
    return torch.where((q == 0) | q.isnan(), 0.0, q)


def _e2m1_code(q: Tensor) -> Tensor:
    """uint8 E2M1 code of float32 values already on the grid (+0 for zero)."""
    a = q.abs()
    # Inverse of _e2m1_value: index 2a below 2, a + 2 on [2, 4), a / 2 + 4 for 4 and 6.
    index = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a * 0.5 + 4)).to(torch.uint8)
    return index | ((q < 0).to(torch.uint8) << 3)


def _e2m1_value(code: Tensor) -> Tensor:
    """float32 value of uint8 E2M1 codes (only the low 4 bits are read); code 8 is -0."""
    m = (code & 7).float()
    magnitude = torch.where(m < 4, m * 0.5, torch.where(m < 6, m - 2, m * 2 - 8))
    return torch.where((code & 8) != 0, -magnitude, magnitude)


def _decode_bytes(packed: Tensor) -> Tensor:
    """float32 [..., 2n] of packed E2M1 bytes [..., n]: one lookup per byte in a 256 x 2 table (low nibble
    first), the same values as :func:`_e2m1_value` on each nibble, in a fraction of the elementwise work. The
    table's two float32 of a byte are read as one 8-byte integer (``index_select`` with int32 indices: several
    times faster on CPU than ``take`` or indexing with int64 ones), half the gathers of reading them one by one;
    the bits are copied, never computed on."""
    table = device_constant("e2m1 byte values", packed.device,  # [256, 2]
                            lambda: _e2m1_value(_unpack_nibbles(torch.arange(256, dtype=torch.uint8)[:, None])))
    if packed.device.type == "meta":
        return table[packed.long()].flatten(-2)
    pairs = table.view(torch.int64).view(256).index_select(0, packed.reshape(-1).int())
    return pairs.view(packed.shape).view(torch.float32)  # explicit shape: -1 is ambiguous for zero elements


def _pack_nibbles(codes: Tensor) -> Tensor:
    pairs = codes.unflatten(-1, (codes.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
