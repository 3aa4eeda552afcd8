"""Sliding-window attention of a prefill chunk with the window band read as one dense matmul per query chunk.

:func:`~deepseek_v41.model.attention.sparse_attention` reads each query's band of new rows through a strided view
[B, c, d, band]; ``einsum`` copies that view into a contiguous [B x c, d, band] tensor, twice per layer (scores and
output): for 32 prompts of 64 tokens that is 32 MB per copy and a third of a bundled-checkpoint prefill (issue 25).
:func:`band_attention` instead multiplies the chunk's queries by the new rows they can reach, [B, c x H, d] x
[B, d, L] (L = c + band - 1: the chunk and the rows before it), and reads the band out of that as a strided view;
the output multiplies the band's probabilities, placed back into a [B, c x H, L] block of zeros, by the same rows.

Same values as the reference, bit for bit, where the matmuls accumulate each dot product in order over the
reduced dimension (the scores: the same d products; the output: the same band products with exact zeros between
them): tests/kernels/test_band_attention.py checks that against the reference on the shapes the engine runs.
Source: issue 25; MODEL_REFERENCE.md §3 (the attention), the reference ``sparse_attention``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepseek_v41.model.norm import upcast


def band_view(padded: torch.Tensor, band: int) -> torch.Tensor:
    """The band of each query in ``padded`` [B, c, H, band - 1 + L'] (query i against columns i .. i + band - 1):
    [B, c, H, band], a strided view (writes go to ``padded``)."""
    B, c, H, _ = padded.shape
    sB, sC, sH, sL = padded.stride()
    return padded.as_strided((B, c, H, band), (sB, sC + sL, sH, sL), padded.storage_offset())


def band_attention(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, window: int,
                   topk: torch.Tensor | None, gather: Callable[[torch.Tensor], torch.Tensor] | None,
                   sink: torch.Tensor, scale: float, chunk: int) -> torch.Tensor:
    """:func:`~deepseek_v41.model.attention.sparse_attention` of a causal, banded text forward (no ``key_limit``,
    no shared entries, no entry probabilities): q [B, T, H, d], q_pos [B, T], keys [B, P + T, d] (the last T rows
    the new tokens), key_pos [B, P + T], topk [B, T, k] or None, ``gather``, sink [H], ``scale``, queries in chunks
    of ``chunk``. Returns [B, T, H, d] in q's dtype."""
    B, T, H, d = q.shape
    P = keys.shape[1] - T
    wide = upcast(keys)
    prev, prev_pos = wide[:, :P], key_pos[:, :P]
    new = wide[:, P:]
    band = min(window, T)
    out = []
    for i0 in range(0, T, chunk):
        i1 = min(T, i0 + chunk)
        c = i1 - i0
        qc = upcast(q[:, i0:i1]).to(wide.dtype)
        qp = q_pos[:, i0:i1, None]
        parts = []
        if P:
            s_prev = torch.einsum("bchd,bld->bchl", qc, prev) * scale
            kp = prev_pos[:, None, :]
            seen = (kp <= qp) & (kp > qp - window) & (kp >= 0)
            parts.append(s_prev.masked_fill(~seen[:, :, None, :], float("-inf")))
        lo = max(0, i0 - band + 1)
        rows = new[:, lo:i1]  # [B, L, d]: every new row some query of the chunk reaches
        pad = band - 1 - (i0 - lo)  # columns before row 0 (queries whose band starts before the first token)
        dense = torch.nn.functional.pad(torch.einsum("bchd,bld->bchl", qc, rows), (pad, 0))
        s_band = band_view(dense, band) * scale
        # Band position w of query i is new row i - band + 1 + w: before row 0, padding.
        before = torch.arange(i0 - band + 1, i1 - band + 1, device=q.device)[:, None] + torch.arange(band,
                                                                                                 device=q.device)
        parts.append(s_band.masked_fill((before < 0)[None, :, None, :], float("-inf")))
        selected = None
        if topk is not None and topk.shape[-1] > 0:
            idx = topk[:, i0:i1]
            selected = gather(idx).to(qc.dtype)  # [B, c, k, d]
            s_c = torch.einsum("bchd,bckd->bchk", qc, selected) * scale
            parts.append(s_c.masked_fill((idx < 0)[:, :, None, :], float("-inf")))
        parts.append(sink.to(qc.dtype).view(1, 1, H, 1).expand(B, c, H, 1))
        probs = torch.softmax(torch.cat(parts, -1), dim=-1)
        o = torch.einsum("bchl,bld->bchd", probs[..., :P], prev)
        placed = torch.zeros_like(dense)
        band_view(placed, band).copy_(probs[..., P: P + band])
        o = o + torch.einsum("bchl,bld->bchd", placed[..., pad:], rows)
        if selected is not None:
            o = o + torch.einsum("bchk,bckd->bchd", probs[..., P + band:-1], selected)
        out.append(o)
    return torch.cat(out, 1).to(q.dtype)
