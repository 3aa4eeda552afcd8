"""Element and scale byte formats shared by the FP4 / FP8 codecs, and their input checks
(MODEL_REFERENCE.md §4).

- UE8M0: an unsigned power of two, byte ``b`` means ``2**(b - 127)``; byte 255 is NaN. Encoded from the
  fp32 bit pattern (biased exponent, +1 when the mantissa is non-zero), which is an exact ``ceil(log2 v)``:
  float ``log2`` rounds wrongly next to powers of two, and torch's ``float8_e8m0fnu`` cast maps 0 to
  ``2**-127`` and drops signs, so neither is used.
- E4M3FN: torch's ``float8_e4m3fn`` cast (round-to-nearest-even, subnormals included, saturating to ±448),
  with the package's policy applied on top: ``-0`` is stored as ``+0`` and NaN as code 0 (the block scale
  carries the NaN, see :mod:`deepseek_v41.quant`).

All functions are elementwise, vectorised and run on any device, ``meta`` included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
from torch import Tensor

ScaleFormat = Literal["e4m3", "ue8m0"]
SCALE_FORMATS: tuple[str, ...] = get_args(ScaleFormat)

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E4M3_NAN = 0x7F  # the NaN byte of a block scale (the cast may also give 0xFF; the policy pins 0x7F)
UE8M0_NAN = 255

_F32_MANTISSA_BITS = 23
_F32_MANTISSA_MASK = (1 << _F32_MANTISSA_BITS) - 1
_F32_HALF_MIN_NORMAL_MANTISSA = 1 << (_F32_MANTISSA_BITS - 1)  # mantissa of the subnormal 2**-127
_F32_QUIET_NAN_BITS = 0x7FC00000


def check_scale_format(scale_format: str) -> ScaleFormat:
    """Return ``scale_format`` when it is one of :data:`SCALE_FORMATS`; raise ValueError otherwise."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"unknown scale_format {scale_format!r}; expected one of {SCALE_FORMATS}")
    return scale_format  # type: ignore[return-value]


