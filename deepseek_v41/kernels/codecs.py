"""FP8 / FP4 blocks and paged FP4 entries (``csrc/codecs.c``): quantization and decoding of rows in the formats of
MODEL_REFERENCE.md §4, and the compressed entries' gather / scatter through block tables; the bits of
deepseek_v41/quant and cache/paged_context.py."""

from __future__ import annotations

import ctypes

import torch

from deepseek_v41.kernels.checks import empty, ptr
from deepseek_v41.kernels.loader import library, register

FP4_FORMATS = {"e4m3": 0, "ue8m0": 1}
# Input dtypes the codec kernels take after widening to fp32 (exact), as the torch codecs widen them too.
WIDENS_TO_FP32 = (torch.float32, torch.bfloat16, torch.float16)

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "dsv41_fp8_quantize": ([_P, _I, _I, _P, _P, _P], None),
    "dsv41_fp8_dequantize": ([_P, _P, _I, _I, _P], None),
    "dsv41_fp4_quantize": ([_P, _I, _I, _I, ctypes.c_int, _P, _P, _P], None),
    "dsv41_fp4_dequantize": ([_P, _P, _I, _I, _I, ctypes.c_int, _P], None),
    "dsv41_fp4_gather": ([_P, _P, _I, _I, _I, _I, ctypes.c_int, _P, _I, _I, _I, _P, _I, _I, _P], ctypes.c_int),
    "dsv41_fp4_scatter": ([_P, _P, _I, _I, _I, _I, ctypes.c_int, _P, _I, _I, _I, _P, _P, _I, _I, _P], _I),
}
register(SIGNATURES)


def fp8_quantize_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 E4M3FN blocks of 32 with UE8M0 scales of fp32 ``x`` [..., n]: ``(codes uint8 [..., n], scales uint8
    [..., n / 32], values fp32 [..., n])``, the bits of :func:`deepseek_v41.quant.quantize_fp8_values`."""
    if not x.numel():
        empty("fp8_quantize", x=x)
    n = x.shape[-1]
    codes = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty((*x.shape[:-1], n // 32), dtype=torch.uint8)
    values = torch.empty(x.shape, dtype=torch.float32)
    library().dsv41_fp8_quantize(x.data_ptr(), x.numel() // max(n, 1), n, codes.data_ptr(), scales.data_ptr(),
                                 values.data_ptr())
    return codes, scales, values


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., n] of FP8 ``codes`` uint8 [..., n] and UE8M0 ``scales`` [..., n / 32]."""
    if not (codes.numel() and scales.numel()):
        empty("fp8_dequantize", codes=codes, scales=scales)
    n = codes.shape[-1]
    out = torch.empty(codes.shape, dtype=torch.float32)
    library().dsv41_fp8_dequantize(codes.data_ptr(), scales.data_ptr(), codes.numel() // max(n, 1), n, out.data_ptr())
    return out


def fp4_quantize(x: torch.Tensor, block: int, fmt: str, codes: bool = True, values: bool = False
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """FP4 E2M1 blocks of fp32 ``x`` [..., n]: ``(codes uint8 [..., n / 2], scales uint8 [..., n / block],
    values fp32 [..., n])``, each None unless asked for (scales come with codes); the bits of
    :func:`deepseek_v41.quant.quantize_fp4` / ``fake_quant_fp4``."""
    if not x.numel():
        empty("fp4_quantize", x=x)
    n = x.shape[-1]
    c = torch.empty((*x.shape[:-1], n // 2), dtype=torch.uint8) if codes else None
    s = torch.empty((*x.shape[:-1], n // block), dtype=torch.uint8) if codes else None
    v = torch.empty(x.shape, dtype=torch.float32) if values else None
    library().dsv41_fp4_quantize(x.data_ptr(), x.numel() // max(n, 1), n, block, FP4_FORMATS[fmt], ptr(c),
                                 ptr(s), ptr(v))
    return c, s, v


def fp4_dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str) -> torch.Tensor:
    """fp32 [..., n] of packed FP4 ``codes`` uint8 [..., n / 2] and ``scales`` uint8 [..., n / block]."""
    if not (codes.numel() and scales.numel()):
        empty("fp4_dequantize", codes=codes, scales=scales)
    n = codes.shape[-1] * 2
    out = torch.empty((*codes.shape[:-1], n), dtype=torch.float32)
    library().dsv41_fp4_dequantize(codes.data_ptr(), scales.data_ptr(), codes.numel() // max(n // 2, 1), n, block,
                                   FP4_FORMATS[fmt], out.data_ptr())
    return out


# ------------------------------------------------------------------------------------------- paged KV cache
def fp4_gather(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str, tables: torch.Tensor, ratio: int,
               block_size: int, idx: torch.Tensor) -> torch.Tensor:
    """Entries ``idx`` int64 [B, ...] (-1 = none: zeros) of an FP4 pool (codes uint8 [pages, per_page, w / 2],
    scales [pages, per_page, w / block]) through block tables int64 [B, width], decoded: fp32 [B, ..., w].
    Raises IndexError when an entry lies past its block table."""
    if not (tables.numel() and idx.numel()):
        empty("fp4_gather", tables=tables, idx=idx)
    pages, per_page, half = codes.shape
    width = 2 * half
    out = torch.empty((*idx.shape, width), dtype=torch.float32)
    B = idx.shape[0]
    status = library().dsv41_fp4_gather(codes.data_ptr(), scales.data_ptr(), pages, per_page, width, block,
                                        FP4_FORMATS[fmt], tables.data_ptr(), tables.shape[1], ratio, block_size,
                                        idx.data_ptr(), B, idx.numel() // max(B, 1), out.data_ptr())
    if status != 0:
        raise IndexError("an entry index lies past its block table")
    return out


def fp4_scatter(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: str, tables: torch.Tensor, ratio: int,
                block_size: int, group: torch.Tensor, write_from: torch.Tensor, x: torch.Tensor) -> int:
    """Quantize entries ``x`` fp32 [B, G, w] of groups ``group`` int64 [B, G] into an FP4 pool (as
    :func:`fp4_gather` reads it), skipping groups below 0 or whose position ``g * ratio`` is below
    ``write_from`` int64 [B]. Returns the number of entries written. Raises IndexError as :func:`fp4_gather`."""
    if not (tables.numel() and group.numel() and write_from.numel() and x.numel()):
        empty("fp4_scatter", tables=tables, group=group, write_from=write_from, x=x)
    pages, per_page, half = codes.shape
    B, G = group.shape
    written = library().dsv41_fp4_scatter(codes.data_ptr(), scales.data_ptr(), pages, per_page, 2 * half, block,
                                          FP4_FORMATS[fmt], tables.data_ptr(), tables.shape[1], ratio, block_size,
                                          group.data_ptr(), write_from.data_ptr(), B, G, x.data_ptr())
    if written < 0:
        raise IndexError("an entry group lies past its block table")
    return written
