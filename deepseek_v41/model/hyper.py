"""mHC hyper-connections with single-pass (one-sub-layer-late) coefficients (MODEL_REFERENCE.md §3.13).

The residual is ``hc_mult`` streams [B, T, hc, D]. Each sub-layer site (attention, FFN) owns ``fn``
[(2 + hc) * hc, hc * D], ``base`` [(2 + hc) * hc] and ``scale`` [3] (fp32) and produces from the streams
``pre`` (how to collapse the streams into the sub-layer input), ``post`` (how much of the output each stream
gets) and ``comb`` (a doubly-stochastic stream mixing, by Sinkhorn). V4.1 uses the ``pre`` of a site one
sub-layer late: the attention input collapses with the previous FFN site's ``pre``, the FFN input with the
attention site's ``pre``.
"""

from __future__ import annotations

import numpy as np
import torch

from deepseek_v41.model.norm import cast, rms_normalize, upcast
from deepseek_v41.quant.formats import device_constant


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Normalise columns, then rows and columns ``iters - 1`` more times: [..., hc, hc] fp32.

    Without autograd on CPU the same divisions run in NumPy, in place: the matrices are 4 x 4, so each of the
    ~120 steps is all dispatch, and NumPy's is about a third of PyTorch's (the results are identical: the same
    IEEE sums of ``hc`` terms in the same order, the same additions and divisions).
    """
    if (comb.device.type == "cpu" and comb.dtype in (torch.float32, torch.float64)
            and not (comb.requires_grad and torch.is_grad_enabled())):
        c = comb.numpy(force=True)
        eps_ = c.dtype.type(eps)
        add = np.add.reduce  # the ufunc itself: ndarray.sum adds a Python wrapper per call
        c = c / (add(c, axis=-2, keepdims=True) + eps_)
        for _ in range(iters - 1):
            s = add(c, axis=-1, keepdims=True)
            s += eps_
            c /= s
            s = add(c, axis=-2, keepdims=True)
            s += eps_
            c /= s
        return torch.from_numpy(c)
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def _part_index(hc: int, device: torch.device) -> torch.Tensor:
    """Which of the three scales each of the (2 + hc) * hc mixing columns takes: [0] * hc + [1] * hc + [2] * hc^2."""
    return device_constant(f"mHC parts {hc}", device, lambda: torch.tensor([0] * hc + [1] * hc + [2] * hc * hc))


def hc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
           norm_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients of one site from streams [B, T, hc, D] (any float dtype, widened first: callers that have
    them already upcast pass those, to share one conversion with :func:`collapse` / :func:`expand`): pre
    [B, T, hc], post [B, T, hc], comb [B, T, hc, hc] (all fp32; comb[i, j] moves stream i into stream j)."""
    flat = rms_normalize(upcast(streams).flatten(-2), norm_eps)  # [B, T, hc*D]
    mix = flat @ cast(fn, flat.dtype).t()  # [B, T, (2+hc)*hc]: pre | post | comb
    mix = mix * cast(scale, flat.dtype)[_part_index(hc, scale.device)] + cast(base, flat.dtype)
    gates = torch.sigmoid(mix[..., : 2 * hc])
    pre = gates[..., :hc] + hc_eps
    post = 2 * gates[..., hc:]
    comb = torch.softmax(mix[..., 2 * hc:].unflatten(-1, (hc, hc)), dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)


def collapse(streams: torch.Tensor, weights: torch.Tensor, wide: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ_i w_i R_i``: streams [B, T, hc, D], weights [B, T, hc] -> [B, T, D] in the streams' dtype. ``wide``:
    the streams already upcast (``upcast(streams)``), when the caller has them."""
    wide = upcast(streams) if wide is None else wide
    return cast((cast(weights, wide.dtype)[..., None, :] @ wide).squeeze(-2), streams.dtype)


def expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
           wide: torch.Tensor | None = None) -> torch.Tensor:
    """``R'_j = post_j y + Σ_i comb[i, j] R_i``: streams [B, T, hc, D], y [B, T, D] -> [B, T, hc, D] (``wide``
    as in :func:`collapse`)."""
    wide = upcast(streams) if wide is None else wide
    mixed = cast(comb, wide.dtype).transpose(-1, -2) @ wide
    return cast(cast(post, wide.dtype)[..., None] * cast(y, wide.dtype)[:, :, None, :] + mixed, streams.dtype)
