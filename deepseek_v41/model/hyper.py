"""mHC hyper-connections with single-pass (one-sub-layer-late) coefficients (MODEL_REFERENCE.md §3.13).

The residual is ``hc_mult`` streams [B, T, hc, D]. Each sub-layer site (attention, FFN) owns ``fn``
[(2 + hc) * hc, hc * D], ``base`` [(2 + hc) * hc] and ``scale`` [3] (fp32) and produces from the streams
``pre`` (how to collapse the streams into the sub-layer input), ``post`` (how much of the output each stream
gets) and ``comb`` (a doubly-stochastic stream mixing, by Sinkhorn). V4.1 uses the ``pre`` of a site one
sub-layer late: the attention input collapses with the previous FFN site's ``pre``, the FFN input with the
attention site's ``pre``.
"""

from __future__ import annotations

import torch

from deepseek_v41.model.norm import rms_normalize, upcast


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Normalise columns, then rows and columns ``iters - 1`` more times: [..., hc, hc] fp32."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
           norm_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients of one site from streams [B, T, hc, D]: pre [B, T, hc], post [B, T, hc],
    comb [B, T, hc, hc] (all fp32; comb[i, j] moves stream i into stream j)."""
    flat = rms_normalize(streams.flatten(-2), norm_eps)  # [B, T, hc*D]
    mix = flat @ fn.to(flat.dtype).t()  # [B, T, (2+hc)*hc]
    pre, post, comb = mix.split([hc, hc, hc * hc], dim=-1)
    base_pre, base_post, base_comb = base.to(flat.dtype).split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre * scale[0] + base_pre) + hc_eps
    post = 2 * torch.sigmoid(post * scale[1] + base_post)
    comb = (comb * scale[2] + base_comb).unflatten(-1, (hc, hc))
    comb = torch.softmax(comb, dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)


def collapse(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_i w_i R_i``: streams [B, T, hc, D], weights [B, T, hc] -> [B, T, D] in the streams' dtype."""
    wide = upcast(streams)
    return torch.einsum("bthd,bth->btd", wide, weights.to(wide.dtype)).to(streams.dtype)


def expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``R'_j = post_j y + Σ_i comb[i, j] R_i``: streams [B, T, hc, D], y [B, T, D] -> [B, T, hc, D]."""
    wide = upcast(streams)
    mixed = torch.einsum("btij,btid->btjd", comb.to(wide.dtype), wide)
    return (post.to(wide.dtype)[..., None] * y.to(wide.dtype)[:, :, None, :] + mixed).to(streams.dtype)
