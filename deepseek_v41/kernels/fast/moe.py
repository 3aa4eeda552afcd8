"""The CPU fast paths of the MoE (:mod:`deepseek_v41.model.moe`), installed once per module instance.

- :class:`~deepseek_v41.model.moe.Gate`: up to ``kernels.SMALL_ROWS`` text tokens in inference mode take the C
  router (:func:`deepseek_v41.kernels.gate`). The kernel has no temperature: a router with ``gate_temp != 1``
  gets no fast version (the reference divides the logits).
- :class:`~deepseek_v41.model.moe.Expert` (bias-free ``nn.Linear`` projections without hooks): its projections
  on the weights, a few tokens by the GEMV kernel, the clamped SwiGLU by :func:`deepseek_v41.kernels.swiglu`.
- :class:`~deepseek_v41.model.moe.MoE`: a few tokens (``kernels.FEW_ROWS``: decode, speculative verify) take one
  fused kernel for the routed experts and the shared expert — :func:`~deepseek_v41.kernels.moe_fp4` when the
  picked experts' weights are FP4 values (as weights decoded from the FP4 checkpoint are), else
  :func:`~deepseek_v41.kernels.moe_bf16` when they are exact in bf16; one token runs its k experts without the
  sort; more tokens without autograd run every expert at once by ``torch._grouped_mm`` (bf16 groups padded to
  ``GROUP_ROWS`` rows). Everything else is the reference.
- :class:`~deepseek_v41.distributed.layers.TensorParallelMoE` (issue 28): ``dispatch`` only (the rank's expert
  slices are local); its forward keeps the all-reduce. An expert-parallel MoE gets no MoE-level fast path (its
  dispatch is the all-to-all); its local experts get :class:`Expert`'s.

What to pack is decided here, at install; the copies are made once, when the first few-token step reaches the
MoE (:func:`pack_copies`): the FP4 copies (E2M1 codes, UE8M0 scales per 32: a quarter of bf16's bytes, so a decode
step reads the experts ~4x faster) and bf16 copies of fp32 experts exact in bf16 (only when some expert's weights
are no FP4 values) serve only decode and speculative verify, so an engine that only prefills (a prefill worker,
a scoring run) never holds them: an fp32 8K prefill's peak memory is the reference's (bench/README.md). The
experts' parameters are restacked at install as views of one ``w13`` [E, 2 * inter, D] / ``w2`` [E, D, inter]
tensor each (the same memory as before; ``torch._grouped_mm`` and ``moe_bf16`` read bf16 experts there). Which
experts each copy holds exactly is recorded per expert, so a wrapped or hooked expert only keeps the tokens that
pick it off the kernel. The copies are made from the weights as they are when packed: after changing expert
weights (training, ``load_state_dict``, ``.data`` writes), moving the model or hooking an expert, install again
(:func:`deepseek_v41.kernels.fast.install`); in-place changes reach the stacked views but not the FP4 / bf16
copies once made.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_v41 import kernels
from deepseek_v41.distributed.layers import TensorParallelMoE
from deepseek_v41.kernels.fast.dense import gemv
from deepseek_v41.kernels.fast.registry import (
    KERNEL_DTYPES,
    OVERRIDES,
    fused,
    override,
    plain,
    plain_weight,
    register,
)
from deepseek_v41.model.moe import Expert, Gate, MoE, clamped_swiglu
from deepseek_v41.model.norm import cast, upcast
from deepseek_v41.quant.weights import FP4_EXPERT_BLOCK

GROUP_ROWS = 32  # bf16 grouped matmuls pad each expert's rows to a multiple of this (_grouped_padded)


# ------------------------------------------------------------------------------------------------------ router
@register(Gate)
def install_gate(gate: Gate) -> bool:
    """The C router for a few text tokens: fp32 / bf16 ``weight`` [E, D] and ``bias`` [E] (a bf16 bias is widened
    once here), ``topk <= E``, ``gate_temp == 1``."""
    weight, bias = gate._parameters.get("weight"), gate._parameters.get("bias")
    if (gate.gate_temp != 1.0 or weight is None or bias is None or weight.dim() != 2
            or bias.shape != (weight.shape[0],) or gate.topk > weight.shape[0]
            or weight.dtype not in KERNEL_DTYPES or bias.dtype not in KERNEL_DTYPES
            or not (weight.is_cpu and weight.is_contiguous() and bias.is_cpu and bias.is_contiguous())):
        return False
    gate.__dict__["_fast_gate"] = (weight, upcast(bias.detach()))
    override(gate, "forward", _gate_forward)
    return True


def _gate_forward(self: Gate, x: torch.Tensor, image_mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    weight, bias = self.__dict__["_fast_gate"]
    if (image_mask is None and not self.training and x.dim() == 2 and x.shape[0] <= kernels.SMALL_ROWS
            and x.shape[1] == weight.shape[1] and fused(x)):  # (other widths: the reference's matmul raises)
        if x.shape[1] > kernels.ROW_ON_STACK:  # (bf16 tokens up to ROW_ON_STACK are widened inside)
            x = upcast(x)
        return kernels.gate(x, weight, bias, self.topk, self.norm_topk, self.route_scale)
    return Gate.forward(self, x, image_mask)


# ----------------------------------------------------------------------------------------------------- experts
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """:func:`~deepseek_v41.model.moe.clamped_swiglu`, by the kernel for contiguous 2-D fp32 / bf16 inputs in
    inference mode (the same to rounding)."""
    if gate.dim() == 2 and gate.shape == up.shape and fused(gate, up):
        return kernels.swiglu(upcast(gate), upcast(up), limit)
    return clamped_swiglu(gate, up, limit)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)``, by the GEMV kernel where it is faster (``gemv``)."""
    return kernels.linear(x, weight) if gemv(x, weight) else F.linear(x, weight)


