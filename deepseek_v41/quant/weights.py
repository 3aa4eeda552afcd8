"""Checkpoint weight formats (MODEL_REFERENCE.md §4, §8).

- Dense weights: FP8 E4M3FN ``[out, in]`` with one UE8M0 scale (``torch.float8_e8m0fnu``) per 32×32 block,
  ``scale = 2**ceil(log2(amax / 448))``; the scale grid is ``[ceil(out / 32), ceil(in / 32)]`` and the edge
  blocks are partial (their amax is taken over the elements that exist). An all-zero block gets scale byte 0
  (``2**-127``), which decodes to zero also under loaders that read byte 0 as zero.
- Routed experts: FP4 E2M1 packed two per byte ``[out, in / 2]`` as ``torch.int8`` (element 2i in the low
  nibble), one UE8M0 scale per 1×32 block along the input dimension, ``[out, in / 32]``; the codec is
  :func:`~deepseek_v41.quant.fp4.quantize_fp4` with ``scale_format="ue8m0"``.

NaN / inf / -0 follow the package policy (:mod:`deepseek_v41.quant`): a block holding a NaN or an inf gets
scale byte 255 (NaN) and codes 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from deepseek_v41.quant.formats import E4M3_MAX, e4m3_encode, ue8m0_decode, ue8m0_encode_ceil
from deepseek_v41.quant.fp4 import dequantize_fp4, quantize_fp4

FP4_EXPERT_BLOCK = 32


def quantize_fp8_weight(w: Tensor, block: tuple[int, int] = (32, 32)) -> tuple[Tensor, Tensor]:
    """Quantize a dense weight ``w`` [out, in] (any float dtype) to the checkpoint's FP8 format.

    Returns ``(weight, scale)``: weight ``torch.float8_e4m3fn`` [out, in], scale ``torch.float8_e8m0fnu``
    [ceil(out / block[0]), ceil(in / block[1])]. Raises ValueError when ``w`` is not a 2-D floating-point
    tensor or ``block`` is not two positive ints. Source: MODEL_REFERENCE.md §4, §8.
    """
    _check_weight(w, "w")
    rows, cols = _check_block(block)
    out, inp = w.shape
    grid = (-(-out // rows), -(-inp // cols))
    # Zero padding leaves each partial edge block's amax unchanged.
    padded = F.pad(w.float(), (0, grid[1] * cols - inp, 0, grid[0] * rows - out))
    blocks = padded.reshape(grid[0], rows, grid[1], cols)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_bytes = ue8m0_encode_ceil(amax / E4M3_MAX)
    scale = ue8m0_decode(scale_bytes)[:, None, :, None]
    codes = e4m3_encode((blocks / scale).clamp(-E4M3_MAX, E4M3_MAX))
    weight = codes.reshape(grid[0] * rows, grid[1] * cols)[:out, :inp].contiguous()
    return weight.view(torch.float8_e4m3fn), scale_bytes.view(torch.float8_e8m0fnu)


def dequantize_fp8_weight(
    weight: Tensor, scale: Tensor, block: tuple[int, int] = (32, 32), dtype: torch.dtype = torch.float32
) -> Tensor:
    """Decode an FP8 checkpoint weight to ``dtype`` [out, in].

    ``weight``: ``torch.float8_e4m3fn`` [out, in]; ``scale``: ``torch.float8_e8m0fnu`` (byte 255 is NaN) or
    ``torch.float32`` (the value itself), [ceil(out / block[0]), ceil(in / block[1])]. Raises ValueError on
    other dtypes or shapes. Source: MODEL_REFERENCE.md §4, §8.
    """
    if not isinstance(weight, Tensor) or weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor, got {_describe(weight)}")
    rows, cols = _check_block(block)
    out, inp = weight.shape
    grid = (-(-out // rows), -(-inp // cols))
    if not isinstance(scale, Tensor) or scale.dtype not in (torch.float8_e8m0fnu, torch.float32):
        raise ValueError(f"scale must be float8_e8m0fnu or float32, got {_describe(scale)}")
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not fit weight {(out, inp)}: expected {grid}"
        )
    scale = ue8m0_decode(scale.view(torch.uint8)) if scale.dtype == torch.float8_e8m0fnu else scale
    full = scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inp]
    return (weight.float() * full).to(dtype)


def quantize_fp4_expert_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize a routed-expert weight ``w`` [out, in] (any float dtype) to the checkpoint's FP4 format.

    Returns ``(packed, scale)``: packed ``torch.int8`` [out, in // 2] (E2M1 codes, element 2i in the low
    nibble), scale ``torch.float8_e8m0fnu`` [out, in // 32]. Raises ValueError when ``w`` is not a 2-D
    floating-point tensor or ``in`` is not a multiple of 32. Source: MODEL_REFERENCE.md §4, §8.
    """
    _check_weight(w, "w")
    codes, scale_bytes = quantize_fp4(w, FP4_EXPERT_BLOCK, "ue8m0")
    return codes.view(torch.int8), scale_bytes.view(torch.float8_e8m0fnu)


def dequantize_fp4_expert_weight(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode a routed-expert weight: ``packed`` int8 or uint8 [out, in // 2], ``scale`` float8_e8m0fnu or
    uint8 [out, in // 32] -> ``dtype`` [out, in]. Raises ValueError on other dtypes or shapes.
    Source: MODEL_REFERENCE.md §4, §8.
    """
    if not isinstance(packed, Tensor) or packed.dtype not in (torch.int8, torch.uint8) or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D int8 or uint8 tensor, got {_describe(packed)}")
    if not isinstance(scale, Tensor) or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"scale must be float8_e8m0fnu or uint8, got {_describe(scale)}")
    return dequantize_fp4(
        packed.view(torch.uint8), scale.view(torch.uint8), FP4_EXPERT_BLOCK, "ue8m0", dtype=dtype
    )


def _check_weight(w: Tensor, name: str) -> None:
    if not isinstance(w, Tensor) or not w.is_floating_point() or w.dim() != 2:
        raise ValueError(f"{name} must be a 2-D floating-point tensor [out, in], got {_describe(w)}")


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if (
        not isinstance(block, (tuple, list))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"block must be two positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__
