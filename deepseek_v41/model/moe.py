"""DeepSeekMoE with noaux_tc routing, clamped SwiGLU experts and a shared expert (MODEL_REFERENCE.md §3.14).

Routing: ``s = sqrt(softplus(x W_g^T / gate_temp))`` (fp32); the top-k experts are *selected* on ``s + bias`` (the
aux-loss-free correction bias; image tokens use ``bias_vl``) and *weighted* by ``s`` renormalised over the
chosen k, times ``routed_scaling_factor``. ``gate_temp`` (the reference ``ModelArgs`` key, default 1.0) divides
the logits before the score function, as mlx-lm's port does; MODEL_REFERENCE.md §9 item 3 notes the placement
is unverified against the official code. At 1.0 nothing is divided (the same bits as without the key). V4.1 has
no hash-routed layers and no group-limited routing.

The expert dispatch sorts (token, slot) pairs by expert and runs each expert on its contiguous segment, so the
work is T*k expert applications and each token's expert outputs are added in ascending expert id. It has no
``nonzero`` / ``bincount`` / ``unique`` / ``.item()`` on tensors whose values are unknown on PyTorch's ``meta``
device: only the segment lengths are read, and on ``meta`` (where routing is unknowable) every assignment is
counted on one expert, which keeps the FLOPs total exact (SPEC.md §1.5).

This is the reference math, run by training, the exact forward and (where no fast version serves the shape) the
engine. The CPU fast paths — the C router, the fused FP4 / bf16 experts, grouped matmuls — are installed on a
loaded model by the fast backend (its ``fast/moe.py``, issue 24), which packs the expert copies once.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_v41.model.norm import cast, upcast

log = logging.getLogger(__name__)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in fp32 (float64 stays float64); ``limit <= 0``:
    no clamping. gate, up [..., inter] -> [..., inter]."""
    gate, up = upcast(gate), upcast(up)
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


class Expert(nn.Module):
    """``w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))``: x [N, D] -> [N, D] in x's dtype.

    The gate (w1) is clamped from above only, the up projection (w3) on both sides; the product is formed in
    fp32 and cast back to x's dtype before ``w2``.
    """

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = clamped_swiglu(self.w1(x), self.w3(x), self.swiglu_limit)
        return self.w2(cast(hidden, x.dtype))


class Gate(nn.Module):
    """Router: ``weight`` [E, D], correction ``bias`` [E] fp32 and optional ``bias_vl`` [E] fp32 for image tokens.

    ``forward(x [N, D], image_mask [N] bool | None) -> (indices [N, k] long, weights [N, k] fp32)``.
    Without a ``bias_vl`` tensor, image tokens use ``bias`` (logged once). ``gate_temp`` (> 0, finite: the config
    checks it) divides the logits before ``sqrt(softplus(.))``. In training mode each call adds the tokens routed
    to each expert to ``expert_load`` (read and reset by the aux-loss-free balancing of ``train/trainer.py``).
    """

    def __init__(self, dim: int, n_experts: int, topk: int, route_scale: float, norm_topk: bool,
                 with_bias_vl: bool, gate_temp: float = 1.0):
        super().__init__()
        self.topk = topk
        self.gate_temp = gate_temp
        self.route_scale = route_scale
        self.norm_topk = norm_topk
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)
        self.bias_vl = (nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)
                        if with_bias_vl else None)
        self.register_buffer("expert_load", torch.zeros(n_experts), persistent=False)
        self._warned = False

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recreate the load counter on ``device`` (after building on ``meta`` and loading weights)."""
        self.expert_load = torch.zeros(self.bias.shape[0], device=device)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        xf = upcast(x)
        logits = xf @ cast(self.weight, xf.dtype).t()
        if self.gate_temp != 1.0:
            logits = logits / self.gate_temp
        scores = torch.sqrt(F.softplus(logits))
        bias = cast(self.bias, xf.dtype)
        if image_mask is not None:
            if self.bias_vl is None:
                if not self._warned:
                    log.info("this checkpoint has no gate.bias_vl: image tokens route with gate.bias")
                    self._warned = True
                vl = bias
            else:
                vl = self.bias_vl.to(xf.dtype)
            bias = torch.where(image_mask[:, None], vl, bias)
        indices = torch.topk(scores + bias, self.topk, dim=-1).indices
        if self.training:
            flat = indices.reshape(-1)
            self.expert_load.scatter_add_(0, flat, torch.ones_like(flat, dtype=self.expert_load.dtype))
        weights = scores.gather(-1, indices)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return indices, weights * self.route_scale


def expert_segments(flat_idx: torch.Tensor, n_experts: int) -> list[int]:
    """Tokens routed to each expert, as Python ints (the only host sync of the dispatch).

    On ``meta`` the routing is unknown: all N*k assignments are given to the first expert. An expert's matmuls
    are linear in its token count and every expert has the same shape, so the FLOPs counted are exactly those of
    any routing, and the model runs one expert call per layer instead of hundreds.
    """
    if flat_idx.device.type == "meta":
        return [flat_idx.numel()] + [0] * (n_experts - 1)
    counts = torch.zeros(n_experts, dtype=torch.long, device=flat_idx.device)
    counts.scatter_add_(0, flat_idx, torch.ones_like(flat_idx))
    return counts.tolist()


class MoE(nn.Module):
    """Routed experts + shared expert: x [B, T, D] (+ image_mask [B, T]) -> [B, T, D] in x's dtype.
    ``gate_temp``: the router temperature (:class:`Gate`)."""

    def __init__(self, dim: int, inter_dim: int, n_experts: int, topk: int, n_shared: int, swiglu_limit: float,
                 route_scale: float, norm_topk: bool, with_bias_vl: bool, gate_temp: float = 1.0):
        super().__init__()
        self.n_experts = n_experts
        self.gate = Gate(dim, n_experts, topk, route_scale, norm_topk, with_bias_vl, gate_temp)
        self.experts = nn.ModuleList(Expert(dim, inter_dim, swiglu_limit) for _ in range(n_experts))
        self.shared_experts = Expert(dim, inter_dim * n_shared, swiglu_limit) if n_shared else None
        self.inter_dim, self.swiglu_limit = inter_dim, swiglu_limit

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        indices, weights = self.gate(flat, None if image_mask is None else image_mask.reshape(-1))
        return self.experts_forward(flat, indices, weights).reshape(x.shape)

    def experts_forward(self, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Routed experts (:meth:`dispatch`) plus the shared expert of flat [N, D] routed by ``indices`` /
        ``weights`` [N, k] -> [N, D] in flat's dtype (summed in the weights' dtype: fp32, or float64)."""
        out = self.dispatch(flat, indices, weights)
        if self.shared_experts is not None:
            out = out + cast(self.shared_experts(flat), out.dtype)
        return cast(out, flat.dtype)

    def dispatch(self, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_k w_k E_{idx_k}(x) for flat [N, D], indices/weights [N, k] -> [N, D] in the weights' dtype (fp32, or
        float64 for a float64 model): each expert on the rows routed to it, in ascending expert id."""
        k = indices.shape[-1]
        flat_idx = indices.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        token_of = order // k
        slot_weight = weights.reshape(-1)[order]
        sorted_x = flat[token_of]
        out = torch.zeros(flat.shape, dtype=slot_weight.dtype, device=flat.device)
        start = 0
        for e, count in enumerate(expert_segments(flat_idx, self.n_experts)):
            if count == 0:
                continue
            end = start + count
            y = cast(self.experts[e](sorted_x[start:end]), out.dtype) * slot_weight[start:end, None]
            out.index_add_(0, token_of[start:end], y)
            start = end
        return out
