"""CSA2 compressor of a kv-source layer (MODEL_REFERENCE.md §3.8).

ratio 1: ``c_t = norm(wkv x_t)``, one entry per token. ratio 2: fp32 projections ``kv = x wkv^T``,
``s = x wgate^T``; the tokens of group g = (2g, 2g+1) are mixed by a per-channel softmax over the pair,
``c_g = norm(Σ_j softmax_j(s)_c kv_{j,c})``. An entry is emitted when its group completes; the first token of
an open pair waits in the context (``pending``) across chunks and decode steps.
"""

from __future__ import annotations

import torch
from torch import nn

from deepseek_v41.model.linear import Linear
from deepseek_v41.model.norm import RMSNorm, upcast


class Compressor(nn.Module):
    """``forward(x [B, T, D], positions [B, T], pending) -> (latent [B, G, d], group [B, G], new_pending)``.

    ``latent``: the compressed entries that complete in this call, post-norm, pre-RoPE, in x's dtype;
    ``group`` their absolute group index g (entry g covers tokens g*m .. g*m+m-1), -1 where a row completes fewer
    groups than G. ``pending`` / ``new_pending`` (ratio 2 only): ``(kv [B, d] fp32, score [B, d] fp32)`` of the
    open pair's first token, or None when no row has one (every row's start position is then even). Rows may
    start at different positions (batched decode); each row's T tokens are consecutive.
    """

    def __init__(self, dim: int, head_dim: int, ratio: int, eps: float):
        super().__init__()
        if ratio not in (1, 2):
            raise ValueError(f"compress ratio must be 1 or 2, got {ratio}")
        self.ratio = ratio
        self.wkv = Linear(dim, head_dim, bias=False)
        self.wgate = Linear(dim, head_dim, bias=False) if ratio == 2 else None
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                pending: tuple[torch.Tensor, torch.Tensor] | None):
        if self.ratio == 1:
            return self.norm(self.wkv(x)), positions, None
        B, T, _ = x.shape
        xf = upcast(x)
        kv = xf @ self.wkv.weight.to(xf.dtype).t()
        score = xf @ self.wgate.weight.to(xf.dtype).t()
        start = positions[:, :1]  # [B, 1]
        odd = start % 2  # rows whose first token closes a pair opened earlier
        if pending is None:
            pending = (torch.zeros_like(kv[:, 0]), torch.zeros_like(score[:, 0]))
        # Aligned sequence per row: [pending token if odd] + new tokens, so pairs are (2j, 2j+1).
        slot = (torch.arange(T + 1, device=x.device)[None, :] + 1 - odd).clamp(max=T)  # [B, T+1]
        kv_all = torch.cat((pending[0][:, None], kv), 1).gather(1, slot[..., None].expand(-1, -1, kv.shape[-1]))
        sc_all = torch.cat((pending[1][:, None], score), 1).gather(1, slot[..., None].expand(-1, -1, kv.shape[-1]))
        G = (T + 1) // 2
        kv_pairs = kv_all[:, : 2 * G].unflatten(1, (G, 2))
        sc_pairs = sc_all[:, : 2 * G].unflatten(1, (G, 2))
        latent = (kv_pairs * torch.softmax(sc_pairs, dim=2)).sum(2)
        complete = (odd + T) // 2  # [B, 1] groups completed per row
        j = torch.arange(G, device=x.device)[None, :]
        group = torch.where(j < complete, (start - odd) // 2 + j, -1)
        still_open = (odd + T) % 2 == 1  # the row's last token opens a pair
        new_pending = (torch.where(still_open, kv[:, -1], 0.0), torch.where(still_open, score[:, -1], 0.0))
        return self.norm(latent.to(x.dtype)), group, new_pending
