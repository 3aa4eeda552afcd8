"""Independent numpy + ml_dtypes reference of the codecs (the test oracle; MODEL_REFERENCE.md §4).

Scales are computed in numpy (``np.frexp`` for an exact ``ceil(log2)``), elements are cast by ml_dtypes.
Where ml_dtypes and the package's documented NaN / -0 policy differ, the oracle's raw output is mapped
through the policy explicitly (see ``_policy_fp4`` / ``_policy_e4m3``): ml_dtypes keeps ``-0`` as its own
code (E2M1 8, E4M3 0x80) and casts NaN to a code (E2M1 0 or 8 by the NaN's sign, E4M3 0x7F / 0xFF), whereas
the package stores ``+0`` and code 0 in a block whose scale is NaN.
"""

from __future__ import annotations

import numpy as np
from optional_deps import require

F32 = np.float32


def mld():
    """The ml_dtypes module (skips, or fails under CI=true, when it is missing)."""
    return require("ml_dtypes")


def ceil_log2(v: np.ndarray) -> np.ndarray:
    """Exact ceil(log2 v) of finite positive values (float64 holds every float32 exactly)."""
    mantissa, exponent = np.frexp(np.asarray(v, np.float64))
    return np.where(mantissa == 0.5, exponent - 1, exponent)


def ue8m0_ref(v: np.ndarray) -> np.ndarray:
    """UE8M0 byte of the smallest power of two >= v: clamp(ceil(log2 v) + 127, 0, 255); 0 -> 0; NaN/inf -> 255
    (255 is NaN: a quotient above 2**127 has no UE8M0 power of two, so it is NaN as well)."""
    v = np.asarray(v, np.float32)
    finite_pos = np.isfinite(v) & (v > 0)
    safe = np.where(finite_pos, v, F32(1))
    byte = np.clip(ceil_log2(safe) + 127, 0, 255)
    byte = np.where(v == 0, 0, byte)
    return np.where(np.isfinite(v), byte, 255).astype(np.uint8)


def ue8m0_value(byte: np.ndarray) -> np.ndarray:
    """float32 value of UE8M0 bytes, via ml_dtypes' float8_e8m0fnu (255 -> NaN)."""
    return np.asarray(byte, np.uint8).view(mld().float8_e8m0fnu).astype(np.float32)


def e4m3_value(byte: np.ndarray) -> np.ndarray:
    return np.asarray(byte, np.uint8).view(mld().float8_e4m3fn).astype(np.float32)


def _policy_e4m3(raw: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Policy: -0 (0x80) is stored as +0, and a NaN element (only in a NaN-scaled block) as code 0.
    return np.where((raw == 0x80) | np.isnan(y), 0, raw).astype(np.uint8)


def _policy_fp4(raw: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Policy: -0 (code 8) is stored as +0, and a NaN element (only in a NaN-scaled block) as code 0.
    return np.where((raw == 8) | np.isnan(y), 0, raw).astype(np.uint8)


def fp4_ref(x: np.ndarray, block: int, scale_format: str) -> tuple[np.ndarray, np.ndarray]:
    """Unpacked E2M1 codes uint8 [..., n] and scale bytes uint8 [..., n / block] of float32 ``x``."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(*x.shape[:-1], -1, block)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.abs(xb).max(-1)
        if scale_format == "e4m3":
            s = np.clip(amax / F32(6), F32(2**-9), F32(448)).astype(np.float32)
            raw = s.astype(mld().float8_e4m3fn).view(np.uint8)
            scale_bytes = np.where(np.isnan(amax), 0x7F, raw).astype(np.uint8)
            scale = e4m3_value(scale_bytes)
        else:
            scale_bytes = ue8m0_ref(np.maximum(amax, F32(6 * 2.0**-126)) / F32(6))
            scale = ue8m0_value(scale_bytes)
        y = np.clip(xb / scale[..., None], F32(-6), F32(6)).astype(np.float32)
        raw = y.astype(mld().float4_e2m1fn).view(np.uint8)
    return _policy_fp4(raw, y).reshape(x.shape), scale_bytes


def fp4_pack_ref(codes: np.ndarray) -> np.ndarray:
    """Two codes per byte, element 2i in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def fp4_value_ref(codes: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    values = np.asarray(codes, np.uint8).view(mld().float4_e2m1fn).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # 4 * 2**126 is inf in fp32, as in the product
        vb = values.reshape(*values.shape[:-1], -1, block) * scale[..., None]
    return vb.reshape(values.shape)


def fp8_ref(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """E4M3 bytes uint8 [..., n] and UE8M0 scale bytes uint8 [..., n / block] of float32 ``x``."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(*x.shape[:-1], -1, block)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.abs(xb).max(-1)
        scale_bytes = ue8m0_ref(np.maximum(amax, F32(1e-4)) / F32(448))
        y = np.clip(xb / ue8m0_value(scale_bytes)[..., None], F32(-448), F32(448)).astype(np.float32)
        raw = y.astype(mld().float8_e4m3fn).view(np.uint8)
    return _policy_e4m3(raw, y).reshape(x.shape), scale_bytes


def fp8_weight_ref(w: np.ndarray, block: tuple[int, int] = (32, 32)) -> tuple[np.ndarray, np.ndarray]:
    """E4M3 bytes uint8 [out, in] and UE8M0 bytes uint8 [ceil(out/b0), ceil(in/b1)] of a float32 weight,
    block by block (partial edge blocks are just smaller slices)."""
    w = np.asarray(w, np.float32)
    b0, b1 = block
    grid = (-(-w.shape[0] // b0), -(-w.shape[1] // b1))
    codes = np.zeros(w.shape, np.uint8)
    scale_bytes = np.zeros(grid, np.uint8)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for i in range(grid[0]):
            for j in range(grid[1]):
                tile = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
                byte = ue8m0_ref(np.abs(tile).max() / F32(448))
                y = np.clip(tile / ue8m0_value(byte), F32(-448), F32(448)).astype(np.float32)
                raw = y.astype(mld().float8_e4m3fn).view(np.uint8)
                codes[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = _policy_e4m3(raw, y)
                scale_bytes[i, j] = byte
    return codes, scale_bytes
