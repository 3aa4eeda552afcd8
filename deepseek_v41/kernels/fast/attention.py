"""Fast paths of the attention layer (:mod:`deepseek_v41.model.attention`, ``indexer``, ``compressor``): installed
once per module instance by :func:`deepseek_v41.kernels.fast.install` (see that package's docstring).

- :class:`~deepseek_v41.model.attention.Attention`: ``project`` (``wq_a``, ``q_norm``, ``wq_b``, ``wkv``,
  ``kv_norm`` and both RoPEs) in one :func:`kernels.attn_prologue` call, ``output`` (inverse RoPE, ``wo_a``,
  ``wo_b``) in one :func:`kernels.attn_epilogue` call, and ``compress`` (compressor, entry RoPE, index keys) in one
  :func:`kernels.compress` call, for at most ``kernels.FEW_ROWS`` tokens (decode, speculative verify);
- :class:`~deepseek_v41.model.attention.SparseAttention`: :func:`kernels.attend_few` for a few queries per row
  (causal windows only: a forward with image spans runs the reference), and for a prefill chunk the logits and
  weighted sums in C around torch's softmax (:func:`kernels.band_logits`, :func:`kernels.band_output`: the
  reference's bits);
- :class:`~deepseek_v41.model.attention.GroupedLinear`: the grouped GEMV :func:`kernels.linear` for small inputs;
- :class:`~deepseek_v41.model.indexer.Indexer`: ``queries`` in one :func:`kernels.indexer_queries` call (a few
  tokens), the selection rules ``topk_entries`` / ``candidate_blocks`` / ``pool_entries`` in C
  (:func:`kernels.topk_set`, :func:`kernels.candidate_blocks`) and ``select_entries`` (a prefill chunk's scores,
  masking, top-k and candidate pool) in one :func:`kernels.index_select` call: exactly the reference's indices.

Each installer checks once that the modules the kernel stands in for are plain (exactly their class, no hook of
their own, no bias), that their weights are CPU tensors of one kernel dtype (fp32 or bf16), contiguous and of the
shapes the kernel reads; the fast method then checks only the input of each call (:func:`fused`, token counts,
dtypes, the RoPE phases) and otherwise calls the reference method. The projections agree with the reference to
rounding (bf16: to the bit where the module calls round alike), the selections exactly.

Two module calls stay observable per call: the compressor (the model runner hooks it for each speculative verify
step, to capture the pending pair's input, so ``compress`` checks for its hooks on every call) and the RoPE module
an ``Indexer.queries`` call is given (passed per call). Any other hook or weight change after install needs
:func:`deepseek_v41.kernels.fast.install` again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepseek_v41 import kernels
from deepseek_v41.kernels.attention import BAND_MAX_DIM
from deepseek_v41.kernels.fast.registry import (
    KERNEL_DTYPES,
    fused,
    global_hooks,
    hooked,
    override,
    plain,
    plain_weight,
    register,
)
from deepseek_v41.model import attention as attention_module
from deepseek_v41.model.attention import Attention, GroupedLinear, SparseAttention, sparse_attention
from deepseek_v41.model.compressor import Compressor
from deepseek_v41.model.indexer import (
    QUERY_CHUNK,
    Indexer,
    IndexScorer,
    candidate_blocks,
    pool_entries,
    topk_entries,
    topk_set,
)
from deepseek_v41.model.linear import Linear
from deepseek_v41.model.norm import RMSNorm, cast, upcast
from deepseek_v41.model.rope import RotaryEmbedding

PAIR_PHASES = "compress pair phases"  # ctx.shared key of the ratio-2 entries' RoPE phases (see _pair_phases)
BAND_MIN = 16  # rows, entries and dims from which the reference's einsums sum each dot as one chain (attend)
FP32_GEMV_WEIGHTS = 1 << 16  # fp32 weights from this size take the grouped GEMV for a few tokens (model/linear.py)


def _weights(*modules: tuple[torch.nn.Module | None, type[torch.nn.Module]]) -> list[torch.Tensor] | None:
    """The weights of plain bias-free ``(module, cls)`` pairs (:func:`plain_weight`), all of one kernel dtype, on
    the CPU and contiguous; else None."""
    weights = [plain_weight(m, cls) for m, cls in modules]
    if any(w is None for w in weights):
        return None
    dtype = weights[0].dtype
    if dtype not in KERNEL_DTYPES or any(w.dtype != dtype or not w.is_cpu or not w.is_contiguous() for w in weights):
        return None
    return weights


def _shaped(weights: list[torch.Tensor], shapes: list[tuple[int, ...]]) -> bool:
    return all(tuple(w.shape) == s for w, s in zip(weights, shapes, strict=True))


def _phases(rope: RotaryEmbedding, x: torch.Tensor, pos: torch.Tensor, cache: dict | None
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RoPE phases (cos, sin) fp32 [B, T, r] of ``rope`` at ``pos`` when the few-token kernels take them for x
    [B, T, ...]: fp32, of that shape, contiguous on the CPU in inference mode; else None."""
    cos, sin = rope.phases(pos, cache)
    if cos.dtype != torch.float32 or cos.shape != (*x.shape[:2], rope.rope_dim) or not fused(cos, sin):
        return None
    return cos, sin


