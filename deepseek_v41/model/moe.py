"""DeepSeekMoE with noaux_tc routing, clamped SwiGLU experts and a shared expert (MODEL_REFERENCE.md §3.14).

Routing: ``s = sqrt(softplus(x W_g^T / gate_temp))`` (fp32); the top-k experts are *selected* on ``s + bias`` (the
aux-loss-free correction bias; image tokens use ``bias_vl``) and *weighted* by ``s`` renormalised over the
chosen k, times ``routed_scaling_factor``. ``gate_temp`` (the reference ``ModelArgs`` key, default 1.0) divides
the logits before the score function, as mlx-lm's port does; MODEL_REFERENCE.md §9 item 3 notes the placement
is unverified against the official code. At 1.0 nothing is divided (the same bits as without the key). The C
router kernel (``kernels.gate``) has no temperature: with ``gate_temp != 1`` the router runs the torch code; the
fused expert kernels take the router's indices and weights, so they need no change.

The expert dispatch sorts (token, slot) pairs by expert and runs each expert on its contiguous segment, so the
work is T*k expert applications. It has no ``nonzero`` / ``bincount`` / ``unique`` / ``.item()`` on tensors
whose values are unknown on PyTorch's ``meta`` device: only the segment lengths are read, and on ``meta`` (where
routing is unknowable) every assignment is counted on one expert, which keeps the FLOPs total exact (SPEC.md §1.5).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_v41 import kernels
from deepseek_v41.model.hooks import global_hooks, hooked
from deepseek_v41.model.linear import linear
from deepseek_v41.model.norm import cast, fused, upcast
from deepseek_v41.quant.weights import FP4_EXPERT_BLOCK

GROUP_ROWS = 32  # bf16 grouped matmuls pad each expert's rows to a multiple of this (MoE._grouped_padded)

log = logging.getLogger(__name__)


class Expert(nn.Module):
    """``w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))``: x [N, D] -> [N, D].

    The gate (w1) is clamped from above only, the up projection (w3) on both sides; the product is formed in
    fp32 and cast back to x's dtype.
    """

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.plain():  # e.g. a LoRA wrapper or a hook on a projection: call the modules
            hidden = clamped_swiglu(self.w1(x), self.w3(x), self.swiglu_limit)
            return self.w2(cast(hidden, x.dtype))
        # linear() on the weights rather than calling the three Linear modules: a decode step runs hundreds of
        # expert calls, and a module call costs a few µs of Python on top of the matmul.
        hidden = clamped_swiglu(linear(x, self.w1.weight), linear(x, self.w3.weight), self.swiglu_limit)
        return linear(cast(hidden, x.dtype), self.w2.weight)

    def plain(self) -> bool:
        """True when this is an :class:`Expert` and ``w1`` / ``w2`` / ``w3`` bias-free ``nn.Linear`` layers, with
        no forward or backward hook on any of them (nor a global module hook): then ``F.linear`` on the weights,
        or one grouped matmul over every expert, is exactly calling the modules (what the fast paths do)."""
        return not global_hooks() and _plain_own(self)


def _plain(m: nn.Module) -> bool:
    """:meth:`Expert.plain` of any module standing where an expert does (a wrapper that is no Expert: False)."""
    return isinstance(m, Expert) and m.plain()


def _plain_own(m: nn.Module) -> bool:
    """:func:`_plain` without the global-hook check (the caller makes it once for many experts)."""
    if type(m) is not Expert or hooked(m):
        return False
    for lin in m._modules.values():
        if type(lin) is not nn.Linear or hooked(lin) or lin._parameters.get("bias") is not None:
            return False
    return True


def _weights(expert: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plain expert's ``(w1, w3, w2)`` weights."""
    m = expert._modules
    return m["w1"]._parameters["weight"], m["w3"]._parameters["weight"], m["w2"]._parameters["weight"]