def check_blocks(x: Tensor, block_size: int, *, pairs: bool) -> int:
    """Check a codec input ``x`` [..., n]; return the number of blocks ``n // block_size``.

    Raises ValueError when ``x`` is not a floating-point tensor with at least one dimension, when
    ``block_size`` is not a positive int, when ``n`` is not a multiple of ``block_size``, or (``pairs``:
    FP4 packs two codes per byte) when ``n`` is odd.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"expected a floating-point tensor to quantize, got {got}")
    if x.dim() == 0:
        raise ValueError("expected a tensor whose last dimension holds the channels, got a 0-d tensor")
    _check_block_size(block_size)
    n = x.shape[-1]
    if n % block_size:
        raise ValueError(f"last dimension {n} is not a multiple of block_size {block_size}")
    if pairs and n % 2:
        raise ValueError(f"last dimension {n} is odd; FP4 packs two codes per byte")
    return n // block_size


def check_codes(codes: Tensor, scales: Tensor, block_size: int, *, elements_per_byte: int) -> int:
    """Check a dequantizer's inputs: ``codes`` uint8 [..., n / elements_per_byte], ``scales`` uint8
    [..., n / block_size]; return ``n``. Raises ValueError on another dtype, a 0-d ``codes``, or shapes
    that do not fit together."""
    for name, t in (("codes", codes), ("scales", scales)):
        if not isinstance(t, Tensor) or t.dtype != torch.uint8:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a uint8 tensor, got {got}")
    if codes.dim() == 0:
        raise ValueError("codes must have a last dimension holding the packed channels, got a 0-d tensor")
    _check_block_size(block_size)
    n = codes.shape[-1] * elements_per_byte
    if n % block_size:
        raise ValueError(f"{n} channels are not a multiple of block_size {block_size}")
    expected = (*codes.shape[:-1], n // block_size)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"scales shape {tuple(scales.shape)} does not fit codes shape {tuple(codes.shape)}: "
            f"expected {expected} for block_size {block_size}"
        )
    return n


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def ue8m0_encode_ceil(v: Tensor) -> Tensor:
    """UE8M0 byte of the smallest power of two ``>= v``: ``clamp(ceil(log2 v) + 127, 0, 255)``.

    ``v``: float32, ``v >= 0`` or NaN / +inf (callers pass an absolute maximum divided by a positive
    constant). Returns uint8 of the same shape. ``v == 0`` and ``v <= 2**-127`` give byte 0; NaN and +inf
    give 255 (NaN). Source: MODEL_REFERENCE.md §4 ("UE8M0 scales round up to a power of two").
    """
    if v.dtype != torch.float32:
        raise ValueError(f"ue8m0_encode_ceil expects float32, got {v.dtype}")
    bits = v.view(torch.int32)
    exponent = (bits >> _F32_MANTISSA_BITS) & 0xFF
    mantissa = bits & _F32_MANTISSA_MASK
    # A normal v = 1.m * 2**(e-127) needs one more power of two unless m is 0. A subnormal v (exponent
    # field 0) lies below 2**-126: it rounds up to 2**-126 (byte 1) only when it exceeds 2**-127.
    normal = exponent + (mantissa != 0).to(torch.int32)
    subnormal = (mantissa > _F32_HALF_MIN_NORMAL_MANTISSA).to(torch.int32)
    byte = torch.where(exponent == 0, subnormal, normal)
    return byte.clamp(max=UE8M0_NAN).to(torch.uint8)


def ue8m0_decode(byte: Tensor) -> Tensor:
    """float32 value ``2**(b - 127)`` of UE8M0 bytes ``b`` (uint8, any shape); byte 255 decodes to NaN and
    byte 0 to the subnormal ``2**-127``. On CPU, CUDA and ``meta`` this is PyTorch's own ``float8_e8m0fnu``
    conversion (one op, the same values); elsewhere it is built from bits, which is exact on every device."""
    if byte.device.type in ("cpu", "cuda", "meta") and not torch.compiler.is_compiling():  # inductor lacks e8m0
        return byte.view(torch.float8_e8m0fnu).float()
    return ue8m0_decode_bits(byte)


def ue8m0_decode_bits(byte: Tensor) -> Tensor:
    """:func:`ue8m0_decode` built from float32 bits (any device; the tests check both agree on all 256 bytes)."""
    b = byte.to(torch.int32)
    bits = torch.where(b == 0, _F32_HALF_MIN_NORMAL_MANTISSA, b << _F32_MANTISSA_BITS)
    bits = torch.where(b == UE8M0_NAN, _F32_QUIET_NAN_BITS, bits)
    return bits.view(torch.float32)


def e4m3_encode(y: Tensor) -> Tensor:
    """E4M3FN bytes (uint8) of float32 ``y``: round-to-nearest-even, saturating at ±448, ``-0`` and any
    value rounding to ``-0`` stored as ``+0`` (0x00), NaN stored as 0x00 (its block scale is NaN)."""
    byte = y.to(torch.float8_e4m3fn).view(torch.uint8)
    # 0x80 is -0; 0x7F / 0xFF are NaN. Both become code 0 under the package's policy.
    low = byte & 0x7F
    return torch.where((low == 0) | (low == 0x7F), 0, byte)


_CONSTANTS: dict[tuple, Tensor] = {}


def device_constant(name: str, device: torch.device, build: Callable[[], Tensor]) -> Tensor:
    """A small constant tensor (a lookup table, an index) built once per ``(name, device)`` by ``build()`` and
    kept; built as a normal tensor even inside ``torch.inference_mode``, so autograd may use it after an engine
    step. On ``meta`` it is built every call and not kept."""
    key = (name, device)
    table = _CONSTANTS.get(key)
    if table is None:
        with torch.inference_mode(False):
            table = build().to(device)
        if device.type != "meta":
            _CONSTANTS[key] = table
    return table


def _e4m3_table() -> Tensor:
    """PyTorch's float32 value of every E4M3FN byte [256]."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def e4m3_decode(byte: Tensor) -> Tensor:
    """float32 value of E4M3FN bytes (uint8, any shape); 0x7F / 0xFF decode to NaN.

    On CPU a lookup in the 256-entry table of PyTorch's own conversion (``index_select`` with int32 indices): the
    element-wise float8 conversion is not vectorized there and costs several times as much; the values are the
    same bits."""
    if byte.device.type == "cpu" and not torch.compiler.is_compiling():
        table = device_constant("e4m3 values", byte.device, _e4m3_table)
        return table.index_select(0, byte.reshape(-1).int()).view(byte.shape)
    return byte.view(torch.float8_e4m3fn).float()
