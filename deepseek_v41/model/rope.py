"""Partial interleaved RoPE with per-layer theta and YaRN (MODEL_REFERENCE.md §3.3).

Pairs (2i, 2i+1) of the last ``qk_rope_head_dim`` dims form one complex number; the leading dims carry no
position. Window-only layers use ``rope_theta`` without YaRN; compressed layers ``compress_rope_theta`` with
YaRN frequency interpolation and **no** attention-temperature (mscale) factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepseek_v41.model.norm import cast, upcast


def yarn_inv_freq(rope_dim: int, theta: float, yarn: dict[str, float] | None) -> torch.Tensor:
    """Inverse frequencies [rope_dim // 2] fp32 of one RoPE table.

    YaRN: ``corr(n) = d * ln(L0 / (2 pi n)) / (2 ln theta)``, ``low = max(floor(corr(beta_fast)), 0)``,
    ``high = min(ceil(corr(beta_slow)), d - 1)``, ``ramp_j = clamp((j - low) / max(high - low, 1e-3), 0, 1)``,
    ``inv_j = inv_j / factor * ramp_j + inv_j * (1 - ramp_j)``.
    """
    inv = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    if yarn is not None and yarn["factor"] > 1:
        length = yarn["original_max_position_embeddings"]

        def corr(rotations: float) -> float:
            return rope_dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corr(yarn["beta_fast"])), 0)
        high = min(math.ceil(corr(yarn["beta_slow"])), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv = inv / yarn["factor"] * ramp + inv * (1 - ramp)
    return inv.float()


class RotaryEmbedding(nn.Module):
    """RoPE on the last ``rope_dim`` dims of a vector, at given absolute positions.

    ``forward(x, positions, inverse=False, cache=None)``: x [B, T, d] or [B, T, H, d] (any float dtype); positions
    [B, T] integer (or float) positions. The rotation is computed in fp32 and cast back to x's dtype; ``inverse``
    rotates by the negative angle (the output-side inverse RoPE of §3.3); ``cache`` as in :meth:`phases`.
    """

    def __init__(self, rope_dim: int, theta: float, yarn: dict[str, float] | None):
        super().__init__()
        self.rope_dim = rope_dim
        self.theta, self.yarn = theta, yarn
        self.register_buffer("inv_freq", yarn_inv_freq(rope_dim, theta, yarn), persistent=False)
        self._table = (rope_dim, theta, tuple(sorted(yarn.items())) if yarn else None)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute the table on ``device`` (after building the model on ``meta`` and loading weights)."""
        self.inv_freq = yarn_inv_freq(self.rope_dim, self.theta, self.yarn).to(device)

    def phases(self, positions: torch.Tensor, cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` [B, T, rope_dim] fp32 (float64 tables stay float64) of ``positions`` [B, T], each angle
        repeated for both elements of its pair and ``sin`` negated on the first (``x' = x cos + swap(x) sin``
        with ``swap`` exchanging the pair's elements).

        ``cache``: a dict that lives for one forward whose positions do not change (the context's ``shared``):
        every layer with this table then reuses one computation. Keyed by the table's settings, dtype and
        device, so tables built alike share it."""
        inv_freq = self.inv_freq
        key = ("rope", *self._table, inv_freq.dtype, inv_freq.device)
        if cache is not None and key in cache:
            return cache[key]
        angles = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, r/2]
        cos, sin = torch.cos(angles), torch.sin(angles)
        cos = torch.stack((cos, cos), -1).flatten(-2)
        sin = torch.stack((-sin, sin), -1).flatten(-2)
        if cache is not None:
            cache[key] = (cos, sin)
        return cos, sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False,
                cache: dict | None = None) -> torch.Tensor:
        if self.rope_dim == 0:
            return x
        cos, sin = self.phases(positions, cache)
        return self.rotate(x, cos, sin, inverse)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last ``rope_dim`` dims of x [B, T, d] or [B, T, H, d] by phases ``cos`` / ``sin`` [B, T, r]
        (:meth:`phases`; [1, T, r] broadcasts over the batch); in x's dtype, rotated in fp32 (float64 stays)."""
        r = self.rope_dim
        if x.dim() == 4:
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        if inverse:
            sin = -sin
        tail = upcast(x[..., -r:])
        # Pair (a, b) -> (a cos - b sin, b cos + a sin): the same two products and one sum per element as the
        # textbook form, so the result is bit-identical to it.
        swapped = tail.unflatten(-1, (r // 2, 2)).flip(-1).flatten(-2)
        rotated = tail * cos + swapped * sin
        return torch.cat((x[..., :-r], cast(rotated, x.dtype)), dim=-1)