def _few(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """x [B, T, ...] of ``dtype`` holds at most FEW_ROWS tokens and the kernels take it now (:func:`fused`)."""
    return x.shape[0] * x.shape[1] <= kernels.FEW_ROWS and x.dtype == dtype and fused(x)


def _plain_rope(rope: torch.nn.Module, width: int) -> bool:
    """A plain RoPE module whose rotated pairs fit in ``width`` dims (what the kernels rotate)."""
    return plain(rope, RotaryEmbedding) and 0 < rope.rope_dim <= width and rope.rope_dim % 2 == 0


# ------------------------------------------------------------------------------------------------ Attention
@register(Attention)
def install_attention(m: Attention) -> bool:
    """``project`` / ``output`` / ``compress`` of one layer (module docstring); True when any was installed."""
    mods = m._modules
    rope = mods["rope"]
    if not _plain_rope(rope, m.head_dim):
        return False
    done = False
    H, d = m.n_heads, m.head_dim
    w = _weights((mods["wq_a"], Linear), (mods["q_norm"], RMSNorm), (mods["wq_b"], Linear), (mods["wkv"], Linear),
                 (mods["kv_norm"], RMSNorm))
    if w is not None and w[0].dim() == 2:
        qr, D = w[0].shape
        if _shaped(w, [(qr, D), (qr,), (H * d, qr), (d, D), (d,)]):
            _install_project(m, rope, w, mods["q_norm"].eps, mods["kv_norm"].eps)
            done = True
    a, b = mods["wo_a"], mods["wo_b"]
    w = _weights((a, GroupedLinear), (b, Linear))
    G = m.o_groups
    if (w is not None and a.groups == G and w[0].dim() == 2 and w[0].shape[0] % G == 0 and H * d % G == 0
            and w[0].shape[1] == H * d // G and w[1].dim() == 2 and w[1].shape[1] == w[0].shape[0]):
        _install_output(m, rope, *w)
        done = True
    return _install_compress(m, rope) or done


def _install_project(m: Attention, rope: RotaryEmbedding, w: list[torch.Tensor], q_eps: float, kv_eps: float) -> None:
    wq_a, q_norm, wq_b, wkv, kv_norm = w
    dtype, D, heads = wq_a.dtype, wq_a.shape[1], m.n_heads
    reference = Attention.project
    m.__dict__["_fast_project"] = (wq_a, q_norm, q_eps, wq_b, wkv, kv_norm, kv_eps)  # (the decode plan reads them)

    def project(self: Attention, x: torch.Tensor, pos: torch.Tensor, cache: dict) -> tuple[torch.Tensor, ...]:
        if x.dim() == 3 and x.shape[-1] == D and _few(x, dtype):
            phases = _phases(rope, x, pos, cache)
            if phases is not None:  # one kernel call for the seven module calls
                return kernels.attn_prologue(x, wq_a, q_norm, q_eps, wq_b, heads, wkv, kv_norm, kv_eps, *phases)
        return reference(self, x, pos, cache)

    override(m, "project", project)


def _install_output(m: Attention, rope: RotaryEmbedding, wo_a: torch.Tensor, wo_b: torch.Tensor) -> None:
    dtype, groups, width = wo_a.dtype, m.o_groups, wo_a.shape[1] * m.o_groups
    reference = Attention.output
    m.__dict__["_fast_output"] = (wo_a, wo_b)  # (the decode plan reads them)

    def output(self: Attention, o: torch.Tensor, pos: torch.Tensor, cache: dict) -> torch.Tensor:
        if o.dim() == 4 and o.shape[2] * o.shape[3] == width and _few(o, dtype):
            phases = _phases(rope, o, pos, cache)
            if phases is not None:  # inverse RoPE, wo_a and wo_b in one kernel call
                return kernels.attn_epilogue(o, *phases, wo_a, groups, wo_b)
        return reference(self, o, pos, cache)

    override(m, "output", output)


def _install_compress(m: Attention, rope: RotaryEmbedding) -> bool:
    """``compress`` in one :func:`kernels.compress` call plus ``ctx.set_pending`` / ``ctx.add_entries``: plain
    compressor and index-key modules (the compressor's hooks checked per call) of the shapes the kernel reads."""
    c, ix = m._modules.get("compressor"), m._modules.get("indexer")
    if not (plain(c, Compressor) and plain(ix, Indexer) and "wk" in ix._modules and c.ratio == m.spec.compress_ratio
            and rope.rope_dim <= ix.head_dim):
        return False
    cm, im = c._modules, ix._modules
    mods = [(cm["wkv"], Linear), (cm["norm"], RMSNorm), (im["wk"], Linear), (im["k_norm"], RMSNorm)]
    if c.ratio == 2:
        mods.append((cm["wgate"], Linear))
    w = _weights(*mods)
    if w is None or w[0].dim() != 2:
        return False
    d, di, (_, D) = m.head_dim, ix.head_dim, w[0].shape
    if not _shaped(w, [(d, D), (d,), (di, d), (di,), (d, D)][:len(w)]):
        return False
    ratio, layer, dtype = c.ratio, m.spec.layer_id, w[0].dtype
    weights = (w[0], w[4] if ratio == 2 else None, w[1], cm["norm"].eps, w[2], w[3], im["k_norm"].eps)
    m.__dict__["_fast_compress"] = weights  # (wkv, wgate, norm, eps, wk, k_norm, k_eps): the decode plan reads them
    reference = Attention.compress

    def compress(self: Attention, x: torch.Tensor, ctx) -> None:
        pos = ctx.positions
        if not (x.dim() == 3 and x.shape[1] > 0 and x.shape[-1] == D and _few(x, dtype) and not hooked(c)
                and ctx.indexer_losses is None and pos.dtype == torch.int64 and pos.shape == x.shape[:2]
                and pos.is_cpu):
            return reference(self, x, ctx)
        phases = _phases(rope, x, pos, ctx.shared)
        if phases is None:
            return reference(self, x, ctx)
        pos = pos.contiguous()  # DenseContext's positions: one arange expanded over the rows
        pending = ctx.pending(layer) if ratio == 2 else None
        if pending is not None:
            kv, score = pending
            shape = (x.shape[0], d)
            if not (kv.dtype == score.dtype == torch.float32 and kv.shape == score.shape == shape and kv.is_cpu
                    and score.is_cpu and kv.stride() == score.stride() and kv.stride(1) == 1):
                return reference(self, x, ctx)
        completes = ctx.completes_entries(layer)
        if completes and ratio == 2:  # the pairs' entry positions: start - 1 .. start + T - 1 (kernels.compress)
            phases = _pair_phases(rope, pos, ctx.shared)
        _, group, pending, entries, keys = kernels.compress(x, pos, ratio, pending, phases if completes else None,
                                                            *weights)
        ctx.set_pending(layer, pending)
        if completes:
            ctx.add_entries(layer, entries, keys, group)
        return None

    override(m, "compress", compress)
    return True


def _pair_phases(rope: RotaryEmbedding, pos: torch.Tensor, cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE phases (cos, sin) fp32 [B, T + 1, r] at positions ``start - 1 .. start + T - 1`` of each row of
    ``pos`` [B, T] (consecutive rows): every position a ratio-2 entry completed by these tokens can have
    (:func:`kernels.compress`). Kept in ``cache`` (the forward's ``ctx.shared``), so the forward's other
    ratio-2 layers with this RoPE table reuse them."""
    table = cache.get(PAIR_PHASES)
    if table is None:
        table = cache[PAIR_PHASES] = {"positions": torch.cat((pos[:, :1] - 1, pos), 1)}
    return rope.phases(table["positions"], table)


# ------------------------------------------------------------------------------------------- SparseAttention
@register(SparseAttention)
def install_sparse_attention(m: SparseAttention) -> bool:
    """:func:`kernels.attend_few` for up to ``FEW_QUERIES`` queries per row (no parameters to check)."""
    override(m, "forward", attend)
    return True


def attend(self: SparseAttention, q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor,
           window: int, topk: torch.Tensor | None, gather: Callable[[torch.Tensor], torch.Tensor] | None,
           sink: torch.Tensor, scale: float, chunk: int = QUERY_CHUNK, banded: bool = True, entry_probs: bool = False,
           shared_entries: torch.Tensor | None = None, key_limit: torch.Tensor | None = None):
    """:func:`~deepseek_v41.model.attention.sparse_attention`; a few queries per row in fp32 / bf16 on the CPU in
    inference mode take one fused kernel (the reference's :func:`~deepseek_v41.model.attention.attend_few` in C).
    A forward with image spans (``key_limit`` not None: bidirectional window keys inside a span) always runs the
    reference: the kernel's window is causal, and image spans only come in prefill chunks, not decode steps."""
    B, T, H, d = q.shape
    if (key_limit is None and T <= attention_module.FEW_QUERIES and not entry_probs and shared_entries is None
            and fused(q, keys, sink)
            and q_pos.dtype == key_pos.dtype == torch.int64 and H <= kernels.MAX_ATTEND_HEADS
            and kernels.usable(q_pos, key_pos)):
        selected = None
        if topk is not None and topk.shape[-1] > 0:
            selected, topk = cast(gather(topk), torch.float32).contiguous(), topk.contiguous()
        else:
            topk = None
        if H * d <= kernels.ROW_ON_STACK:  # (bf16 queries read and the output written as they are)
            return kernels.attend_few(q, q_pos, upcast(keys), key_pos, window, selected, topk, upcast(sink), scale)
        return cast(kernels.attend_few(upcast(q), q_pos, upcast(keys), key_pos, window, selected, topk, upcast(sink),
                                       scale), q.dtype)
    prev, k = keys.shape[1] - T, 0 if topk is None else topk.shape[-1]
    # (each GEMM of the reference at least BAND_MIN wide and the heads a multiple of 4: other shapes ATen / MKL sum
    # in another order, measured)
    if (key_limit is None and banded and not entry_probs and shared_entries is None and min(window, T) >= BAND_MIN
            and (prev == 0 or prev >= BAND_MIN) and (k == 0 or k >= BAND_MIN) and BAND_MIN <= d <= BAND_MAX_DIM
            and H % 4 == 0 and keys.dim() == 3 and q.dtype in KERNEL_DTYPES and fused(keys, sink)
            and q_pos.dtype == key_pos.dtype == torch.int64 and kernels.usable(q_pos, key_pos)):
        return _attend_band(q, q_pos, keys, key_pos, window, topk, gather, sink, scale, chunk)
    return sparse_attention(q, q_pos, keys, key_pos, window, topk, gather, sink, scale, chunk, banded,
                            entry_probs=entry_probs, shared_entries=shared_entries, key_limit=key_limit)


def _attend_band(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, window: int,
                 topk: torch.Tensor | None, gather: Callable[[torch.Tensor], torch.Tensor] | None, sink: torch.Tensor,
                 scale: float, chunk: int) -> torch.Tensor:
    """:func:`~deepseek_v41.model.attention.sparse_attention` of a prefill forward (causal, banded, no entry
    probabilities) with its matmuls in C (issue 25): per chunk of queries, :func:`kernels.band_logits` makes the
    logits it concatenates, torch's softmax runs on them, and :func:`kernels.band_output` makes its weighted sums.
    The same chunks, gathers and casts as the reference, and the kernels make its einsums' sums: the same bits."""
    B, T, H, d = q.shape
    prev = keys.shape[1] - T
    wide = upcast(keys).contiguous()
    key_pos = key_pos.contiguous()
    sink = sink.to(torch.float32).contiguous()
    out = []
    for i0 in range(0, T, chunk):
        i1 = min(T, i0 + chunk)
        qc = upcast(q[:, i0:i1]).to(wide.dtype).contiguous()
        idx = selected = None
        if topk is not None and topk.shape[-1] > 0:
            idx = topk[:, i0:i1].contiguous()
            selected = gather(idx).to(qc.dtype).contiguous()
        logits = kernels.band_logits(qc, q_pos[:, i0:i1].contiguous(), wide, key_pos, prev, i0, window, selected, idx,
                                     sink, scale)
        out.append(kernels.band_output(torch.softmax(logits, dim=-1), wide, prev, i0, window, selected))
    return torch.cat(out, 1).to(q.dtype)


# --------------------------------------------------------------------------------------------- GroupedLinear
@register(GroupedLinear)
def install_grouped_linear(m: GroupedLinear) -> bool:
    """The grouped GEMV :func:`kernels.linear` for inputs [B, T, groups, in] small enough (see ``forward``)."""
    w = _weights((m, GroupedLinear))
    if w is None or w[0].dim() != 2 or w[0].shape[0] % m.groups:
        return False
    weight, groups = w[0], m.groups
    dtype, (O, K) = weight.dtype, weight.shape
    big = weight.numel() >= FP32_GEMV_WEIGHTS
    reference = GroupedLinear.forward

    def forward(self: GroupedLinear, x: torch.Tensor) -> torch.Tensor:
        # bf16: up to FEW_ROWS tokens or GEMV_MACS multiply-adds (ATen's bf16 GEMV costs ~20 µs a call at any small
        # size); fp32: up to GEMV_MACS multiply-adds (the torch code is several ops), or a few tokens of a large
        # weight while the kernels' pool has at least torch's threads (model/linear.py's few_token_gemv).
        if x.dim() == 4 and x.shape[2] == groups and x.shape[-1] == K and x.dtype == dtype:
            macs = x.numel() * O
            if dtype == torch.bfloat16:
                take = x.shape[0] * x.shape[1] * groups <= kernels.FEW_ROWS or macs <= kernels.GEMV_MACS
            else:
                take = macs <= kernels.GEMV_MACS or (big and x.shape[0] * x.shape[1] * groups <= kernels.FEW_ROWS
                                                     and kernels.threads() >= torch.get_num_threads())
            if take and fused(x):
                return kernels.linear(x.flatten(-2), weight, groups)
        return reference(self, x)

    override(m, "forward", forward)
    return True


# --------------------------------------------------------------------------------------------------- Indexer
@register(Indexer)
def install_indexer(m: Indexer) -> bool:
    """The selection rules in C (always: they give the reference's indices) and, with plain ``wq_b`` /
    ``weights_proj``, the few-token queries kernel."""
    override(m, "topk_entries", _topk_entries)
    override(m, "candidate_blocks", _candidate_blocks)
    override(m, "pool_entries", _pool_entries)
    override(m, "select_entries", _select_entries)
    w = _weights((m._modules["wq_b"], Linear), (m._modules["weights_proj"], Linear))
    heads, di = m.n_heads, m.head_dim
    if w is not None and w[0].dim() == 2 and w[1].dim() == 2 and w[0].shape[0] == heads * di and w[1].shape[0] == heads:
        _install_queries(m, *w)
    return True


def _install_queries(m: Indexer, wq_b: torch.Tensor, weights_proj: torch.Tensor) -> None:
    dtype, heads, di = wq_b.dtype, m.n_heads, m.head_dim
    qr, D = wq_b.shape[1], weights_proj.shape[1]
    reference = Indexer.queries
    m.__dict__["_fast_queries"] = (wq_b, weights_proj)  # (the decode plan reads them)

    def queries(self: Indexer, q_lat: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, rope: torch.nn.Module,
                fake_quant: bool, rope_cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if (q_lat.dim() == x.dim() == 3 and q_lat.shape[:2] == x.shape[:2] and q_lat.shape[-1] == qr
                and x.shape[-1] == D and (di % 32 == 0 or not fake_quant) and _plain_rope(rope, di)
                and _few(x, dtype) and q_lat.dtype == dtype and fused(q_lat)):
            phases = _phases(rope, x, positions, rope_cache)
            if phases is not None:
                return kernels.indexer_queries(q_lat, x, wq_b, heads, weights_proj, *phases, fake_quant)
        return reference(self, q_lat, x, positions, rope, fake_quant, rope_cache)

    override(m, "queries", queries)


def _topk_set(scores: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`~deepseek_v41.model.indexer.topk_set` from one C call when it takes the scores (the same indices)."""
    if scores.dtype == torch.float32 and kernels.usable(scores):
        picked = kernels.topk_set(scores, k)
        if picked is not None:
            return picked
    return topk_set(scores, k)


def _topk_entries(self: Indexer, scores: torch.Tensor, k: int) -> torch.Tensor:
    if scores.dtype == torch.float32 and kernels.usable(scores):
        picked = kernels.topk_set(scores, k, drop_neg_inf=True)
        if picked is not None:
            return picked
    return topk_entries(scores, k)


def _candidate_blocks(self: Indexer, scores: torch.Tensor, visible: torch.Tensor, block: int,
                      keep: int) -> torch.Tensor:
    if (scores.dtype == torch.float32 and visible.dtype == torch.int64 and scores.dim() == 3
            and visible.shape == scores.shape[:2] and scores.shape[-1] > 0 and kernels.usable(scores, visible)):
        mask = kernels.candidate_blocks(scores, visible, block, keep)  # the same mask from one C call
        if mask is not None:
            return mask
    return candidate_blocks(scores, visible, block, keep)


def _select_entries(self: Indexer, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                    k: int, pool: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:meth:`~deepseek_v41.model.indexer.Indexer.select_entries` in one :func:`kernels.index_select` call (the same
    picks and pool, without the [B, c, N] scores) for fp32 queries and fp32 / bf16 keys (the keys are FP4 values,
    exact in both) on the CPU in inference mode, while the scorer is a plain IndexScorer (no hook: its call is not
    observed); else the reference. A single key runs the reference too: ATen's product is then a GEMV, which sums
    in another order than the kernel's chain (with scores that overflow, -inf there where the chain stays finite)."""
    score = self._modules["score"]
    if (q.dim() == 4 and q.dtype == w.dtype == torch.float32 and keys.dim() == 3 and visible.dtype == torch.int64
            and w.shape == q.shape[:3] and visible.shape == q.shape[:2] and keys.shape[0] == q.shape[0]
            and keys.shape[2] == q.shape[3] and keys.shape[1] > 1 and 0 <= k <= keys.shape[1]
            and plain(score, IndexScorer) and not global_hooks()):
        q, w, keys32, visible = q.contiguous(), w.contiguous(), upcast(keys).contiguous(), visible.contiguous()
        if fused(q, w, keys32) and kernels.usable(visible):
            picked = kernels.index_select(q, w, keys32, visible, k, pool)
            if picked is not None:
                return picked
    return Indexer.select_entries(self, q, w, keys, visible, k, pool)


def _pool_entries(self: Indexer, blocks: torch.Tensor, block: int, keep: int,
                  n_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pool_entries(blocks, block, keep, n_entries, topk=_topk_set)
