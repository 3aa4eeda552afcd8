"""Byte layouts of the serving KV cache: ``codes | scales`` in one uint8 row (MODEL_REFERENCE.md §4, §5).

For a width of ``d`` channels, with the byte counts at the model's widths:

- main compressed KV entry: ``d / 2`` FP4 E2M1 code bytes (element 2i in the low nibble), then ``d / 16``
  E4M3FN scale bytes (one per 16 channels) — 256 + 32 = 288 for d = 512;
- index key entry: ``d / 2`` FP4 E2M1 code bytes, then ``d / 32`` UE8M0 scale bytes — 64 + 4 = 68 for
  d = 128;
- window row: ``d`` FP8 E4M3FN code bytes, then ``d / 32`` UE8M0 scale bytes — 512 + 16 = 528 for d = 512.

The codes and scales are the outputs of :func:`~deepseek_v41.quant.fp4.quantize_fp4` /
:func:`~deepseek_v41.quant.fp8.quantize_fp8`; these functions only place bytes. All are generic in ``d``
and in the leading dimensions.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Code bytes per scale byte: the block size times the bytes one element's code takes.
_MAIN_CODES_PER_SCALE = 16 // 2
_INDEX_CODES_PER_SCALE = 32 // 2
_WINDOW_CODES_PER_SCALE = 32


def pack_main_entry(codes: Tensor, scales: Tensor) -> Tensor:
    """Main KV entries: ``codes`` uint8 [..., d/2] (FP4) and ``scales`` uint8 [..., d/16] (E4M3) ->
    uint8 [..., 9d/16] (288 bytes for d = 512), codes first. Raises ValueError on mismatched inputs."""
    return _pack(codes, scales, _MAIN_CODES_PER_SCALE, "main entry")


def unpack_main_entry(entry: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`pack_main_entry`: uint8 [..., 9d/16] -> (codes [..., d/2], scales [..., d/16]).
    Raises ValueError when the last dimension is not a whole number of 9-byte groups."""
    return _unpack(entry, _MAIN_CODES_PER_SCALE, "main entry")


def pack_index_entry(codes: Tensor, scales: Tensor) -> Tensor:
    """Index key entries: ``codes`` uint8 [..., d/2] (FP4) and ``scales`` uint8 [..., d/32] (UE8M0) ->
    uint8 [..., 17d/32] (68 bytes for d = 128), codes first. Raises ValueError on mismatched inputs."""
    return _pack(codes, scales, _INDEX_CODES_PER_SCALE, "index entry")


def unpack_index_entry(entry: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`pack_index_entry`: uint8 [..., 17d/32] -> (codes [..., d/2], scales [..., d/32]).
    Raises ValueError when the last dimension is not a whole number of 17-byte groups."""
    return _unpack(entry, _INDEX_CODES_PER_SCALE, "index entry")


def pack_window_row(codes: Tensor, scales: Tensor) -> Tensor:
    """Window rows: ``codes`` uint8 [..., d] (FP8 E4M3) and ``scales`` uint8 [..., d/32] (UE8M0) ->
    uint8 [..., 33d/32] (528 bytes for d = 512), codes first. Raises ValueError on mismatched inputs."""
    return _pack(codes, scales, _WINDOW_CODES_PER_SCALE, "window row")


def unpack_window_row(entry: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`pack_window_row`: uint8 [..., 33d/32] -> (codes [..., d], scales [..., d/32]).
    Raises ValueError when the last dimension is not a whole number of 33-byte groups."""
    return _unpack(entry, _WINDOW_CODES_PER_SCALE, "window row")


def _pack(codes: Tensor, scales: Tensor, codes_per_scale: int, what: str) -> Tensor:
    for name, t in (("codes", codes), ("scales", scales)):
        if not isinstance(t, Tensor) or t.dtype != torch.uint8 or t.dim() == 0:
            raise ValueError(f"{what}: {name} must be a uint8 tensor with a last dimension")
    if codes.shape[:-1] != scales.shape[:-1] or codes.shape[-1] != codes_per_scale * scales.shape[-1]:
        raise ValueError(
            f"{what}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not fit; "
            f"expected {codes_per_scale} code bytes per scale byte and equal leading dimensions"
        )
    return torch.cat((codes, scales), dim=-1)


def _unpack(entry: Tensor, codes_per_scale: int, what: str) -> tuple[Tensor, Tensor]:
    if not isinstance(entry, Tensor) or entry.dtype != torch.uint8 or entry.dim() == 0:
        raise ValueError(f"{what}: expected a uint8 tensor with a last dimension")
    group = codes_per_scale + 1
    if entry.shape[-1] % group:
        raise ValueError(f"{what}: {entry.shape[-1]} bytes are not a whole number of {group}-byte groups")
    code_bytes = entry.shape[-1] // group * codes_per_scale
    return entry[..., :code_bytes], entry[..., code_bytes:]
