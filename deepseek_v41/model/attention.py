"""Attention of one layer: q-LoRA query, shared-latent window KV, CSA2 compressed entries, one softmax with a
sink, grouped low-rank output (MODEL_REFERENCE.md §3.4–§3.11).

Every layer keeps its own query path, window KV, sink and output projection. A compressed layer also attends
to the compressed entries its index source selected: Full layers make entries and index keys (compressor +
indexer keys) and select their own top-k; Reindex layers select their own top-k over the entries of their kv
source (inside the candidate pool when there is one); Reuse layers use the top-k of their index source.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepseek_v41 import kernels
from deepseek_v41.config import ModelConfig
from deepseek_v41.model.compressor import Compressor
from deepseek_v41.model.hooks import plain_weights, unobserved
from deepseek_v41.model.indexer import (
    QUERY_CHUNK,
    Indexer,
    candidate_blocks,
    mask_invisible,
    pool_entries,
    topk_entries,
)
from deepseek_v41.model.linear import Linear, gemv
from deepseek_v41.model.norm import RMSNorm, cast, fused, upcast
from deepseek_v41.model.rope import RotaryEmbedding
from deepseek_v41.plan import LayerRole, LayerSpec


def sparse_attention(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, window: int,
                     topk: torch.Tensor | None, gather: Callable[[torch.Tensor], torch.Tensor] | None,
                     sink: torch.Tensor, scale: float, chunk: int = QUERY_CHUNK, banded: bool = True,
                     entry_probs: bool = False, shared_entries: torch.Tensor | None = None):
    """One softmax per (query, head) over its window keys and its selected compressed entries, with a sink.

    q [B, T, H, d]; q_pos [B, T]; keys [B, P + T, d] with key_pos [B, P + T]: the last T rows are the new tokens
    (consecutive positions, in order), the first P earlier rows (any order, -1 = empty); a key is in a query's
    window when ``p - window < key_pos <= p``. topk [B, T, k] entry indices (-1 = none) and
    ``gather(idx [B, c, k]) -> [B, c, k, d]`` fetch the compressed entries. K = V (one shared latent).
    ``o = Σ exp(s - m) v / (Σ exp(s - m) + exp(sink_h - m))`` in fp32 (float64 for a float64 model); a query with
    no valid key returns 0. Returns [B, T, H, d] in q's dtype. ``banded=False``: every row is treated like an
    earlier row (masked by position only; the DSpark draft block, whose rows all report the anchor position).
    ``entry_probs=True`` also returns the attention probabilities of the selected entries [B, T, H, k] (the
    indexer's training target), as ``(o, probs)``. ``shared_entries`` [B, N, d]: every query may attend every
    entry (training's dense warm-up); then ``topk`` is [B, T, N] with column n for entry n (-1 = not visible)
    and the entries are read once for all queries instead of gathered per query.

    Each query reads exactly its band of ``min(window, T)`` new rows (a strided view, no copy of the keys), the P
    earlier rows and its k entries, so the work is O(T x (window + P + k)) — no masked-out block work — and
    queries run in chunks of ``chunk`` so memory is O(chunk x (window + P + k)).
    """
    B, T, H, d = q.shape
    if T <= FEW_QUERIES and not entry_probs and shared_entries is None:
        return _attend_few(q, q_pos, keys, key_pos, window, topk, gather, sink, scale)
    P = keys.shape[1] - T if banded else keys.shape[1]
    wide = upcast(keys)
    prev, prev_pos = wide[:, :P], key_pos[:, :P]
    band = min(window, T) if banded else 0
    # Row i of the band view holds new rows i - band + 1 .. i (padding rows have position -1).
    if band:
        band_keys = torch.nn.functional.pad(wide[:, P:], (0, 0, band - 1, 0)).unfold(1, band, 1)  # [B, T, d, band]
        band_pos = torch.nn.functional.pad(key_pos[:, P:], (band - 1, 0), value=-1).unfold(1, band, 1)  # [B, T, band]
    out, picked = [], []
    for i0 in range(0, T, chunk):
        i1 = min(T, i0 + chunk)
        qc = upcast(q[:, i0:i1]).to(wide.dtype)
        qp = q_pos[:, i0:i1, None]
        parts = []
        if P:
            s_prev = torch.einsum("bchd,bld->bchl", qc, prev) * scale
            seen = (prev_pos[:, None, :] <= qp) & (prev_pos[:, None, :] > qp - window) & (prev_pos[:, None, :] >= 0)
            parts.append(s_prev.masked_fill(~seen[:, :, None, :], float("-inf")))
        if band:
            bk = band_keys[:, i0:i1]
            s_band = torch.einsum("bchd,bcdw->bchw", qc, bk) * scale
            parts.append(s_band.masked_fill((band_pos[:, i0:i1] < 0)[:, :, None, :], float("-inf")))
        selected = None
        if topk is not None and topk.shape[-1] > 0:
            idx = topk[:, i0:i1]
            if shared_entries is not None:
                selected = upcast(shared_entries).to(qc.dtype)  # [B, N, d], the same for every query
                s_c = torch.einsum("bchd,bnd->bchn", qc, selected) * scale
            else:
                selected = gather(idx).to(qc.dtype)  # [B, c, k, d]
                s_c = torch.einsum("bchd,bckd->bchk", qc, selected) * scale
            parts.append(s_c.masked_fill((idx < 0)[:, :, None, :], float("-inf")))
        parts.append(sink.to(qc.dtype).view(1, 1, H, 1).expand(B, i1 - i0, H, 1))
        probs = torch.softmax(torch.cat(parts, -1), dim=-1)
        o = torch.einsum("bchl,bld->bchd", probs[..., :P], prev)
        if band:
            o = o + torch.einsum("bchw,bcdw->bchd", probs[..., P: P + band], bk)
        if selected is not None:
            equation = "bchk,bkd->bchd" if shared_entries is not None else "bchk,bckd->bchd"
            o = o + torch.einsum(equation, probs[..., P + band:-1], selected)
            picked.append(probs[..., P + band:-1])
        out.append(o)
    o = torch.cat(out, 1).to(q.dtype)
    if entry_probs:
        return o, (torch.cat(picked, 1) if picked else q.new_zeros(B, T, H, 0))
    return o


FEW_QUERIES = 16  # up to this many queries per row (decode, speculative verify) attention takes _attend_few


def _attend_few(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, window: int,
                topk: torch.Tensor | None, gather: Callable[[torch.Tensor], torch.Tensor] | None,
                sink: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`sparse_attention` for a few queries per row (decode, speculative verify): every query scores all
    window rows at once, masked by position alone (``p - window < key_pos <= p``, which is exactly the band
    for new rows at consecutive positions), so the whole softmax is a handful of batched matmuls instead of a
    chunk loop of einsums. Same arguments, result and fp32 arithmetic as :func:`sparse_attention`."""
    B, T, H, d = q.shape
    if (fused(q, keys, sink) and q_pos.dtype == key_pos.dtype == torch.int64 and H <= kernels.MAX_ATTEND_HEADS
            and kernels.usable(q_pos, key_pos)):  # fp32 on the CPU in inference mode: one fused kernel
        selected = None
        if topk is not None and topk.shape[-1] > 0:
            selected, topk = cast(gather(topk), torch.float32).contiguous(), topk.contiguous()
        else:
            topk = None
        if H * d <= kernels.ROW_ON_STACK:  # (bf16 queries read and the output written as they are)
            return kernels.attend_few(q, q_pos, upcast(keys), key_pos, window, selected, topk, upcast(sink), scale)
        return cast(kernels.attend_few(upcast(q), q_pos, upcast(keys), key_pos, window, selected, topk, upcast(sink),
                                       scale), q.dtype)
    wide = upcast(keys)  # [B, L, d]
    qc = cast(upcast(q), wide.dtype)
    scores = (qc.flatten(1, 2) @ wide.transpose(1, 2)).unflatten(1, (T, H)) * scale  # [B, T, H, L]
    qp, kp = q_pos[:, :, None], key_pos[:, None, :]
    seen = (kp >= 0) & (kp <= qp) & (kp > qp - window)  # [B, T, L]
    parts = [scores.masked_fill(~seen[:, :, None, :], float("-inf"))]
    selected = None
    if topk is not None and topk.shape[-1] > 0:
        selected = cast(gather(topk), qc.dtype)  # [B, T, k, d]
        s_c = (qc @ selected.transpose(-1, -2)) * scale  # [B, T, H, k]
        parts.append(s_c.masked_fill((topk < 0)[:, :, None, :], float("-inf")))
    parts.append(cast(sink, qc.dtype).view(1, 1, H, 1).expand(B, T, H, 1))
    probs = torch.softmax(torch.cat(parts, -1), dim=-1)
    L = wide.shape[1]
    o = (probs[..., :L].flatten(1, 2) @ wide).unflatten(1, (T, H))
    if selected is not None:
        o = o + probs[..., L:-1] @ selected
    return cast(o, q.dtype)


def indexer_kl(entry_probs: torch.Tensor, indexer_scores: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """KL(main attention || indexer) over the selected entries, averaged over queries with any entry.

    entry_probs [B, T, H, k]: the main attention's probabilities of the selected entries (summed over heads and
    renormalised into the target, no gradient); indexer_scores [B, T, k]: the indexer's scores of the same entries
    (softmax = the indexer's distribution); topk [B, T, k] (-1 = no entry). As DeepSeek trained V3.2's lightning
    indexer: the LM loss gives top-k selection no gradient, so the indexer learns from this KL alone.
    """
    valid = topk >= 0
    target = entry_probs.detach().sum(2).masked_fill(~valid, 0.0)
    total = target.sum(-1, keepdim=True)
    target = target / total.clamp_min(torch.finfo(target.dtype).tiny)
    log_q = torch.log_softmax(indexer_scores.masked_fill(~valid, float("-inf")), dim=-1)
    terms = torch.where(valid & (target > 0), target * (torch.log(target.clamp_min(1e-30)) - log_q), 0.0)
    rows = valid.any(-1) & (total[..., 0] > 0)
    kl = terms.sum(-1)
    return (kl * rows).sum() / rows.sum().clamp_min(1)


def indexer_recall(entry_probs: torch.Tensor, selection: torch.Tensor, visible: torch.Tensor) -> tuple[float, ...]:
    """Share of the dense attention mass over compressed entries that falls on the indexer's selection, summed
    over queries that see more entries than they select, with the share a random selection of the same size
    would get, and the number of such queries: ``(recall_sum, random_sum, queries)``.

    entry_probs [B, T, H, N] (dense attention over every entry); selection [B, T, k] (-1 = none); visible
    [B, T, N] (entry n in column n, -1 = not visible).
    """
    mass = entry_probs.detach().sum(2)
    total = mass.sum(-1)
    picked = (mass.gather(-1, selection.clamp(min=0)) * (selection >= 0)).sum(-1)
    n_visible = (visible >= 0).sum(-1)
    n_selected = (selection >= 0).sum(-1)
    rows = (n_visible > n_selected) & (total > 0)
    recall = (picked / total.clamp_min(1e-30))[rows]
    random = (n_selected / n_visible.clamp(min=1))[rows]
    return float(recall.sum()), float(random.sum()), int(rows.sum())


class SparseAttention(nn.Module):
    """:func:`sparse_attention` as a parameterless module (so that FLOPs accounting can name its matmuls)."""

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return sparse_attention(*args, **kwargs)


class GroupedLinear(nn.Module):
    """Block-diagonal projection (``wo_a``, MODEL_REFERENCE.md §3.7): ``weight`` [groups * rank, in_features]
    (the official shape) viewed [groups, rank, in_features]; x [B, T, groups, in_features] -> [B, T, groups * rank].
    """

    def __init__(self, in_features: int, groups: int, rank: int):
        super().__init__()
        self.groups, self.rank = groups, rank
        self.weight = nn.Parameter(torch.empty(groups * rank, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and x.shape[2] == self.groups and gemv(x, self.weight, fp32=True):  # a few tokens: one call
            return kernels.linear(x.flatten(-2), self.weight, self.groups)
        weight = self.weight.view(self.groups, self.rank, -1)
        B, T = x.shape[:2]
        y = x.reshape(B * T, self.groups, -1).transpose(0, 1) @ weight.transpose(1, 2)  # [groups, B*T, rank]
        return y.transpose(0, 1).reshape(B, T, -1)


PAIR_PHASES = "compress pair phases"  # ctx.shared key of Attention._pair_phases


class Attention(nn.Module):
    """Attention sub-layer of layer ``spec.layer_id``: x [B, T, D] -> [B, T, D] (see module docstring).

    Parameter names follow the official checkpoint (``wq_a``, ``q_norm``, ``wq_b``, ``wkv``, ``kv_norm``,
    ``wo_a``, ``wo_b``, ``attn_sink``, ``compressor.*``, ``indexer.*``).
    """

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.n_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        self.o_groups = cfg.o_groups
        self.o_lora_rank = cfg.o_lora_rank
        self.index_topk = cfg.index_topk
        self.candidate_block_size = cfg.candidate_block_size
        self.candidate_topk_blocks = cfg.candidate_topk_blocks
        eps = cfg.rms_norm_eps
        D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.wq_a = Linear(D, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * d, bias=False)
        self.wkv = Linear(D, d, bias=False)
        self.kv_norm = RMSNorm(d, eps)
        self.query_chunk = QUERY_CHUNK  # queries per attention / indexer chunk: bounds activation memory
        self.wo_a = GroupedLinear(H * d // cfg.o_groups, cfg.o_groups, cfg.o_lora_rank)
        self.core = SparseAttention()
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, D, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.rope = RotaryEmbedding(cfg.qk_rope_head_dim, spec.rope_theta, cfg.yarn if spec.yarn else None)
        self.compressor = Compressor(D, d, spec.compress_ratio, eps) if spec.is_kv_source else None
        self.indexer = (Indexer(D, cfg.q_lora_rank, d, cfg.index_n_heads, cfg.index_head_dim, spec.is_kv_source, eps)
                        if spec.is_index_source else None)

    def forward(self, x: torch.Tensor, ctx, compress: bool = True) -> torch.Tensor:
        """x [B, T, D] (attention input, already normalised) -> [B, T, D]. ``compress=False`` skips the
        compressor (CED: the first decoder layer's entries were already made over all tokens)."""
        B, T, _ = x.shape
        pos = ctx.positions
        phases = self._few_token_phases(x, pos, ctx.shared)
        weights = self._plain_projections(x) if phases is not None else None
        if weights is not None:  # one kernel call for the seven module calls below
            wq_a, q_norm, wq_b, wkv, kv_norm = weights
            q_lat, q, kv = kernels.attn_prologue(x, wq_a, q_norm, self._modules["q_norm"].eps, wq_b, self.n_heads, wkv,
                                                 kv_norm, self._modules["kv_norm"].eps, *phases)
        else:
            q_lat = self.q_norm(self.wq_a(x))
            q = self.rope(self.wq_b(q_lat).view(B, T, self.n_heads, self.head_dim), pos, cache=ctx.shared)
            kv = self.rope(self.kv_norm(self.wkv(x)), pos, cache=ctx.shared)
        keys, key_pos = ctx.window(self.spec.layer_id, kv)
        topk = gather = shared = None
        compressor, indexer = self._modules.get("compressor"), self._modules.get("indexer")  # (None: not a source)
        if self.spec.role is not LayerRole.WINDOW:
            if compressor is not None and compress:
                self.compress(x, ctx, phases)
            if indexer is not None:
                ctx.shared[("topk", self.spec.layer_id)] = self.select(q_lat, x, ctx, phases)
            topk = ctx.shared[("topk", self.spec.index_source)]
            source = self.spec.kv_source

            def gather(idx: torch.Tensor) -> torch.Tensor:
                return ctx.gather_entries(source, idx)

            if ctx.dense_indexer:  # training warm-up: every visible entry, read once for all queries
                shared = ctx.all_entries(source)
            if ctx.drop_compressed:  # ablation: window attention only
                topk = None

        train_indexer = indexer is not None and ctx.indexer_losses is not None
        o = self._modules["core"](q, pos, keys, key_pos, self.window, topk, gather, self._parameters["attn_sink"],
                                  self.head_dim ** -0.5, self.query_chunk, ctx.banded_window, entry_probs=train_indexer,
                                  shared_entries=shared)
        if train_indexer:
            o, entry_probs = o
            ctx.indexer_losses.append(indexer_kl(entry_probs, ctx.shared.pop(("indexer_scores", self.spec.layer_id)),
                                                 topk))
            if ctx.indexer_recall is not None and ctx.dense_indexer:
                ctx.indexer_recall.append(
                    (self.spec.layer_id, *indexer_recall(entry_probs, ctx.shared.pop(("selection", self.spec.layer_id)),
                                                         topk)))
        out_weights = self._plain_output(o) if phases is not None else None
        if out_weights is not None:  # inverse RoPE, wo_a and wo_b in one kernel call
            return kernels.attn_epilogue(o, *phases, out_weights[0], self.o_groups, out_weights[1])
        o = self.rope(o, pos, inverse=True, cache=ctx.shared)
        return self.wo_b(self.wo_a(o.reshape(B, T, self.o_groups, -1)))

    def _few_token_phases(self, x: torch.Tensor, pos: torch.Tensor, cache: dict
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE phases (cos, sin) fp32 [B, T, r] when the few-token kernels (:func:`kernels.attn_prologue` /
        :func:`~deepseek_v41.kernels.attn_epilogue`) may stand in for the module calls: at most FEW_ROWS tokens
        x [B, T, D] in inference mode on the CPU, and a plain RoPE module; else None."""
        rope = self._modules["rope"]  # (submodules through _modules: Module.__getattr__ costs ~1 µs a lookup)
        r = rope.rope_dim
        if not (x.dim() == 3 and x.shape[0] * x.shape[1] <= kernels.FEW_ROWS and 0 < r <= self.head_dim
                and r % 2 == 0 and fused(x) and unobserved(rope, RotaryEmbedding)):
            return None
        cos, sin = rope.phases(pos, cache)
        if cos.dtype != torch.float32 or cos.shape != (*x.shape[:2], r) or not fused(cos, sin):
            return None
        return cos, sin

    def _plain_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The weights of ``wq_a``, ``q_norm``, ``wq_b``, ``wkv``, ``kv_norm`` when calling them is exactly computing
        them: plain modules (no hook, no wrapper, no bias), contiguous weights of x's dtype and of the shapes the
        kernel reads (a replaced weight of another shape takes the module calls, which raise); else None."""
        m = self._modules
        weights = plain_weights((m["wq_a"], Linear), (m["q_norm"], RMSNorm), (m["wq_b"], Linear), (m["wkv"], Linear),
                                (m["kv_norm"], RMSNorm))
        if weights is None:
            return None
        D, qr, d = x.shape[-1], weights[0].shape[0] if weights[0].dim() == 2 else -1, self.head_dim
        shapes = ((qr, D), (qr,), (self.n_heads * d, qr), (d, D), (d,))
        if all(w.dtype == x.dtype and w.shape == s for w, s in zip(weights, shapes, strict=True)) and fused(*weights):
            return tuple(weights)
        return None

    def _plain_output(self, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The same for ``wo_a`` (a GroupedLinear) and ``wo_b`` on the attention output o [B, T, H, d]: their
        weights, or None."""
        a = self._modules["wo_a"]
        weights = plain_weights((a, GroupedLinear), (self._modules["wo_b"], Linear))
        if weights is None or not (o.dim() == 4 and fused(o)):
            return None
        wo_a, wo_b = weights
        G, (H, d) = self.o_groups, o.shape[2:]
        if not (a.groups == G and wo_a.dim() == 2 and wo_a.shape[0] % G == 0 and H * d % G == 0
                and wo_a.shape[1] == H * d // G and wo_b.dim() == 2 and wo_b.shape[1] == wo_a.shape[0]):
            return None
        return (wo_a, wo_b) if wo_a.dtype == wo_b.dtype == o.dtype and fused(wo_a, wo_b) else None

    def compress(self, x: torch.Tensor, ctx, phases: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Run the compressor over x [B, T, D] and store the completed entries and their index keys (a few tokens
        in inference mode on the CPU: one kernel call, :meth:`_compress_few`; ``phases``: the forward's
        :meth:`_few_token_phases` of x, when it has them)."""
        layer = self.spec.layer_id
        pending = ctx.pending(layer)
        if self._compress_few(x, ctx, pending, phases):
            return
        latent, group, pending = self.compressor(x, ctx.positions, pending)
        ctx.set_pending(layer, pending)
        if not ctx.completes_entries(layer):
            return  # e.g. a decode step whose token only opens a ratio-2 pair: no entry RoPE, no index keys
        entry_pos = group.clamp(min=0) * self.spec.compress_ratio
        key_input = latent.detach() if ctx.indexer_losses is not None else latent
        ctx.add_entries(layer, self.rope(latent, entry_pos), self.indexer.keys(key_input, entry_pos, self.rope), group)

    def _compress_few(self, x: torch.Tensor, ctx, pending: tuple[torch.Tensor, torch.Tensor] | None,
                      phases: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """:meth:`compress` in one :func:`kernels.compress` call (compressor, entry RoPE, index keys) plus
        ``ctx.set_pending`` / ``ctx.add_entries``, when that is exactly what the module calls compute: a few tokens
        (:meth:`_few_token_phases`), plain modules of the shapes the kernel reads (:meth:`_plain_compressor`),
        int64 positions, fp32 pending pairs [B, d] and no indexer training. Returns False, having done nothing,
        otherwise (the caller then runs the module calls). ``phases``: :meth:`_few_token_phases` of x if known."""
        weights = self._plain_compressor(x)
        pos = ctx.positions
        if weights is None or ctx.indexer_losses is not None or x.shape[1] == 0:
            return False
        if phases is None:
            phases = self._few_token_phases(x, pos, ctx.shared)
        if phases is None or pos.dtype != torch.int64 or pos.shape != x.shape[:2] or not pos.is_cpu:
            return False
        pos = pos.contiguous()  # DenseContext's positions: one arange expanded over the rows
        ratio = self._modules["compressor"].ratio
        if ratio == 2 and pending is not None:
            kv, score = pending
            shape = (x.shape[0], self.head_dim)
            if not (kv.dtype == score.dtype == torch.float32 and kv.shape == score.shape == shape and kv.is_cpu
                    and score.is_cpu and kv.stride() == score.stride() and kv.stride(1) == 1):
                return False
        layer = self.spec.layer_id
        completes = ctx.completes_entries(layer)
        if completes and ratio == 2:  # the pairs' entry positions: start - 1 .. start + T - 1 (kernels.compress)
            phases = self._pair_phases(pos, ctx.shared)
        _, group, pending, entries, keys = kernels.compress(x, pos, ratio, pending if ratio == 2 else None,
                                                            phases if completes else None, *weights)
        ctx.set_pending(layer, pending)
        if completes:
            ctx.add_entries(layer, entries, keys, group)
        return True

    def _plain_compressor(self, x: torch.Tensor) -> tuple | None:
        """``(wkv, wgate or None, norm weight, norm eps, wk, k_norm weight, k_norm eps)`` (the order of
        :func:`kernels.compress`) when calling the compressor and the indexer's key modules is exactly computing
        them: plain modules (no hook, no wrapper, no bias; the RoPE module is checked by
        :meth:`_few_token_phases`), contiguous weights of x's dtype and of the shapes the kernel reads (a replaced
        weight of another shape takes the module calls, which raise); else None."""
        c, ix = self._modules["compressor"], self._modules["indexer"]
        if not (unobserved(c, Compressor) and unobserved(ix, Indexer) and "wk" in ix._modules
                and c.ratio == self.spec.compress_ratio):
            return None
        D, d, di = x.shape[-1], self.head_dim, ix.head_dim
        cm, im = c._modules, ix._modules
        modules = [(cm["wkv"], Linear), (cm["norm"], RMSNorm), (im["wk"], Linear), (im["k_norm"], RMSNorm)]
        shapes = [(d, D), (d,), (di, d), (di,)]
        if c.ratio == 2:
            modules.append((cm["wgate"], Linear))
            shapes.append((d, D))
        weights = plain_weights(*modules)
        if (weights is None or self._modules["rope"].rope_dim > di or not fused(*weights)
                or any(w.dtype != x.dtype or w.shape != s for w, s in zip(weights, shapes, strict=True))):
            return None
        wkv, norm, wk, k_norm = weights[:4]
        return wkv, weights[4] if c.ratio == 2 else None, norm, cm["norm"].eps, wk, k_norm, im["k_norm"].eps

    def _pair_phases(self, pos: torch.Tensor, cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE phases (cos, sin) fp32 [B, T + 1, r] at positions ``start - 1 .. start + T - 1`` of each row of
        ``pos`` [B, T] (consecutive rows): every position a ratio-2 entry completed by these tokens can have
        (:func:`kernels.compress`). Kept in ``cache`` (the forward's ``ctx.shared``), so the forward's other
        ratio-2 layers with this RoPE table reuse them."""
        table = cache.get(PAIR_PHASES)
        if table is None:
            table = cache[PAIR_PHASES] = {"positions": torch.cat((pos[:, :1] - 1, pos), 1)}
        return self.rope.phases(table["positions"], table)

    def select(self, q_lat: torch.Tensor, x: torch.Tensor, ctx,
               phases: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Top-k entry indices [B, T, k] of this index-source layer (-1 = none), k = min(index_topk, entries).
        ``phases``: those of :meth:`_few_token_phases` (the indexer's queries then take their kernel), or None.

        The candidate source also records its pool (block mask) in ``ctx.shared``; a Reindex layer after it
        scores only inside that pool.
        """
        spec = self.spec
        training = ctx.indexer_losses is not None
        if training:  # the indexer learns from its KL loss only (module docstring of deepseek_v41.train.indexer)
            q_lat, x = q_lat.detach(), x.detach()
        B, T = q_lat.shape[:2]
        N = ctx.num_index_keys(spec.kv_source)
        k = min(self.index_topk, N)
        if k == 0:
            return torch.full((B, T, 0), -1, dtype=torch.long, device=x.device)
        indexer = self._modules["indexer"]
        q, w = indexer.queries(q_lat, x, ctx.positions, self._modules["rope"], ctx.fake_quant, ctx.shared, phases)
        visible = torch.div(ctx.positions + 1, spec.compress_ratio, rounding_mode="floor")
        picks, pools, picked_scores, selections = [], [], [], []
        all_entries = None  # torch.arange(N), made only where the torch code needs it
        pooled = spec.candidate_source is not None and not ctx.dense_indexer
        keys = None  # every index key, read only when some chunk scores them all
        whole = 0 < T <= self.query_chunk  # one chunk (decode): no slicing
        for i0 in range(0, T, self.query_chunk):
            i1 = min(T, i0 + self.query_chunk)
            qc, wc, vis = (q, w, visible) if whole else (q[:, i0:i1], w[:, i0:i1], visible[:, i0:i1])
            if pooled and self.candidate_topk_blocks * self.candidate_block_size < N:
                # Reindex: score only the entries of each query's candidate pool.
                blocks = ctx.shared[("pool", spec.candidate_source)]
                blocks = blocks if whole else blocks[:, i0:i1]
                block, keep = self.candidate_block_size, self.candidate_topk_blocks
                local_k = min(k, min(keep, blocks.shape[-1]) * block)
                picked = None if training else ctx.pool_topk(spec.kv_source, qc, wc, blocks, block, keep, vis, local_k)
                if picked is not None:  # the fused kernel: the same picks as the torch code below
                    picks.append(picked)
                    continue
                ids, valid = pool_entries(blocks, block, keep, N)
                scores = indexer.score(qc, wc, ctx.index_keys_at(spec.kv_source, ids))
                scores = mask_invisible(scores, ids, vis).masked_fill(~valid, float("-inf"))
                local = topk_entries(scores, local_k)
                picks.append(torch.where(local >= 0, ids.gather(-1, local.clamp(min=0)), -1))
                if training:
                    picked_scores.append(scores.gather(-1, local.clamp(min=0)))
                continue
            scores = None if training or ctx.dense_indexer else ctx.index_scores(spec.kv_source, qc, wc, vis)
            if all_entries is None and (scores is None or ctx.dense_indexer):
                all_entries = torch.arange(N, device=x.device)
            if scores is None:  # (the context's scores come masked)
                if keys is None:
                    keys = ctx.index_keys(spec.kv_source)
                scores = mask_invisible(indexer.score(qc, wc, keys), all_entries, vis)
            if spec.is_candidate_source:
                pools.append(candidate_blocks(scores, vis, self.candidate_block_size, self.candidate_topk_blocks))
            if ctx.dense_indexer:  # warm-up: every visible entry, entry n in column n
                picks.append(torch.where(all_entries < vis[..., None], all_entries, -1))
                if training:
                    picked_scores.append(scores)
                if ctx.indexer_recall is not None:  # what inference would select, for the recall measurement
                    chosen = scores
                    if spec.candidate_source is not None and self.candidate_topk_blocks * self.candidate_block_size < N:
                        blocks = ctx.shared[("pool", spec.candidate_source)][:, i0:i1]
                        ids, valid = pool_entries(blocks, self.candidate_block_size, self.candidate_topk_blocks, N)
                        inside = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, valid)
                        chosen = scores.masked_fill(~inside, float("-inf"))
                    selections.append(topk_entries(chosen, min(self.index_topk, N)))
                continue
            picks.append(topk_entries(scores, k))  # a pool holding every block restricts nothing
            if training:
                picked_scores.append(scores.gather(-1, picks[-1].clamp(min=0)))
        if pools:
            ctx.shared[("pool", spec.layer_id)] = pools[0] if whole else torch.cat(pools, 1)
        if training:
            ctx.shared[("indexer_scores", spec.layer_id)] = torch.cat(picked_scores, 1)
        if selections:
            ctx.shared[("selection", spec.layer_id)] = torch.cat(selections, 1)
        return picks[0] if whole else torch.cat(picks, 1)
