"""Engram: a hashed n-gram memory added to the hc residual streams of a few encoder layers (ENGRAM.md §8–§11).

Per token, the 24 (in the release) row ids from :mod:`deepseek_v41.model.engram_hash` select rows of a large table;
the concatenated rows go through ``wkv`` into one key per hc stream and one value shared by all streams; a scalar
gate per stream, from the RMS-normalised dot product of the stream and its key, scales the value added to that
stream. Image positions pass through unchanged. Official tensor names under ``layers.L.engram.``: ``embed.weight``,
``embed.scale`` (FP8 tables only), ``wkv.weight``, ``q_weight``, ``k_weight`` (ENGRAM.md §1).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch
from torch import nn

from deepseek_v41.model.engram_hash import EngramHasher, engram_layout
from deepseek_v41.model.linear import Linear
from deepseek_v41.model.norm import upcast
from deepseek_v41.quant import dequantize_fp8

# EngramHasher is re-exported so that the model imports both halves of Engram from one place.
__all__ = ["Engram", "EngramHasher", "EngramTable", "engram_gate"]

TableFormat = Literal["float", "fp8"]
FP8_BLOCK = 32  # table columns per UE8M0 scale byte (ENGRAM.md §8)
GATE_FLOOR = 1e-6  # |dot| clamp inside the sqrt, so dot = 0 still gives sigmoid(+-0.001) (ENGRAM.md §10)


class EngramTable(nn.Module):
    """One Engram layer's table of ``num_rows`` x ``head_dim``, gathered by row id (ENGRAM.md §8).

    ``table_format="float"``: ``weight`` is a trainable parameter of ``dtype`` (init N(0, 1), as nn.Embedding).
    ``table_format="fp8"``: ``weight`` is an E4M3FN buffer and ``scale`` a UE8M0 buffer [num_rows, head_dim / 32]
    (torch ``float8_e4m3fn`` / ``float8_e8m0fnu``; a state dict holding the same bytes as uint8 loads too), left
    uninitialised for the checkpoint loader; a lookup dequantizes only the gathered rows, in fp32.
    Raises ValueError for an unknown format or an FP8 ``head_dim`` that is not a multiple of 32.
    """

    def __init__(self, num_rows: int, head_dim: int, table_format: TableFormat = "float",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if table_format not in get_args(TableFormat):
            raise ValueError(f"table_format must be one of {get_args(TableFormat)}, got {table_format!r}")
        self.table_format = table_format
        self.num_rows, self.head_dim = num_rows, head_dim
        if table_format == "float":
            self.weight = nn.Parameter(torch.empty(num_rows, head_dim, device=device, dtype=dtype))
            self.scale = None
            nn.init.normal_(self.weight)
            return
        if head_dim % FP8_BLOCK:
            raise ValueError(f"an FP8 table needs head_dim divisible by {FP8_BLOCK}, got {head_dim}")
        # torch.empty: the release's tables are 98 GB each; zero-filling them before the load would touch it all.
        self.register_buffer("weight", torch.empty(num_rows, head_dim, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("scale", torch.empty(num_rows, head_dim // FP8_BLOCK, dtype=torch.float8_e8m0fnu,
                                                  device=device))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (int64, any shape [...]) -> [..., head_dim]: the stored dtype for a float table, fp32
        (dequantized ``e4m3 * 2^(scale - 127)``) for an FP8 one."""
        flat = rows.reshape(-1)
        if self.scale is None:
            return self.weight.index_select(0, flat).view(*rows.shape, self.head_dim)
        codes = self.weight.view(torch.uint8).index_select(0, flat)
        scales = self.scale.view(torch.uint8).index_select(0, flat)
        values = dequantize_fp8(codes, scales, block_size=FP8_BLOCK, scale_format="ue8m0", dtype=torch.float32)
        return values.view(*rows.shape, self.head_dim)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # Checkpoint readers without float8 support hand over the raw bytes as uint8: reinterpret, never convert.
        for name in ("weight", "scale"):
            own, key = getattr(self, name), prefix + name
            if own is not None and own.dtype != torch.uint8 and key in state_dict \
                    and state_dict[key].dtype == torch.uint8 and own.dtype.itemsize == 1:
                state_dict[key] = state_dict[key].view(own.dtype)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self.num_rows}, {self.head_dim}, table_format={self.table_format!r}"