def _stamp(params: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[int, ...]:
    """Where each tensor's data is and its version counter: changes when a weight moves or changes in place."""
    w1, w3, w2 = params
    return w1.data_ptr(), w1._version, w3.data_ptr(), w3._version, w2.data_ptr(), w2._version


def _current(key: tuple | None, params: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> bool:
    """Whether copies recorded under ``key`` (:func:`_remake`) were made from exactly these weights as they are now.
    The parameters themselves are in the key: a replaced one is another object, even at a reused address."""
    return (key is not None and key[0] is params[0] and key[1] is params[1] and key[2] is params[2]
            and key[3] == _stamp(params))


def _remake(e: int, params: tuple[torch.Tensor, torch.Tensor, torch.Tensor], copies, keys: list, exact: list,
            fill) -> bool | None:
    """(Re)make expert e's copies from its weights ``(w1, w3, w2)`` with ``fill`` (MoE._expert_copies) and record
    them; whether they are exact, None when they cannot be made (nothing recorded then)."""
    with torch.inference_mode(False), torch.no_grad():
        made = fill(e, params, copies)
    if made is None:
        return None
    exact[e] = made
    keys[e] = (*params, _stamp(params))
    return made


def _linear_weight(expert: nn.Module, name: str) -> torch.Tensor | None:
    """``expert.<name>.weight`` when that projection is an ``nn.Linear`` (hooked or not); None for a wrapper (e.g.
    LoRA-like, without a weight of its own) or another module."""
    m = expert._modules.get(name)
    return m._parameters.get("weight") if type(m) is nn.Linear else None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in fp32 (float64 stays float64); ``limit <= 0``:
    no clamping. gate, up [..., inter] -> [..., inter]."""
    if gate.dim() == 2 and gate.shape == up.shape and fused(gate, up):
        return kernels.swiglu(upcast(gate), upcast(up), limit)
    gate, up = upcast(gate), upcast(up)
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


class Gate(nn.Module):
    """Router: ``weight`` [E, D], correction ``bias`` [E] fp32 and optional ``bias_vl`` [E] fp32 for image tokens.

    ``forward(x [N, D], image_mask [N] bool | None) -> (indices [N, k] long, weights [N, k] fp32)``.
    Without a ``bias_vl`` tensor, image tokens use ``bias`` (logged once). ``gate_temp`` (> 0, finite: the config
    checks it) divides the logits before ``sqrt(softplus(.))``; with ``gate_temp != 1`` the torch route runs (the
    C router kernel has no temperature).
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
        # Tokens routed to each expert since the trainer last read it (aux-loss-free balancing updates ``bias``).
        self.register_buffer("expert_load", torch.zeros(n_experts), persistent=False)
        self._warned = False

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recreate the load counter on ``device`` (after building on ``meta`` and loading weights)."""
        self.expert_load = torch.zeros(self.bias.shape[0], device=device)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        weight, bias = self._parameters["weight"], self._parameters["bias"]  # (Module.__getattr__: ~1 µs a lookup)
        if (image_mask is None and not self.training and self.gate_temp == 1.0 and x.dim() == 2
                and x.shape[0] <= kernels.SMALL_ROWS
                and x.shape[1] == weight.shape[1]  # else the matmul below raises (the kernel would read past)
                and self.topk <= weight.shape[0] and fused(x, weight, bias)):
            if x.shape[1] > kernels.ROW_ON_STACK:  # (bf16 tokens up to ROW_ON_STACK are widened inside)
                x = upcast(x)
            return kernels.gate(x, weight, upcast(bias), self.topk, self.norm_topk, self.route_scale)
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
        self._stacked_at: list[int] | None = None  # addresses of the expert parameters when last stacked
        self._bf16: tuple | None = None  # bf16 copies of fp32 experts, keys, exactness: see bf16_experts
        self._fp4: tuple | None = None  # FP4 copies of the experts, keys, exactness: see fp4_experts
        self._stacked_bf16_at: tuple | None = None  # addresses of the last stacked_weights of bf16 experts

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        mask = image_mask.reshape(-1) if image_mask is not None else None
        indices, weights = self._modules["gate"](flat, mask)
        out = self._fused(flat, indices, weights, with_shared=True, out_dtype=x.dtype)
        if out is not None:  # routed and shared experts in one kernel call
            return cast(out, x.dtype).reshape(shape)
        out = self.dispatch(flat, indices, weights)
        if self.shared_experts is not None:
            out = out + cast(self.shared_experts(flat), out.dtype)
        return cast(out, x.dtype).reshape(shape)

    def _fused(self, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
               with_shared: bool, out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The routed experts (and the shared expert, ``with_shared``) of a few fp32 / bf16 tokens flat [N, D] in
        inference mode on the CPU by :func:`deepseek_v41.kernels.moe_fp4` (the routed experts as FP4 copies, when
        their weights are FP4 values: :meth:`fp4_experts`) or :func:`~deepseek_v41.kernels.moe_bf16` (as bf16:
        :meth:`bf16_experts`): [N, D] summed in fp32, returned as ``out_dtype`` (fp32, or bf16 rounded once; the
        callers pass fp32 or the tokens' dtype, which ``fused`` keeps to those two); None when the kernel does not
        apply (the caller runs the torch code). The shared expert joins when it is plain (no hooks or wrappers)
        with fp32 / bf16 weights and the routed experts' SwiGLU limit; otherwise it is left out and None is
        returned, so the caller runs it as a module."""
        # The kernel reads the router weights as fp32 [N, k] (a hook on the gate may have cast them).
        if not (flat.dim() == 2 and flat.shape[0] <= kernels.FEW_ROWS and indices.dtype == torch.int64
                and weights.dtype == torch.float32 and weights.shape == indices.shape
                and indices.shape[0] == flat.shape[0] and fused(flat, weights) and kernels.usable(indices)):
            return None
        D = flat.shape[1]
        shared = None
        se = self._modules.get("shared_experts")
        if with_shared and se is not None:
            if not (_plain(se) and se.swiglu_limit == self.swiglu_limit):
                return None
            m = se._modules
            shared = (m["w1"]._parameters["weight"], m["w3"]._parameters["weight"], m["w2"]._parameters["weight"])
            # One dtype and matching widths (the kernel takes the three as one dtype; the torch code would raise).
            s1, s3, s2 = shared
            if not (s1.dtype == s3.dtype == s2.dtype and s1.dim() == 2 and s1.shape == s3.shape
                    and s1.shape[1] == D and s2.shape == (D, s1.shape[0]) and fused(*shared)):
                return None
        picked = set(indices.flatten().tolist())
        fp4 = self.fp4_experts(picked)
        if fp4 is not None and fp4[0].shape[2] * 2 == D:
            return kernels.moe_fp4(flat, indices, weights, *fp4, self.swiglu_limit, shared=shared, out_dtype=out_dtype)
        experts = self.bf16_experts(picked)
        if experts is None or experts[0].shape[2] != D:
            return None
        return kernels.moe_bf16(flat, indices, weights, *experts, self.swiglu_limit, shared=shared,
                                out_dtype=out_dtype)

    def dispatch(self, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_k w_k E_{idx_k}(x) for flat [N, D], indices/weights [N, k] -> [N, D] in the weights' dtype (fp32, or
        float64 for a float64 model)."""
        out = self._fused(flat, indices, weights, with_shared=False)
        if out is not None:  # a few tokens in inference mode: one fused kernel, bf16 weights
            return out
        if flat.shape[0] == 1 and flat.device.type != "meta":
            # One token (batch-1 decode): its k experts in ascending id, summed in the order the sorted dispatch
            # below adds them, without the sort / gather / scatter bookkeeping.
            picks = sorted(zip(indices[0].tolist(), range(indices.shape[-1]), strict=True))
            out = None
            for e, j in picks:
                y = cast(self.experts[e](flat), weights.dtype) * weights[:, j:j + 1]
                out = y if out is None else out + y
            return out
        k = indices.shape[-1]
        flat_idx = indices.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        token_of = order // k
        slot_weight = weights.reshape(-1)[order]
        sorted_x = flat[token_of]
        out = torch.zeros(flat.shape, dtype=slot_weight.dtype, device=flat.device)
        if self._grouped_ok(flat):
            # Every expert's rows in one grouped matmul per projection: no Python loop over experts.
            counts = torch.bincount(flat_idx, minlength=self.n_experts)
            if sorted_x.dtype == torch.bfloat16:
                y = self._grouped_padded(sorted_x, counts)
            else:
                y = self._grouped_experts(sorted_x, counts.cumsum(0).to(torch.int32))
            return out.index_add_(0, token_of, cast(y, out.dtype) * slot_weight[:, None])
        start = 0
        for e, count in enumerate(expert_segments(flat_idx, self.n_experts)):
            if count == 0:
                continue
            end = start + count
            y = cast(self.experts[e](sorted_x[start:end]), out.dtype) * slot_weight[start:end, None]
            out.index_add_(0, token_of[start:end], y)
            start = end
        return out

    def bf16_experts(self, picked: Iterable[int] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The routed experts' weights in bf16 ``(w13 [E, 2 * inter, D], w2 [E, D, inter])`` for
        :func:`deepseek_v41.kernels.moe_bf16`, valid for the experts ``picked`` (ids; None: every expert); None
        unless each of those is plain (:meth:`Expert.plain`) with fp32 or bf16 weights. bf16 weights are
        :meth:`stacked_weights` themselves. fp32 weights get bf16 copies, and an expert whose weights are not all
        exactly representable in bf16 gives None (weights dequantized from the FP4 checkpoint format always are:
        E2M1 values have 2 significant bits and the scales are powers of two), so using them changes nothing.

        Only the picked experts are checked (a step's few tokens use a few experts: checking all of them cost
        more than the kernel). An fp32 expert's copy is rebuilt when one of its weights is replaced, changes
        address or is modified in place (its version counter), e.g. by training or ``load_state_dict``. Writes
        through ``.data`` bypass torch's version counters and are not seen: after those, set ``moe._bf16 =
        None``. The copies cost 2 bytes per routed-expert weight beside the fp32 parameters."""
        picked = None if picked is None else list(picked)  # iterated more than once (not a generator)
        copies = self._unchanged_copies("_bf16", picked)
        if copies is not None:
            return copies
        found = self._picked(picked)
        if found is None:
            return None
        mods, ids, w1 = found
        dtype = w1.dtype
        if dtype != torch.float32:
            self._bf16 = None  # e.g. model.to(torch.bfloat16) after an fp32 decode: the copies are not needed
        if dtype == torch.bfloat16:
            return self._stacked_bf16(mods, ids)
        if dtype != torch.float32:
            return None
        E, (inter, D) = len(mods), w1.shape

        def alloc():
            bf16 = torch.bfloat16
            return torch.empty((E, 2 * inter, D), dtype=bf16), torch.empty((E, D, inter), dtype=bf16)

        def fill(e, params, copies):
            w13, w2 = copies
            if params[0].dtype != torch.float32 or params[2].shape != w2.shape[1:]:
                return None
            wide = torch.cat(params[:2]), params[2]
            w13[e], w2[e] = wide[0], wide[1]
            return torch.equal(w13[e].float(), wide[0]) and torch.equal(w2[e].float(), wide[1])

        return self._expert_copies("_bf16", mods, ids, (E, 2 * inter, D), alloc, fill)

    def fp4_experts(self, picked: Iterable[int] | None = None) -> tuple[torch.Tensor, ...] | None:
        """The routed experts' weights as FP4 copies ``(codes13 [E, 2 * inter, D / 2], scales13 [E, 2 * inter,
        D / 32], codes2 [E, D, inter / 2], scales2 [E, D, inter / 32])`` (E2M1 codes, UE8M0 scales per 32: the
        checkpoint's format, MODEL_REFERENCE.md §4) for :func:`deepseek_v41.kernels.moe_fp4`, valid for the experts
        ``picked`` (ids; None: every expert); None unless each of those is plain with fp32 or bf16 weights that
        are exactly FP4 values (as weights decoded from the FP4 checkpoint are; re-encoding them gives them back),
        and D, inter are multiples of 32. A quarter of bf16's bytes, so a decode step reads the experts ~4x
        faster; the kernel gives what the bf16 copies give. Kept up to date as :meth:`bf16_experts` keeps its
        copies (the same caveat on ``.data`` writes: set ``moe._fp4 = None``)."""
        picked = None if picked is None else list(picked)  # iterated more than once (not a generator)
        copies = self._unchanged_copies("_fp4", picked)
        if copies is not None:
            return copies
        found = self._picked(picked)
        if found is None:
            return None
        mods, ids, w1 = found
        if w1.dtype not in (torch.float32, torch.bfloat16) or kernels.library() is None:
            return None
        E, (inter, D) = len(mods), w1.shape
        if D % FP4_EXPERT_BLOCK or inter % FP4_EXPERT_BLOCK or w1.device.type != "cpu":
            return None

        def alloc():
            u8 = torch.uint8
            return (torch.empty((E, 2 * inter, D // 2), dtype=u8), torch.empty((E, 2 * inter, D // 32), dtype=u8),
                    torch.empty((E, D, inter // 2), dtype=u8), torch.empty((E, D, inter // 32), dtype=u8))

        def fill(e, params, copies):
            if (any(p.dtype not in (torch.float32, torch.bfloat16) or not p.is_contiguous() for p in params)
                    or params[0].shape != (inter, D) or params[1].shape != (inter, D) or params[2].shape != (D, inter)):
                return None
            exact = True
            for (codes, scales), at, w in ((copies[:2], slice(0, inter), params[0]),
                                           (copies[:2], slice(inter, 2 * inter), params[1]),
                                           (copies[2:], slice(None), params[2])):
                wide = w.float()
                c, sc, values = kernels.fp4_quantize(wide, FP4_EXPERT_BLOCK, "ue8m0", values=True)
                codes[e, at], scales[e, at] = c, sc
                exact = exact and torch.equal(values, wide)
            return exact

        return self._expert_copies("_fp4", mods, ids, (E, 2 * inter, D // 2), alloc, fill)

    def _unchanged_copies(self, attr: str, picked: list[int] | None) -> tuple[torch.Tensor, ...] | None:
        """The copies in ``self.<attr>`` when each picked expert's are already made, exact and current, and the
        expert plain (:func:`_plain_own`, no global hook): one pass over the picked experts, without
        :meth:`_picked`'s and :meth:`_expert_copies`' lists and checks of dtype, shapes and device (copies made
        from these very weights passed those); None otherwise (the caller runs the full checks). A batch-8 decode
        step picks ~12 experts in each of its layers: the full checks cost ~0.9 ms of a ~10 ms step."""
        state = getattr(self, attr)
        if state is None or picked is None or global_hooks():
            return None
        copies, keys, exact = state
        mods = list(self._modules["experts"]._modules.values())
        if len(mods) != len(keys):
            return None
        for e in picked:
            m = mods[e]
            if not (exact[e] and _plain_own(m) and _current(keys[e], _weights(m))):
                return None
        return copies

    def _picked(self, picked: Iterable[int] | None) -> tuple[list[nn.Module], list[int] | range, torch.Tensor] | None:
        """``(experts, picked ids, a picked expert's w1 weight)`` when every picked expert (None: every expert) is
        plain (:meth:`Expert.plain`); None otherwise. The weight gives dtype and shape: an unpicked expert may be
        wrapped (a LoRA-like module has no weight). A batch-8 decode step checks ~12 experts per layer, so the
        checks are written out (global hooks once, not per expert)."""
        mods = list(self._modules["experts"]._modules.values())
        ids = range(len(mods)) if picked is None else list(picked)  # iterated more than once (not a generator)
        if global_hooks():
            return None
        for e in ids:
            if not _plain_own(mods[e]):
                return None
        w1 = _linear_weight(mods[ids[0]] if len(ids) else mods[0], "w1")
        return None if w1 is None else (mods, ids, w1)

    def _expert_copies(self, attr: str, mods: list[nn.Module], ids: list[int] | range, shape: tuple, alloc, fill
                       ) -> tuple[torch.Tensor, ...] | None:
        """Copies of the picked experts' weights kept in ``self.<attr>`` = (copies, keys, exact) with copies =
        ``alloc()`` (first tensor of ``shape``): expert e's are (re)made by ``fill(e, (w1, w3, w2), copies)``
        (True: they hold the weights exactly; False: not; None: the kernel cannot take them) when a weight was
        replaced, moved or modified in place since. Returns the copies, or None when a picked expert's are not
        exact. When a picked expert's copies are (re)made, so are every other plain expert's that need it (a
        decode step picks a few experts; making them one by one as they are first picked spread ~0.25 ms per
        expert over the first hundred decode steps)."""
        state = getattr(self, attr)
        if state is None or state[0][0].shape != shape:
            with torch.inference_mode(False):  # ordinary tensors: rebuilt in place later, in or out of inference
                state = (alloc(), [None] * len(mods), [False] * len(mods))
            setattr(self, attr, state)
        copies, keys, exact = state
        remade = False
        for e in ids:
            params = _weights(mods[e])
            if not _current(keys[e], params):
                if _remake(e, params, copies, keys, exact, fill) is None:
                    return None
                remade = True
            if not exact[e]:
                return None
        if remade:  # the other plain experts' too, as far as they can be made
            picked = set(ids)
            for e, expert in enumerate(mods):
                if e not in picked and _plain(expert):
                    params = _weights(expert)
                    if not _current(keys[e], params):
                        _remake(e, params, copies, keys, exact, fill)
        return copies

    def _stacked_bf16(self, mods: list[nn.Module], ids: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`stacked_weights` of bf16 experts, skipping its whole check when each picked expert's weights
        still sit at their places in the stack of the last call (only its addresses are kept: no storage). None
        when an expert's projection is wrapped (no stack of every expert's weights) or, when restacking, not every
        weight is bf16 (stacking would promote them all to another dtype, which the kernel cannot read as bf16)."""
        at = self._stacked_bf16_at
        w1, w2 = _linear_weight(mods[0], "w1"), _linear_weight(mods[0], "w2")  # the stack's views start there
        if w1 is None or w2 is None:
            return None
        E, (inter, D) = len(mods), w1.shape
        if (at is not None and at[2] == (E, inter, D) and w1.dtype == torch.bfloat16
                and (w1.data_ptr(), w2.data_ptr()) == at[:2]):  # expert 0's weights: the views start there
            size = w1.element_size()
            if all(mods[e]._modules["w1"]._parameters["weight"].data_ptr() == at[0] + 2 * e * inter * D * size
                   and mods[e]._modules["w3"]._parameters["weight"].data_ptr() == at[0] + (2 * e + 1) * inter * D * size
                   and mods[e]._modules["w2"]._parameters["weight"].data_ptr() == at[1] + e * inter * D * size
                   for e in ids):
                return (w1.detach().as_strided((E, 2 * inter, D), (2 * inter * D, D, 1), w1.storage_offset()),
                        w2.detach().as_strided((E, D, inter), (D * inter, inter, 1), w2.storage_offset()))
        for m in mods:
            for name in ("w1", "w3", "w2"):
                w = _linear_weight(m, name)
                if w is None or w.dtype != torch.bfloat16:
                    return None
        w13, w2 = self.stacked_weights()
        self._stacked_bf16_at = (w13.data_ptr(), w2.data_ptr(), (E, inter, D))
        return w13, w2

    # ------------------------------------------------------------------ grouped experts (inference)
    def _grouped_ok(self, flat: torch.Tensor) -> bool:
        """Inference on CPU with fp32 / bf16 weights: ``torch._grouped_mm`` runs all experts at once."""
        return (flat.device.type == "cpu" and not torch.is_grad_enabled() and hasattr(torch, "_grouped_mm")
                and flat.dtype in (torch.float32, torch.bfloat16)
                and all(_plain(e) for e in self.experts._modules.values())  # before .weight: a wrapper may lack it
                and self.experts[0].w1.weight.dtype == flat.dtype)

    def _weights(self) -> list[torch.Tensor]:
        # Straight through the module dicts: Module.__getattr__ would cost ~1 µs for each of the 3 E lookups.
        return [e._modules[name]._parameters["weight"] for e in self.experts._modules.values()
                for name in ("w1", "w3", "w2")]

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [E, 2 * inter, D], w2 [E, D, inter])``: the experts' weights as one tensor each (no autograd).

        Built on first use by stacking, after which each expert's ``w1`` / ``w3`` / ``w2`` parameter *is* a view
        of its slice: the memory is the same as before. Only the parameters hold the stacked storage (this module
        keeps its layout and their addresses), so after ``model.to(...)`` nothing of the old stack survives; the
        next call re-stacks the new parameters. Loading or training in place updates both views.
        """
        E, inter = len(self.experts), self.inter_dim
        first = self.experts[0]
        last = self.experts[-1]
        if (self._stacked_at == [w.data_ptr() for w in self._weights()]
                and first.w1.weight.untyped_storage().data_ptr() == last.w3.weight.untyped_storage().data_ptr()
                and first.w2.weight.untyped_storage().data_ptr() == last.w2.weight.untyped_storage().data_ptr()):
            D = first.w1.weight.shape[1]
            w13 = first.w1.weight.detach().as_strided((E, 2 * inter, D), (2 * inter * D, D, 1),
                                                      first.w1.weight.storage_offset())
            w2 = first.w2.weight.detach().as_strided((E, D, inter), (D * inter, inter, 1),
                                                     first.w2.weight.storage_offset())
            return w13, w2
        # inference_mode(False) first: it turns grad mode on, which no_grad then turns off again.
        with torch.inference_mode(False), torch.no_grad():
            w13, w2 = self._stack()
            for i, e in enumerate(self.experts):
                e.w1.weight.data, e.w3.weight.data, e.w2.weight.data = w13[i, :inter], w13[i, inter:], w2[i]
        self._stacked_at = [w.data_ptr() for w in self._weights()]
        return w13, w2

    def _stack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """New tensors ``(w13 [E, 2 * inter, D], w2 [E, D, inter])`` stacking the experts' current weights."""
        w13 = torch.stack([torch.cat((e.w1.weight, e.w3.weight)) for e in self.experts])
        return w13, torch.stack([e.w2.weight for e in self.experts])

    def _grouped_padded(self, sorted_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """:meth:`_grouped_experts` of sorted_x [M, D] (rows grouped by expert, ``counts`` [E] rows each) with each
        group padded by zero rows to a multiple of GROUP_ROWS: bf16 grouped matmuls on the CPU go through oneDNN,
        which compiles a kernel for every new row count (~0.4 ms each), and a prefill chunk's per-expert counts
        are new almost every time; padded, a few row counts recur (bf16 prefill 1K: bench/README.md). Rows are
        computed independently of the padding. Returns [M, D]."""
        padded = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
        experts = torch.arange(counts.numel(), device=counts.device)
        expert_of_row = torch.repeat_interleave(experts, counts)
        shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)  # padded start - packed start
        dest = torch.arange(sorted_x.shape[0], device=sorted_x.device) + shift[expert_of_row]
        x = sorted_x.new_zeros((int(padded.sum()), sorted_x.shape[1]))
        x[dest] = sorted_x
        return self._grouped_experts(x, padded.cumsum(0).to(torch.int32))[dest]

    def _grouped_experts(self, sorted_x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """:class:`Expert` of every row of ``sorted_x`` [M, D] (rows grouped by expert, ``offsets`` [E] int32 the
        cumulative row counts) -> [M, D] in x's dtype; the same arithmetic as the per-expert calls."""
        w13, w2 = self.stacked_weights()
        h = torch._grouped_mm(sorted_x, w13.transpose(1, 2), offs=offsets)
        hidden = clamped_swiglu(h[:, : self.inter_dim], h[:, self.inter_dim:], self.swiglu_limit)
        return torch._grouped_mm(cast(hidden, sorted_x.dtype), w2.transpose(1, 2), offs=offsets)
