"""Quantization codecs of DeepSeek-V4.1-Flash: FP4 E2M1 and FP8 E4M3FN blocks with E4M3 / UE8M0 scales,
fake-quant for training, the checkpoint weight formats and the KV-cache byte layouts (MODEL_REFERENCE.md §4).

Rounding is round-to-nearest-even everywhere; UE8M0 scales round up to a power of two. The codecs are torch
only (``ml_dtypes`` is the tests' oracle, never imported here) and run on any device, ``meta`` included.

NaN / inf / -0 policy (pinned by ``tests/quant``), so that a corrupted value never decodes as a finite one:

- ``-0.0``, and any value that rounds to zero, is stored as ``+0`` (code 0) — "−0 encoded as +0".
- A NaN anywhere in a block makes the block's scale NaN (E4M3 byte 0x7F, UE8M0 byte 255) and all its element
  codes 0, so the whole block decodes to NaN; other blocks are untouched.
- ±inf saturate where the scale can hold them: with E4M3 scales (main KV FP4) the scale clamps to 448 and
  the inf becomes ±6 (code 0x7 / 0xF), decoding to ±2688; the block's other values quantize against 448.
  With UE8M0 scales (indexer FP4, FP8 blocks, checkpoint weights) an infinite amax gives scale byte 255 = NaN,
  the codes are 0 and the block decodes to NaN.
- UE8M0 byte ``b`` decodes to ``2**(b - 127)``: byte 0 is ``2**-127`` (used only for all-zero weight
  blocks, so it also reads as zero where loaders treat byte 0 as zero), byte 255 is NaN.
"""

from deepseek_v41.quant.fp4 import dequantize_fp4, fake_quant_fp4, quantize_fp4
from deepseek_v41.quant.fp8 import dequantize_fp8, fake_quant_fp8, quantize_fp8, quantize_fp8_values
from deepseek_v41.quant.layout import (
    pack_index_entry,
    pack_main_entry,
    pack_window_row,
    unpack_index_entry,
    unpack_main_entry,
    unpack_window_row,
)
from deepseek_v41.quant.weights import (
    dequantize_fp4_expert_weight,
    dequantize_fp8_weight,
    quantize_fp4_expert_weight,
    quantize_fp8_weight,
)

__all__ = [
    "dequantize_fp4",
    "dequantize_fp4_expert_weight",
    "dequantize_fp8",
    "dequantize_fp8_weight",
    "fake_quant_fp4",
    "fake_quant_fp8",
    "pack_index_entry",
    "pack_main_entry",
    "pack_window_row",
    "quantize_fp4",
    "quantize_fp4_expert_weight",
    "quantize_fp8",
    "quantize_fp8_values",
    "quantize_fp8_weight",
    "unpack_index_entry",
    "unpack_main_entry",
    "unpack_window_row",
]