def engram_gate(streams: torch.Tensor, key: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-stream gate ``g_i`` in fp32 (ENGRAM.md §10): [..., hc] from ``streams`` and ``key`` [..., hc, D] and
    ``weight`` = q_weight * k_weight [hc, D].

    ``dot_i = sum_c norm(h_i)_c * w_i,c * norm(key_i)_c / sqrt(D)`` with ``norm(x) = x * rsqrt(mean(x^2) + eps)``
    over the D channels of one (token, stream); ``g_i = sigmoid(copysign(sqrt(max(|dot_i|, 1e-6)), dot_i))``.
    """
    h = upcast(streams)
    k = key.to(h.dtype)
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    k = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + eps)
    dot = (h * weight.to(h.dtype) * k).sum(-1) * h.shape[-1] ** -0.5
    return torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_FLOOR).sqrt(), dot))


class Engram(nn.Module):
    """The Engram of layer ``layer_id`` (the real layer index, e.g. 1 or 14): ENGRAM.md §8–§10.

    Submodules and parameters (official names under ``layers.L.engram.``): ``embed`` (:class:`EngramTable`,
    ``engram_num_embeddings[i]`` x ``engram_head_dim``), ``wkv`` (Linear ``n_cols * head_dim -> (hc_mult + 1) *
    hidden_size``, no bias), ``q_weight`` and ``k_weight`` [hc_mult, hidden_size] (init ones: the gate starts as
    a plain normalised dot product). ``dtype`` is the compute dtype: gathered rows are cast to it before ``wkv``.
    Raises ValueError when the layer has no Engram or ``table_format`` is unknown.
    """

    def __init__(self, config: Any, layer_id: int, table_format: TableFormat = "float",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        layout = engram_layout(config)
        self.layer_id = layer_id
        self.table_index = layout.table_index(layer_id)
        self.n_cols = layout.n_cols
        self.hc_mult = config.hc_mult
        self.hidden_size = config.hidden_size
        self.eps = float(config.rms_norm_eps)
        head_dim = config.engram_head_dim
        self.embed = EngramTable(config.engram_num_embeddings[self.table_index], head_dim, table_format,
                                 device=device, dtype=dtype)
        self.wkv = Linear(self.n_cols * head_dim, (self.hc_mult + 1) * self.hidden_size, bias=False,
                             device=device, dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(self.hc_mult, self.hidden_size, device=device, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(self.hc_mult, self.hidden_size, device=device, dtype=dtype))

    def forward(self, streams: torch.Tensor, row_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Add the gated Engram value to every hc stream.

        ``streams``: [batch, seq, hc_mult, hidden_size], any float dtype; ``row_ids``: int64 [batch, seq, n_cols]
        (this layer's entry of :class:`~deepseek_v41.model.engram_hash.EngramHasher` rows); ``mask``: bool
        [batch, seq], True at image positions, which come back bit-identical (ENGRAM.md §7), or None.
        Returns the updated streams, same shape and dtype. The gate is computed in fp32 with eps =
        ``rms_norm_eps``. No data-dependent shapes or host syncs, so it runs on ``meta``. Raises ValueError for
        wrong shapes or dtypes (row ids are range-checked by the hasher that makes them).
        """
        self._check(streams, row_ids, mask)
        compute = self.wkv.weight.dtype
        rows = self.embed(row_ids).to(compute)  # [batch, seq, n_cols, head_dim]
        kv = self.wkv(rows.flatten(-2))
        split = self.hc_mult * self.hidden_size
        key = kv[..., :split].unflatten(-1, (self.hc_mult, self.hidden_size))
        value = upcast(kv[..., split:]).unsqueeze(-2)  # one value for all streams
        gate = engram_gate(streams, key, upcast(self.q_weight) * upcast(self.k_weight), self.eps)
        out = (upcast(streams) + gate.unsqueeze(-1) * value.to(gate.dtype)).to(streams.dtype)
        if mask is None:
            return out
        # where, not gate = 0: h + 0 * value turns -0.0 into +0.0 and inf/nan values into nan.
        return torch.where(mask[..., None, None], streams, out)

    def _check(self, streams: torch.Tensor, row_ids: torch.Tensor, mask: torch.Tensor | None) -> None:
        if streams.dim() != 4 or tuple(streams.shape[2:]) != (self.hc_mult, self.hidden_size):
            raise ValueError(f"streams must be [batch, seq, {self.hc_mult}, {self.hidden_size}], got "
                             f"{list(streams.shape)}")
        if not streams.is_floating_point():
            raise ValueError(f"streams must be floating point, got {streams.dtype}")
        want = (*streams.shape[:2], self.n_cols)
        if row_ids.dtype != torch.int64 or tuple(row_ids.shape) != want:
            raise ValueError(f"row_ids must be int64 {list(want)} (the rows of Engram layer {self.layer_id}), got "
                             f"{row_ids.dtype} {list(row_ids.shape)}")
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != tuple(streams.shape[:2])):
            raise ValueError(f"mask must be bool {list(streams.shape[:2])} (True = image position), got "
                             f"{mask.dtype} {list(mask.shape)}")

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id}, n_cols={self.n_cols}, hc_mult={self.hc_mult}, eps={self.eps}"