def expert_weights(expert: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(w1, w3, w2)`` weights of an :class:`Expert` without hooks whose projections are bias-free ``nn.Linear``
    without hooks (then computing on the weights is calling the modules); None otherwise."""
    if not plain(expert, Expert):
        return None
    m = expert._modules
    ws = tuple(plain_weight(m.get(name), nn.Linear) for name in ("w1", "w3", "w2"))
    return None if any(w is None for w in ws) else ws


@register(Expert)
def install_expert(expert: Expert) -> bool:
    """Projections on the weights (no module calls: a decode step makes hundreds of expert calls)."""
    ws = expert_weights(expert)
    if ws is None:
        return False
    expert.__dict__["_fast_expert"] = ws
    override(expert, "forward", _expert_forward)
    return True


def _expert_forward(self: Expert, x: torch.Tensor) -> torch.Tensor:
    w1, w3, w2 = self.__dict__["_fast_expert"]
    hidden = swiglu(_linear(x, w1), _linear(x, w3), self.swiglu_limit)
    return _linear(cast(hidden, x.dtype), w2)


# --------------------------------------------------------------------------------------------------------- MoE
@dataclass
class Packed:
    """What :func:`install_moe` made for one MoE. ``fp4`` = (codes13 [E, 2 * inter, D / 2], scales13 [E, 2 * inter,
    D / 32], codes2 [E, D, inter / 2], scales2 [E, D, inter / 32]) and ``bf16`` = (w13 [E, 2 * inter, D], w2 [E, D,
    inter]) copies for the fused kernels, with ``*_ok[e]`` whether expert e's copy holds its weights exactly
    (``*_all``: every expert's does); ``stacked`` the experts' parameters as one tensor each (views), which the
    grouped matmuls read when ``grouped`` (every expert plain); ``shared`` the shared expert's (w1, w3, w2) for
    the fused kernel, ``shared_ok`` whether the kernel may stand for the routed experts plus the shared expert
    (no shared expert, or a plain one). ``pending``: until :func:`pack_copies` ran, the plain experts' (w1, w3, w2)
    (None for the others) from which it makes ``fp4`` / ``bf16``; None once packed, or when nothing is to pack."""

    D: int
    limit: float
    fp4: tuple[torch.Tensor, ...] | None = None
    fp4_ok: list[bool] | None = None
    fp4_all: bool = False
    bf16: tuple[torch.Tensor, torch.Tensor] | None = None
    bf16_ok: list[bool] | None = None
    bf16_all: bool = False
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None
    grouped: bool = False
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    shared_ok: bool = False
    pending: list | None = None
    inter: int = 0


def pack_copies(packed: Packed) -> Packed:
    """Make ``packed``'s FP4 copies (and bf16 copies where some plain expert has no FP4 copy) from its pending
    weights, once; returns ``packed``. A no-op when already packed or nothing is to pack."""
    weights, packed.pending = packed.pending, None
    if weights is None:
        return packed
    inter, D = packed.inter, packed.D
    plain_ok = [ws is not None for ws in weights]
    with torch.inference_mode(False), torch.no_grad():
        if D % FP4_EXPERT_BLOCK == 0 and inter % FP4_EXPERT_BLOCK == 0:
            packed.fp4, packed.fp4_ok = _pack_fp4(weights, inter, D)
            packed.fp4_all = all(packed.fp4_ok)
        if packed.fp4 is None or not all(ok for ok, p in zip(packed.fp4_ok, plain_ok, strict=True) if p):
            packed.bf16, packed.bf16_ok = _pack_bf16(weights, packed.stacked, inter, D)
            packed.bf16_all = all(packed.bf16_ok)
    return packed


@register(MoE)
def install_moe(moe: MoE) -> bool:
    """Pack the experts (module docstring) and override ``forward``, ``experts_forward`` and ``dispatch``."""
    experts = list(moe._modules["experts"]._modules.values())
    raw = [_linear_weights(e) for e in experts]  # hooked projections too: they are stacked, not computed on
    plain_ok = [expert_weights(e) is not None and e.swiglu_limit == moe.swiglu_limit for e in experts]
    some = next((ws for ws in raw if ws is not None), None)
    if some is None or some[0].dim() != 2:
        return False
    inter, D = some[0].shape
    kinds = {(w.dtype, w.device.type) for ws in raw if ws is not None for w in ws}
    if len(kinds) != 1 or not all(ws is None or (ws[0].shape == ws[1].shape == (inter, D)
                                                 and ws[2].shape == (D, inter) and all(w.is_contiguous() for w in ws))
                                  for ws in raw):
        return False
    dtype, device = kinds.pop()
    if device != "cpu":
        return False
    packed = Packed(D=D, limit=moe.swiglu_limit, inter=inter)
    if all(ws is not None for ws in raw):
        with torch.inference_mode(False), torch.no_grad():
            packed.stacked = _stack(experts, raw, inter, D)
        packed.grouped = all(plain_ok) and dtype in KERNEL_DTYPES  # (no float64 grouped matmuls)
        raw = [_linear_weights(e) for e in experts]  # the views
    if dtype in KERNEL_DTYPES and any(plain_ok):
        packed.pending = [ws if ok else None for ws, ok in zip(raw, plain_ok, strict=True)]
    se = moe._modules.get("shared_experts")
    if se is None:
        packed.shared_ok = True
    else:
        shared = expert_weights(se)
        if shared is not None and se.swiglu_limit == moe.swiglu_limit:
            s1, s3, s2 = shared
            if (s1.dtype == s3.dtype == s2.dtype and s1.dtype in KERNEL_DTYPES and s1.dim() == 2
                    and s1.shape == s3.shape and s1.shape[1] == D and s2.shape == (D, s1.shape[0])
                    and all(w.is_cpu and w.is_contiguous() for w in shared)):
                packed.shared, packed.shared_ok = shared, True
    moe.__dict__["_fast_moe"] = packed
    override(moe, "forward", _moe_forward)
    override(moe, "experts_forward", _experts_forward)
    override(moe, "dispatch", _dispatch)
    return True


@register(TensorParallelMoE)
def install_tensor_parallel_moe(moe: TensorParallelMoE) -> bool:
    """A tensor-parallel MoE (issue 28): its routed experts are the rank's intermediate slices, plain local
    :class:`Expert` modules, so ``dispatch`` (their weighted sum, local) takes the fast version as in
    :func:`install_moe`; its ``forward`` (the all-reduce) stays the parallel layer's."""
    if not install_moe(moe):
        return False
    for name in ("forward", "experts_forward"):
        del moe.__dict__[name]
        moe.__dict__[OVERRIDES].discard(name)
    return True


def _linear_weights(expert: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(w1, w3, w2)`` weights of an :class:`Expert` whose projections are ``nn.Linear`` (hooked or not); None for
    another module or a wrapped projection (e.g. LoRA-like, without a weight of its own)."""
    if type(expert) is not Expert:
        return None
    m = expert._modules
    ws = tuple(m[name]._parameters.get("weight") if type(m.get(name)) is nn.Linear else None
               for name in ("w1", "w3", "w2"))
    return None if any(w is None for w in ws) else ws


def _stack(experts: list[nn.Module], weights: list, inter: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E, 2 * inter, D], w2 [E, D, inter])``, after which each expert's ``w1`` / ``w3`` / ``w2`` parameter
    is a view of its slice (the memory is the same as before; loading or training in place updates both). Weights
    already laid out so (an earlier install) are not copied again."""
    E, first = len(experts), weights[0]
    size = first[0].element_size()
    base13, base2 = first[0].data_ptr(), first[2].data_ptr()
    if (first[0].untyped_storage().data_ptr() == weights[-1][1].untyped_storage().data_ptr()
            and first[2].untyped_storage().data_ptr() == weights[-1][2].untyped_storage().data_ptr()
            and all(w1.data_ptr() == base13 + 2 * e * inter * D * size
                    and w3.data_ptr() == base13 + (2 * e + 1) * inter * D * size
                    and w2.data_ptr() == base2 + e * inter * D * size for e, (w1, w3, w2) in enumerate(weights))):
        return (first[0].detach().as_strided((E, 2 * inter, D), (2 * inter * D, D, 1), first[0].storage_offset()),
                first[2].detach().as_strided((E, D, inter), (D * inter, inter, 1), first[2].storage_offset()))
    # Copied in expert by expert (no list of per-expert temporaries: at install the old and new layouts are both
    # resident, nothing more).
    w13 = first[0].new_empty((E, 2 * inter, D))
    w2 = first[2].new_empty((E, D, inter))
    for e, (w1, w3, w) in enumerate(weights):
        w13[e, :inter], w13[e, inter:], w2[e] = w1, w3, w
    for i, e in enumerate(experts):
        m = e._modules
        m["w1"].weight.data, m["w3"].weight.data, m["w2"].weight.data = w13[i, :inter], w13[i, inter:], w2[i]
    return w13, w2


def _pack_fp4(weights: list, inter: int, D: int) -> tuple[tuple[torch.Tensor, ...] | None, list[bool]]:
    """FP4 copies of every plain expert (None when no expert's weights are FP4 values) and, per expert, whether
    re-encoding gave its weights back exactly."""
    E, u8 = len(weights), torch.uint8
    copies = (torch.empty((E, 2 * inter, D // 2), dtype=u8), torch.empty((E, 2 * inter, D // 32), dtype=u8),
              torch.empty((E, D, inter // 2), dtype=u8), torch.empty((E, D, inter // 32), dtype=u8))
    ok = [False] * E
    for e, ws in enumerate(weights):
        if ws is None:
            continue
        exact = True
        for (codes, scales), at, w in ((copies[:2], slice(0, inter), ws[0]), (copies[:2], slice(inter, None), ws[1]),
                                       (copies[2:], slice(None), ws[2])):
            wide = w.float()
            c, sc, values = kernels.fp4_quantize(wide, FP4_EXPERT_BLOCK, "ue8m0", values=True)
            exact = torch.equal(values, wide)
            if not exact:
                break
            codes[e, at], scales[e, at] = c, sc
        ok[e] = exact
    return (copies if any(ok) else None), ok


def _pack_bf16(weights: list, stacked: tuple[torch.Tensor, torch.Tensor] | None, inter: int, D: int
               ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, list[bool]]:
    """bf16 experts: the stacked parameters themselves (when every expert is plain). fp32 experts: bf16 copies,
    expert e's usable when its weights are exact in bf16 (weights dequantized from the FP4 checkpoint format
    always are); they cost 2 bytes per routed-expert weight beside the fp32 parameters."""
    E = len(weights)
    dtype = next(ws for ws in weights if ws is not None)[0].dtype
    if dtype == torch.bfloat16:
        return (stacked, [ws is not None for ws in weights]) if stacked is not None else (None, [False] * E)
    w13, w2 = torch.empty((E, 2 * inter, D), dtype=torch.bfloat16), torch.empty((E, D, inter), dtype=torch.bfloat16)
    ok = [False] * E
    for e, ws in enumerate(weights):
        if ws is not None:
            w13[e], w2[e] = torch.cat(ws[:2]), ws[2]
            ok[e] = torch.equal(w13[e].float(), torch.cat(ws[:2])) and torch.equal(w2[e].float(), ws[2])
    return ((w13, w2) if any(ok) else None), ok


_ROWS_ALONE = threading.local()  # rows_alone() is on in this thread


@contextlib.contextmanager
def rows_alone():
    """Within (in this thread): a fast MoE forward over x [B, T, D] with B > 1 runs each row b as the forward of x[b]
    alone: the router and the expert path (fused kernel, grouped matmul) are chosen by the row's token count, and
    ``torch._grouped_mm`` rounds a row by how many rows its expert gets, so this is what makes a batched prefill
    (``ModelRunner.prefill_batch``, issue 25) give each sequence the bits of its chunk run alone."""
    before = getattr(_ROWS_ALONE, "on", False)
    _ROWS_ALONE.on = True
    try:
        yield
    finally:
        _ROWS_ALONE.on = before


def _moe_forward(self: MoE, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
    if x.dim() == 3 and x.shape[0] > 1 and getattr(_ROWS_ALONE, "on", False):
        return torch.cat([_moe_forward(self, x[b:b + 1], None if image_mask is None else image_mask[b:b + 1])
                          for b in range(x.shape[0])])
    flat = x.reshape(-1, x.shape[-1])
    indices, weights = self._modules["gate"](flat, None if image_mask is None else image_mask.reshape(-1))
    return _experts_forward(self, flat, indices, weights).reshape(x.shape)


def _experts_forward(self: MoE, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    packed = self.__dict__["_fast_moe"]
    if packed.shared_ok:
        out = _fused_experts(packed, flat, indices, weights, packed.shared, flat.dtype)
        if out is not None:
            return out
    return MoE.experts_forward(self, flat, indices, weights)


def _dispatch(self: MoE, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    packed = self.__dict__["_fast_moe"]
    out = _fused_experts(packed, flat, indices, weights, None, torch.float32)
    if out is not None:
        return out
    if flat.shape[0] == 1:
        # One token (batch-1 decode): its k experts in ascending id, summed in the order the reference's sorted
        # dispatch adds them, without its sort / gather / scatter bookkeeping.
        experts = self._modules["experts"]
        out = None
        for e, j in sorted(zip(indices[0].tolist(), range(indices.shape[-1]), strict=True)):
            y = cast(experts[e](flat), weights.dtype) * weights[:, j:j + 1]
            out = y if out is None else out + y
        return out
    if (packed.grouped and not torch.is_grad_enabled() and flat.dtype == packed.stacked[0].dtype
            and flat.is_cpu and hasattr(torch, "_grouped_mm")):
        # Every expert's rows in one grouped matmul per projection: no Python loop over experts.
        k = indices.shape[-1]
        flat_idx = indices.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        token_of = order // k
        slot_weight = weights.reshape(-1)[order]
        sorted_x = flat[token_of]
        out = torch.zeros(flat.shape, dtype=slot_weight.dtype, device=flat.device)
        counts = torch.bincount(flat_idx, minlength=self.n_experts)
        if sorted_x.dtype == torch.bfloat16:
            y = _grouped_padded(packed, sorted_x, counts)
        else:
            y = grouped_experts(packed, sorted_x, counts.cumsum(0).to(torch.int32))
        return out.index_add_(0, token_of, cast(y, out.dtype) * slot_weight[:, None])
    return MoE.dispatch(self, flat, indices, weights)


def _fused_experts(packed: Packed, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                   shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, out_dtype: torch.dtype
                   ) -> torch.Tensor | None:
    """The routed experts (and the shared expert's ``shared`` weights) of a few fp32 / bf16 tokens flat [N, D] in
    inference mode by ``moe_fp4`` or ``moe_bf16``: [N, D] summed in fp32, returned as ``out_dtype``; None when the
    kernels do not take them (a picked expert without an exact copy, other dtypes, more tokens)."""
    # The kernel reads the router weights as fp32 [N, k] (a hook on the gate may have cast them).
    if not (flat.dim() == 2 and flat.shape[0] <= kernels.FEW_ROWS and flat.shape[1] == packed.D
            and indices.dtype == torch.int64 and weights.dtype == torch.float32 and weights.shape == indices.shape
            and indices.shape[0] == flat.shape[0] and fused(flat, weights) and kernels.usable(indices)):
        return None
    if packed.pending is not None:
        pack_copies(packed)
    picked = None
    if packed.fp4 is not None:
        if not packed.fp4_all:
            picked = set(indices.flatten().tolist())
        if packed.fp4_all or _all_ok(packed.fp4_ok, picked):
            return kernels.moe_fp4(flat, indices, weights, *packed.fp4, packed.limit, shared=shared,
                                   out_dtype=out_dtype)
    if packed.bf16 is not None:
        if not packed.bf16_all and picked is None:
            picked = set(indices.flatten().tolist())
        if packed.bf16_all or _all_ok(packed.bf16_ok, picked):
            return kernels.moe_bf16(flat, indices, weights, *packed.bf16, packed.limit, shared=shared,
                                    out_dtype=out_dtype)
    return None


def _all_ok(ok: list[bool], picked: set[int]) -> bool:
    """Whether every picked expert id has an exact copy (an id outside [0, E) has none: the reference raises)."""
    return all(0 <= e < len(ok) and ok[e] for e in picked)


def _grouped_padded(packed: Packed, sorted_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_experts` of sorted_x [M, D] (rows grouped by expert, ``counts`` [E] rows each) with each group
    padded by zero rows to a multiple of GROUP_ROWS: bf16 grouped matmuls on the CPU go through oneDNN, which
    compiles a kernel for every new row count (~0.4 ms each), and a prefill chunk's per-expert counts are new almost
    every time; padded, a few row counts recur (bf16 prefill 1K: bench/README.md). Rows are computed independently
    of the padding. Returns [M, D]."""
    padded = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    experts = torch.arange(counts.numel(), device=counts.device)
    expert_of_row = torch.repeat_interleave(experts, counts)
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)  # padded start - packed start
    dest = torch.arange(sorted_x.shape[0], device=sorted_x.device) + shift[expert_of_row]
    x = sorted_x.new_zeros((int(padded.sum()), sorted_x.shape[1]))
    x[dest] = sorted_x
    return grouped_experts(packed, x, padded.cumsum(0).to(torch.int32))[dest]


def grouped_experts(packed: Packed, sorted_x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """:class:`Expert` of every row of ``sorted_x`` [M, D] (rows grouped by expert, ``offsets`` [E] int32 the
    cumulative row counts) -> [M, D] in x's dtype, by ``torch._grouped_mm`` on the stacked weights; the same
    arithmetic as the per-expert calls."""
    w13, w2 = packed.stacked
    inter = w2.shape[2]
    h = torch._grouped_mm(sorted_x, w13.transpose(1, 2), offs=offsets)
    hidden = swiglu(h[:, :inter], h[:, inter:], packed.limit)
    return torch._grouped_mm(cast(hidden, sorted_x.dtype), w2.transpose(1, 2), offs=offsets)
