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

from deepseek_v41.config import ModelConfig
from deepseek_v41.model.compressor import Compressor
from deepseek_v41.model.indexer import QUERY_CHUNK, Indexer, mask_invisible
from deepseek_v41.model.linear import Linear
from deepseek_v41.model.norm import RMSNorm, cast, upcast
from deepseek_v41.model.rope import RotaryEmbedding
from deepseek_v41.plan import LayerRole, LayerSpec


def sparse_attention(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, window: int,
                     topk: torch.Tensor | None, gather: Callable[[torch.Tensor], torch.Tensor] | None,
                     sink: torch.Tensor, scale: float, chunk: int = QUERY_CHUNK, banded: bool = True,
                     entry_probs: bool = False, shared_entries: torch.Tensor | None = None,
                     key_limit: torch.Tensor | None = None):
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

    ``key_limit`` [B, T] long (None: strictly causal, the code and bits of a text-only forward): the exclusive
    upper bound of the window-key positions each query sees, so its window is ``p - window < key_pos <
    key_limit``: ``p + 1`` for a text position, ``min(e, p + window)`` for a position of an image span [s, e)
    (bidirectional inside the span, as the issue and TensorRT-LLM / SGLang; MODEL_REFERENCE.md §3.18 says causal;
    VISION_DESIGN.md decision 1; :func:`deepseek_v41.model.vision.window_key_limit`). The keys after p are new
    rows (a span never straddles forwards), read through a second, forward band of at most ``window - 1`` rows,
    built only when some query looks ahead. Compressed entries stay causal (``topk`` decides them).

    Each query reads exactly its band of ``min(window, T)`` new rows (a strided view, no copy of the keys), the P
    earlier rows and its k entries, so the work is O(T x (window + P + k)) — no masked-out block work — and
    queries run in chunks of ``chunk`` so memory is O(chunk x (window + P + k)).
    """
    B, T, H, d = q.shape
    if T <= FEW_QUERIES and not entry_probs and shared_entries is None:
        return attend_few(q, q_pos, keys, key_pos, window, topk, gather, sink, scale, key_limit)
    P = keys.shape[1] - T if banded else keys.shape[1]
    wide = upcast(keys)
    prev, prev_pos = wide[:, :P], key_pos[:, :P]
    band = min(window, T) if banded else 0
    # Row i of the band view holds new rows i - band + 1 .. i (padding rows have position -1).
    if band:
        band_keys = torch.nn.functional.pad(wide[:, P:], (0, 0, band - 1, 0)).unfold(1, band, 1)  # [B, T, d, band]
        band_pos = torch.nn.functional.pad(key_pos[:, P:], (band - 1, 0), value=-1).unfold(1, band, 1)  # [B, T, band]
    ahead = _lookahead(q_pos, key_limit, window, T if banded else 0)
    # Row i of the forward band view holds new rows i + 1 .. i + ahead (padding rows have position -1).
    if ahead:
        ahead_keys = torch.nn.functional.pad(wide[:, P:], (0, 0, 0, ahead)).unfold(1, ahead, 1)[:, 1:]
        ahead_pos = torch.nn.functional.pad(key_pos[:, P:], (0, ahead), value=-1).unfold(1, ahead, 1)[:, 1:]
    out, picked = [], []
    for i0 in range(0, T, chunk):
        i1 = min(T, i0 + chunk)
        qc = upcast(q[:, i0:i1]).to(wide.dtype)
        qp = q_pos[:, i0:i1, None]
        parts = []
        if P:
            s_prev = torch.einsum("bchd,bld->bchl", qc, prev) * scale
            kp = prev_pos[:, None, :]
            upto = (kp <= qp) if key_limit is None else (kp < key_limit[:, i0:i1, None])
            seen = upto & (kp > qp - window) & (kp >= 0)
            parts.append(s_prev.masked_fill(~seen[:, :, None, :], float("-inf")))
        if band:
            bk = band_keys[:, i0:i1]
            s_band = torch.einsum("bchd,bcdw->bchw", qc, bk) * scale
            parts.append(s_band.masked_fill((band_pos[:, i0:i1] < 0)[:, :, None, :], float("-inf")))
        if ahead:
            ak, ap = ahead_keys[:, i0:i1], ahead_pos[:, i0:i1]
            s_ahead = torch.einsum("bchd,bcdw->bchw", qc, ak) * scale
            hidden = (ap < 0) | (ap >= key_limit[:, i0:i1, None])
            parts.append(s_ahead.masked_fill(hidden[:, :, None, :], float("-inf")))
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
        if ahead:
            o = o + torch.einsum("bchw,bcdw->bchd", probs[..., P + band: P + band + ahead], ak)
        if selected is not None:
            equation = "bchk,bkd->bchd" if shared_entries is not None else "bchk,bckd->bchd"
            o = o + torch.einsum(equation, probs[..., P + band + ahead:-1], selected)
            picked.append(probs[..., P + band + ahead:-1])
        out.append(o)
    o = torch.cat(out, 1).to(q.dtype)
    if entry_probs:
        return o, (torch.cat(picked, 1) if picked else q.new_zeros(B, T, H, 0))
    return o


def _lookahead(q_pos: torch.Tensor, key_limit: torch.Tensor | None, window: int, new_rows: int) -> int:
    """Width of :func:`sparse_attention`'s forward band: the most new rows after its own position any query may
    see (``key_limit - q_pos - 1``, at most ``window - 1`` and the ``new_rows - 1`` there are); 0 without
    ``key_limit`` or new rows. On ``meta`` (no values) the bound itself."""
    if key_limit is None or new_rows < 2:
        return 0
    bound = min(window - 1, new_rows - 1)
    if key_limit.device.type == "meta" or bound <= 0:
        return max(bound, 0)
    return max(0, min(bound, int((key_limit - q_pos).max()) - 1))


FEW_QUERIES = 16  # up to this many queries per row (decode, speculative verify) attention takes attend_few


def attend_few(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, window: int,
                topk: torch.Tensor | None, gather: Callable[[torch.Tensor], torch.Tensor] | None,
                sink: torch.Tensor, scale: float, key_limit: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`sparse_attention` for a few queries per row (decode, speculative verify): every query scores all
    window rows at once, masked by position alone (``p - window < key_pos <= p``, which is exactly the band
    for new rows at consecutive positions; with ``key_limit`` [B, T], ``p - window < key_pos < key_limit``), so
    the whole softmax is a handful of batched matmuls instead of a chunk loop of einsums. Same arguments, result
    and fp32 arithmetic as :func:`sparse_attention`."""
    B, T, H, d = q.shape
    wide = upcast(keys)  # [B, L, d]
    qc = cast(upcast(q), wide.dtype)
    scores = (qc.flatten(1, 2) @ wide.transpose(1, 2)).unflatten(1, (T, H)) * scale  # [B, T, H, L]
    qp, kp = q_pos[:, :, None], key_pos[:, None, :]
    upto = (kp <= qp) if key_limit is None else (kp < key_limit[:, :, None])
    seen = (kp >= 0) & upto & (kp > qp - window)  # [B, T, L]
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
        weight = self.weight.view(self.groups, self.rank, -1)
        B, T = x.shape[:2]
        y = x.reshape(B * T, self.groups, -1).transpose(0, 1) @ weight.transpose(1, 2)  # [groups, B*T, rank]
        return y.transpose(0, 1).reshape(B, T, -1)


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
        spec, pos = self.spec, ctx.positions
        q_lat, q, kv = self.project(x, pos, ctx.shared)
        keys, key_pos = ctx.window(spec.layer_id, kv)
        topk = gather = shared = None
        if spec.role is not LayerRole.WINDOW:
            if self.compressor is not None and compress:
                self.compress(x, ctx)
            if self.indexer is not None:
                ctx.shared[("topk", spec.layer_id)] = self.select(q_lat, x, ctx)
            topk = ctx.shared[("topk", spec.index_source)]
            source = spec.kv_source

            def gather(idx: torch.Tensor) -> torch.Tensor:
                return ctx.gather_entries(source, idx)

            if ctx.dense_indexer:  # training warm-up: every visible entry, read once for all queries
                shared = ctx.all_entries(source)
        learn = ctx.indexer_losses if self.indexer is not None else None  # training the indexer
        o = self.core(q, pos, keys, key_pos, self.window, topk, gather, self.attn_sink, self.head_dim ** -0.5,
                      self.query_chunk, ctx.banded_window, entry_probs=learn is not None, shared_entries=shared,
                      key_limit=ctx.key_limit)
        if learn is not None:  # the KL toward these probabilities: deepseek_v41.train.indexer_loss
            o, entry_probs = o
            learn.add(self, ctx, entry_probs, ctx.shared.pop(("indexer_scores", spec.layer_id)), topk)
        return self.output(o, pos, ctx.shared)

    def project(self, x: torch.Tensor, pos: torch.Tensor, cache: dict) -> tuple[torch.Tensor, ...]:
        """The query latent q_lat [B, T, q_lora_rank], the queries q [B, T, H, d] and the window KV [B, T, d] (one
        shared latent, post-RoPE) of x [B, T, D] at positions ``pos`` [B, T] (§3.4, §3.5); ``cache``: the
        forward's RoPE phases (:meth:`~deepseek_v41.model.rope.RotaryEmbedding.phases`)."""
        B, T, _ = x.shape
        q_lat = self.q_norm(self.wq_a(x))
        q = self.rope(self.wq_b(q_lat).view(B, T, self.n_heads, self.head_dim), pos, cache=cache)
        kv = self.rope(self.kv_norm(self.wkv(x)), pos, cache=cache)
        return q_lat, q, kv

    def output(self, o: torch.Tensor, pos: torch.Tensor, cache: dict) -> torch.Tensor:
        """The attention output o [B, T, H, d] back to the residual width [B, T, D]: inverse RoPE, then the
        grouped low-rank projection ``wo_b(wo_a(o))`` (§3.7)."""
        B, T = o.shape[:2]
        o = self.rope(o, pos, inverse=True, cache=cache)
        return self.wo_b(self.wo_a(o.reshape(B, T, self.o_groups, -1)))

    def compress(self, x: torch.Tensor, ctx) -> None:
        """Run the compressor over x [B, T, D] and store the completed entries (post-RoPE at entry positions g*m)
        and their index keys in ``ctx`` (§3.8, §3.9)."""
        layer = self.spec.layer_id
        latent, group, pending = self.compressor(x, ctx.positions, ctx.pending(layer))
        ctx.set_pending(layer, pending)
        if not ctx.completes_entries(layer):
            return  # e.g. a decode step whose token only opens a ratio-2 pair: no entry RoPE, no index keys
        entry_pos = group.clamp(min=0) * self.spec.compress_ratio
        key_input = latent.detach() if ctx.indexer_losses is not None else latent  # the keys learn from the KL only
        ctx.add_entries(layer, self.rope(latent, entry_pos), self.indexer.keys(key_input, entry_pos, self.rope), group)

    def select(self, q_lat: torch.Tensor, x: torch.Tensor, ctx) -> torch.Tensor:
        """Top-k entry indices [B, T, k] of this index-source layer (-1 = none), k = min(index_topk, entries)
        (§3.9, §3.10). The candidate source also records its pool (block mask) in ``ctx.shared``; a Reindex layer
        after it scores only inside that pool. Training (``ctx.indexer_losses``) records the indexer's scores of
        the picks; the dense warm-up (``ctx.dense_indexer``) picks every visible entry."""
        spec, indexer = self.spec, self.indexer
        training = ctx.indexer_losses is not None
        if training:  # the indexer learns from its KL loss only (deepseek_v41.train.indexer_loss)
            q_lat, x = q_lat.detach(), x.detach()
        B, T = q_lat.shape[:2]
        N = ctx.num_index_keys(spec.kv_source)
        k = min(self.index_topk, N)
        if k == 0:
            return torch.full((B, T, 0), -1, dtype=torch.long, device=x.device)
        q, w = indexer.queries(q_lat, x, ctx.positions, self.rope, ctx.fake_quant, ctx.shared)
        visible = torch.div(ctx.positions + 1, spec.compress_ratio, rounding_mode="floor")
        block, keep = self.candidate_block_size, self.candidate_topk_blocks
        # Reindex: score only the entries of each query's candidate pool (a pool holding every block restricts
        # nothing; the dense warm-up has none).
        pooled = spec.candidate_source is not None and keep * block < N and not ctx.dense_indexer
        picks, pools, scored = [], [], []
        keys = entries = None  # every index key / entry id, made once when some chunk scores them all
        whole = 0 < T <= self.query_chunk  # one chunk (decode): no slicing
        for i0 in range(0, T, self.query_chunk):
            rows = slice(i0, min(T, i0 + self.query_chunk))
            qc, wc, vis = (q, w, visible) if whole else (q[:, rows], w[:, rows], visible[:, rows])
            if pooled:
                blocks = ctx.shared[("pool", spec.candidate_source)]
                blocks = blocks if whole else blocks[:, rows]
                local_k = min(k, min(keep, blocks.shape[-1]) * block)
                picked = None if training else ctx.pool_topk(spec.kv_source, qc, wc, blocks, block, keep, vis, local_k)
                if picked is None:  # (the context's kernel: the same picks)
                    ids, valid = indexer.pool_entries(blocks, block, keep, N)
                    scores = indexer.score(qc, wc, ctx.index_keys_at(spec.kv_source, ids))
                    scores = mask_invisible(scores, ids, vis).masked_fill(~valid, float("-inf"))
                    local = indexer.topk_entries(scores, local_k)
                    picked = torch.where(local >= 0, ids.gather(-1, local.clamp(min=0)), -1)
                    if training:
                        scored.append(scores.gather(-1, local.clamp(min=0)))
                picks.append(picked)
                continue
            scores = None if training else ctx.index_scores(spec.kv_source, qc, wc, vis)  # (masked)
            if entries is None:
                entries = torch.arange(N, device=x.device)
            if scores is None:
                keys = ctx.index_keys(spec.kv_source) if keys is None else keys
                if not (training or ctx.dense_indexer):  # the picks (and pool) need no scores kept
                    pool = (block, keep) if spec.is_candidate_source else None
                    picked, pool_mask = indexer.select_entries(qc, wc, keys, vis, k, pool)
                    picks.append(picked)
                    if pool_mask is not None:
                        pools.append(pool_mask)
                    continue
                scores = mask_invisible(indexer.score(qc, wc, keys), entries, vis)
            if spec.is_candidate_source:
                pools.append(indexer.candidate_blocks(scores, vis, block, keep))
            if ctx.dense_indexer:  # every visible entry, entry n in column n
                picks.append(torch.where(entries < vis[..., None], entries, -1))
            else:
                picks.append(indexer.topk_entries(scores, k))
            if training:
                scored.append(scores if ctx.dense_indexer else scores.gather(-1, picks[-1].clamp(min=0)))
        if pools:
            ctx.shared[("pool", spec.layer_id)] = pools[0] if whole else torch.cat(pools, 1)
        if training:
            ctx.shared[("indexer_scores", spec.layer_id)] = torch.cat(scored, 1)
        return picks[0] if whole else torch.cat(picks, 1)
