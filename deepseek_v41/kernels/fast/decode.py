"""A decode step's layers in one C call (issue 25): the fast ``Transformer.run_layers`` hands a one-token-per-row
step over the paged KV cache to :func:`run_decode`, which runs its layers through ``dsv41_decode_layers``
(``csrc/decode.c``). That C function makes the same kernel calls the installed module paths make (fast/block.py,
fast/attention.py, fast/moe.py, cache/paged_context.py), in the same order and with the same arguments, without the
~20 module calls, overrides, per-call checks and ``ctypes`` conversions per layer between them; so its logits,
tokens and KV cache state are the module path's bit for bit (tests/kernels/test_decode_plan.py).

What the module paths decide per call is decided here once: per model, when the plan is built (:func:`decode_plan`:
every block of the kinds the kernels serve, its weights' addresses, dtypes and shapes, no hooks), per KV cache
(:func:`_bind`: the pools' and pending pairs' addresses, in a :class:`_Bound` kept weakly per cache), and per step
(:func:`step_ok`: the streams, positions, context, and no hook registered since). A model or step that fails a check
runs the module loop. Per step, Python computes the RoPE phases with the torch code and makes one call per
``kernels.FEW_ROWS`` rows and run of layers between Engram layers (an Engram module runs in Python between calls).
A kernel that declines inside the call (a NaN among the indexer's scores) makes the C code restore the step's
pending pairs; the whole step then reruns on the module path, which rewrites everything else with the same bytes.

The plan is kept on the model under a ``_fast_`` key, so :func:`deepseek_v41.kernels.fast.uninstall` drops it with
the other fast paths. Source: SPEC.md §4.1 (the engine's decode), the reference forward of
:class:`~deepseek_v41.model.block.Block` and :class:`~deepseek_v41.model.attention.Attention`; bench/README.md,
"Eighth round".
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass, field

import torch

from deepseek_v41 import kernels
from deepseek_v41.kernels.fast.attention import _weights
from deepseek_v41.kernels.fast.block import _block_forward, embed_streams, lm_head
from deepseek_v41.kernels.fast.moe import pack_copies
from deepseek_v41.kernels.fast.registry import any_hooked, hooked, override, register
from deepseek_v41.kernels.fast.warm import warm
from deepseek_v41.kernels.loader import register as register_signatures
from deepseek_v41.model.attention import Attention, SparseAttention
from deepseek_v41.model.block import Block
from deepseek_v41.model.indexer import Indexer
from deepseek_v41.model.moe import Gate, MoE
from deepseek_v41.model.norm import RMSNorm, upcast
from deepseek_v41.model.rope import RotaryEmbedding
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.plan import LayerRole

_PLAN = "_fast_decode_plan"  # on the model's __dict__ (uninstall drops "_fast_" entries)
ROPES = 4  # DSV41_ROPES: RoPE tables (settings) one plan may read
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
register_signatures({"dsv41_decode_layers": ([_P, _I, _I, _P], ctypes.c_int)})


@register(Transformer)
def install_transformer(m: Transformer) -> bool:
    """Replace ``run_layers`` (:func:`run_decode` for a decode step the plan takes, else the reference loop with
    :func:`~deepseek_v41.kernels.fast.warm.warm` before each block of a few-token step), ``lm_head`` and
    ``embed_streams`` (:func:`deepseek_v41.kernels.fast.block.lm_head`, :func:`~.block.embed_streams`)."""
    override(m, "run_layers", _run_layers)
    override(m, "lm_head", lm_head)
    override(m, "embed_streams", embed_streams)
    return True


def _run_layers(self: Transformer, layers: range, streams: torch.Tensor, pre: torch.Tensor, ctx,
                image_mask: torch.Tensor | None = None, engram_rows: dict[int, torch.Tensor] | None = None,
                taps: dict[int, torch.Tensor] | None = None,
                skip_compress: set[int] | frozenset[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    usable = kernels.usable(streams)
    few = streams.shape[0] * streams.shape[1] <= kernels.FEW_ROWS and usable
    if (usable and image_mask is None and streams.shape[1] == 1 and layers.step == 1
            and torch.is_inference_mode_enabled()):
        plan = decode_plan(self)
        bound = step_ok(streams, ctx, plan) if plan is not None and plan.closed(layers) else None
        if bound is not None:
            if len(layers) == 0:
                return streams, pre
            done = run_decode(plan, bound, layers, streams, pre, ctx, skip_compress, taps, engram_rows)
            if done is not None:
                return done
    blocks = list(self._modules["layers"]._modules.values())  # (indexing a ModuleList costs ~1 µs)
    for j in layers:
        block = blocks[j]
        if few:  # decode / verify: the objects this block reads were evicted since its last step (warm.py)
            warm(block)
        if block.engram is not None:
            streams = block.engram(streams, engram_rows[j], image_mask)
        if taps is not None:
            taps[j] = streams
        streams, pre = block(streams, pre, ctx, image_mask, compress=j not in skip_compress)
    return streams, pre


class _Layer(ctypes.Structure):
    """``dsv41_decode_layer`` of csrc/dsv41.h, field by field: one block's weights (addresses), sizes and roles."""

    _fields_ = [(n, _I) for n in ("layer", "hc", "D", "bf16", "iters")] + [
        ("norm_eps", _F), ("hc_eps", _F), ("mix", _P * 6), ("attn_norm", _P), ("ffn_norm", _P),
        ("attn_norm_eps", _F), ("ffn_norm_eps", _F),
        *((n, _P) for n in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm")), ("q_eps", _F), ("kv_eps", _F),
        *((n, _I) for n in ("qr", "H", "d", "r", "rope")), ("wo_a", _P), ("wo_b", _P),
        *((n, _I) for n in ("groups", "rank", "window")), ("sink", _P), ("scale", _F), ("iq_scale", _F),
        *((n, _I) for n in ("sparse", "kv_source", "index_source", "candidate_source", "is_candidate_source", "ratio",
                            "src_ratio", "compress", "pending_index", "di")),
        *((n, _P) for n in ("c_wkv", "c_wgate", "c_norm", "c_wk", "c_knorm")), ("c_eps", _F), ("c_keps", _F),
        *((n, _I) for n in ("index", "iH", "idi", "index_topk", "block", "keep")), ("iq_wq_b", _P), ("iq_wproj", _P),
        ("pools", _P * 4), ("pool_pages", _I), ("per_page", _I), ("gate_w", _P), ("gate_bias", _P),
        *((n, _I) for n in ("gate_bf16", "E", "k_experts", "norm_topk", "moe_kind", "inter", "s_bf16", "s_inter")),
        ("route_scale", _F), ("limit", _F), *((n, _P) for n in ("w13", "w2", "s1", "s3", "s2", "sc13", "sc2")),
    ]


class _Step(ctypes.Structure):
    """``dsv41_decode_step`` of csrc/dsv41.h: one call's rows, positions, block tables, RoPE phases, cache and
    buffers (see :func:`run_decode`)."""

    _fields_ = [(n, _I) for n in ("B", "R", "ring_layers", "pending_layers", "table_len", "block_size", "lut_rows",
                                  "topk_width", "pool_width", "failed_layer")] + [
        *((n, _P) for n in ("positions", "slots", "tables", "write_from", "skip_compress")),
        *((n, _P * ROPES) for n in ("cos", "sin", "pair_cos", "pair_sin")),
        *((n, _P) for n in ("ring_codes", "ring_scales", "ring_pos", "pending", "streams_in", "pre_in")),
        ("streams", _P * 2), ("streams_out", _P), ("pre_out", _P),
        *((n, _P) for n in ("topk", "k", "nblocks", "written", "pool")), ("taps", _P), ("taps_stride", _I),
    ]


@dataclass
class DecodePlan:
    """A model's decode plan: each block's ``_Layer`` (``layers``, a ctypes array), the tensors their addresses
    point into (``keep``: fp32 widenings made here), the modules whose hooks each step checks (``watch``), each
    layer's RoPE module by phase-table index (``ropes``), the model's dtype and blocks, the widest top-k, whether
    some layer keeps ratio-2 pending pairs (``ratio2``) or compresses at all (``compressing``), and the plan bound
    to each KV cache it served (``bound``: :class:`_Bound`, weakly keyed by the cache)."""

    layers: ctypes.Array
    keep: list
    watch: list
    ropes: list
    dtype: torch.dtype
    blocks: list
    index_topk: int
    ratio2: bool
    compressing: bool = False
    bound: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    ranges: dict = field(default_factory=dict)  # (start, stop) -> runs or None (see runs)
    watch_dicts: list = field(default_factory=list)  # the watched modules' __dict__s (see hooked_any)
    phase_tables: dict = field(default_factory=dict)  # RoPE table index -> (cos, sin) by position (see _phases)

    def __post_init__(self) -> None:
        self.watch_dicts = [m.__dict__ for m in self.watch]

    def hooked_any(self) -> bool:
        """Whether a watched module has a hook of its own (``registry.any_hooked``: ~0.1 ms a step less than
        ``hooked`` of each, issue 25). The hook dicts are read each time: code that clears hooks by assigning a new
        dict is seen too."""
        return any_hooked(self.watch_dicts)

    def closed(self, layers: range) -> bool:
        """Whether ``layers`` (consecutive) can run alone: no layer in it reads the picks or candidate pool of an
        index / candidate source outside it, and none outside reads one inside. The C call keeps those in its own
        buffers for the layers it runs, while the module path hands them between ``run_layers`` calls of one step
        in ``ctx.shared`` (CED runs the encoder half and the decoder half in two calls): a range that is not closed
        runs the module path."""
        return self.runs(layers) is not None

    def runs(self, layers: range) -> list[tuple[int, int]] | None:
        """``layers`` (consecutive, closed) as the ``[first, stop)`` runs of one C call each: a new run starts at
        each Engram layer (its module runs in Python first); None when the range is not :meth:`closed`. Worked
        out once per range."""
        key = (layers.start, layers.stop)
        if key not in self.ranges:
            inside = range(layers.start, layers.stop)
            closed = all((j in inside) == (src in inside) for j, L in enumerate(self.layers) if L.sparse
                         for src in (L.index_source, L.candidate_source) if src >= 0)
            cuts = [j for j in inside if j == inside.start or self.blocks[j].engram is not None]
            runs = list(zip(cuts, [*cuts[1:], inside.stop][:len(cuts)], strict=True))  # (none for no layers)
            self.ranges[key] = runs if closed else None
        return self.ranges[key]


def decode_plan(model) -> DecodePlan | None:
    """The model's decode plan (built at the first call, then kept; see the module docstring), or None when some
    block is not one the plan serves: a plain :class:`Block` (its Engram module, if any, runs in Python) with the
    fast block forward installed, plain fp32 / bf16 norms, attention projections, RoPE, compressor and indexer of
    the shapes their kernels read, a :class:`MoE` with the fast router and every routed expert packed exactly (FP4,
    else bf16), the shared expert fused, and no hooks."""
    plan = model.__dict__.get(_PLAN)
    if plan is None:
        plan = _build(model)
        model.__dict__[_PLAN] = plan if plan is not None else False
    return plan or None


def _build(model) -> DecodePlan | None:
    blocks = list(model._modules["layers"]._modules.values())
    specs = [getattr(b, "spec", None) for b in blocks]
    keep, watch, ropes, layers = [], [], [], []
    for block in blocks:
        layer = _layer(block, specs, keep, watch, ropes)
        if layer is None:
            return None
        layers.append(layer)
    if not layers or len({layer.bf16 for layer in layers}) != 1:
        return None
    array = (_Layer * len(layers))(*layers)
    dtype = torch.bfloat16 if layers[0].bf16 else torch.float32
    ratio2 = any(layer.compress and layer.ratio == 2 for layer in layers)
    return DecodePlan(array, keep, watch, ropes, dtype, blocks, max(layer.index_topk for layer in layers), ratio2,
                      any(layer.compress for layer in layers))


def _addr(t: torch.Tensor | None, keep: list) -> int | None:
    if t is None:
        return None
    keep.append(t)
    return t.data_ptr()


def _layer(block, specs: list, keep: list, watch: list, ropes: list) -> _Layer | None:
    """One block's ``_Layer`` (None when the plan cannot serve it: see :func:`decode_plan`)."""
    if (type(block) is not Block or hooked(block)
            or getattr(block.__dict__.get("forward"), "__func__", None) is not _block_forward
            or block.__dict__.get("_fast_norms") != (True, True) or block.hc > kernels.MAX_HC):
        return None
    mods = block._modules
    attn, moe = mods["attn"], mods["ffn"]
    if type(attn) is not Attention or type(moe) is not MoE:
        return None
    a = attn._modules
    rope, core = a["rope"], a["core"]
    # The projections' weights as the attention's installers checked and packed them (fast/attention.py).
    project, output = attn.__dict__.get("_fast_project"), attn.__dict__.get("_fast_output")
    if (project is None or output is None or type(core) is not SparseAttention or "forward" not in core.__dict__
            or type(rope) is not RotaryEmbedding or not 0 < rope.rope_dim <= attn.head_dim or rope.rope_dim % 2
            or attn.n_heads > kernels.MAX_ATTEND_HEADS):
        return None
    wq_a, q_norm, q_eps, wq_b, wkv, kv_norm, kv_eps = project
    norms = _weights((mods["attn_norm"], RMSNorm), (mods["ffn_norm"], RMSNorm))
    if norms is None:
        return None
    dtype, D, hc = wq_a.dtype, norms[0].shape[0], block.hc
    if (output[0].dtype != dtype or norms[0].dtype != dtype or D > kernels.ROW_ON_STACK
            or wq_a.shape[1] != D or output[1].shape[0] != D):
        return None
    spec = attn.spec
    L = _Layer(layer=spec.layer_id, hc=hc, D=D, bf16=int(dtype == torch.bfloat16), iters=block.hc_iters,
               norm_eps=block.norm_eps, hc_eps=block.hc_eps)
    p = block._parameters
    mix = [_addr(upcast(p[f"hc_{site}_{name}"].detach()).contiguous(), keep) for site in ("attn", "ffn")
           for name in ("fn", "base", "scale")]
    L.mix = (_P * 6)(*mix)
    L.attn_norm, L.ffn_norm = _addr(norms[0], keep), _addr(norms[1], keep)
    L.attn_norm_eps, L.ffn_norm_eps = mods["attn_norm"].eps, mods["ffn_norm"].eps
    L.wq_a, L.q_norm, L.wq_b, L.wkv, L.kv_norm = (_addr(w, keep) for w in (wq_a, q_norm, wq_b, wkv, kv_norm))
    L.q_eps, L.kv_eps = q_eps, kv_eps
    L.qr, L.H, L.d, L.r = wq_a.shape[0], attn.n_heads, attn.head_dim, rope.rope_dim
    table = next((i for i, other in enumerate(ropes) if other._table == rope._table), None)
    if table is None:
        if len(ropes) == ROPES:
            return None
        ropes.append(rope)
        table = len(ropes) - 1
    L.rope = table
    L.wo_a, L.wo_b = _addr(output[0], keep), _addr(output[1], keep)
    L.groups = attn.o_groups
    L.rank, L.window = output[0].shape[0] // attn.o_groups, attn.window
    L.sink = _addr(upcast(attn._parameters["attn_sink"].detach()).contiguous(), keep)
    L.scale = attn.head_dim ** -0.5
    watch += [block, attn, moe, core, a["rope"]]
    L.sparse = int(spec.role is not LayerRole.WINDOW)
    L.kv_source = L.index_source = L.candidate_source = -1
    L.ratio = L.src_ratio = 1
    if L.sparse:
        L.kv_source, L.index_source, L.ratio = spec.kv_source, spec.index_source, spec.compress_ratio
        L.src_ratio = specs[spec.kv_source].compress_ratio
        L.candidate_source = -1 if spec.candidate_source is None else spec.candidate_source
        L.is_candidate_source = int(spec.is_candidate_source)
    if attn.compressor is not None and not _compressor(attn, L, keep, watch):
        return None
    if attn.indexer is not None and not _indexer(attn, L, keep, watch):
        return None
    return L if _moe(moe, L, D, keep, watch) else None


def _compressor(attn: Attention, L: _Layer, keep: list, watch: list) -> bool:
    """The compressor's fields (the weights ``_install_compress`` packed); False when it is not installed."""
    packed = attn.__dict__.get("_fast_compress")
    c, ix = attn._modules["compressor"], attn._modules.get("indexer")
    if "compress" not in attn.__dict__ or packed is None or c.ratio not in (1, 2):
        return False
    wkv, wgate, norm, eps, wk, k_norm, k_eps = packed
    if wkv.dtype != (torch.bfloat16 if L.bf16 else torch.float32):
        return False
    L.compress, L.di = 1, ix.head_dim
    L.c_wkv, L.c_wgate, L.c_norm, L.c_wk, L.c_knorm = (_addr(t, keep) for t in (wkv, wgate, norm, wk, k_norm))
    L.c_eps, L.c_keps = eps, k_eps
    watch += [c, ix]
    return True


def _indexer(attn: Attention, L: _Layer, keep: list, watch: list) -> bool:
    """The indexer's query fields (the weights ``_install_queries`` packed); False when they are not installed."""
    ix = attn._modules["indexer"]
    w = ix.__dict__.get("_fast_queries") if type(ix) is Indexer else None
    if (w is None or w[0].dtype != (torch.bfloat16 if L.bf16 else torch.float32) or ix.head_dim % 32
            or L.r > ix.head_dim):
        return False
    L.index, L.iH, L.idi, L.di = 1, ix.n_heads, ix.head_dim, ix.head_dim
    L.iq_wq_b, L.iq_wproj = _addr(w[0], keep), _addr(w[1], keep)
    L.iq_scale = ix.head_dim ** -0.5 * ix.n_heads ** -0.5
    L.index_topk, L.block, L.keep = attn.index_topk, attn.candidate_block_size, attn.candidate_topk_blocks
    watch.append(ix)
    return True


def _moe(moe: MoE, L: _Layer, D: int, keep: list, watch: list) -> bool:
    """The router's and experts' fields: every routed expert packed exactly (FP4 copies, else bf16), the shared
    expert fused; False otherwise (the module path then decides per step)."""
    gate, packed = moe._modules.get("gate"), moe.__dict__.get("_fast_moe")
    if (type(gate) is not Gate or "_fast_gate" not in gate.__dict__ or "forward" not in moe.__dict__
            or packed is None or not packed.shared_ok or packed.D != D):
        return False
    if packed.pending is not None:
        pack_copies(packed)
    if packed.fp4 is not None and packed.fp4_all:
        codes13, scales13, codes2, scales2 = packed.fp4
        L.moe_kind, L.E, L.inter = 2, codes2.shape[0], 2 * codes2.shape[2]
        L.w13, L.sc13, L.w2, L.sc2 = (_addr(t, keep) for t in packed.fp4)
        if D % 32 or L.inter % 32:
            return False
    elif packed.fp4 is None and packed.bf16 is not None and packed.bf16_all:
        w13, w2 = packed.bf16
        L.moe_kind, L.E, L.inter = 1, w2.shape[0], w2.shape[2]
        L.w13, L.w2 = _addr(w13, keep), _addr(w2, keep)
    else:
        return False
    if packed.shared is not None:
        L.s1, L.s3, L.s2 = (_addr(t, keep) for t in packed.shared)
        L.s_bf16, L.s_inter = int(packed.shared[0].dtype == torch.bfloat16), packed.shared[0].shape[0]
    L.limit = packed.limit
    weight, bias = gate.__dict__["_fast_gate"]
    if weight.shape[1] != D:
        return False
    L.gate_w, L.gate_bias = _addr(weight, keep), _addr(bias, keep)
    L.gate_bf16 = int(weight.dtype == torch.bfloat16)
    L.k_experts, L.norm_topk, L.route_scale = gate.topk, int(gate.norm_topk), gate.route_scale
    watch.append(gate)
    return True


@dataclass
class _Bound:
    """The plan bound to one KV cache: a copy of the plan's layers pointing at that cache's pools and pending pairs
    (``layers``), and :func:`run_decode`'s reusable state per row count (``work``: rows -> :class:`_Work`). Kept
    per cache, weakly (:attr:`DecodePlan.bound`), so engines sharing one model never write into each other's
    state, even from two threads (a C call runs without the GIL), and a dropped engine's cache is freed."""

    layers: ctypes.Array
    work: dict = field(default_factory=dict)


def _bind(plan: DecodePlan, cache) -> _Bound | None:
    """The plan bound to ``cache`` (made at its first step); None when the cache's layout is not the one the
    kernels read (then the module path runs)."""
    bound = plan.bound.get(cache)
    if bound is not None:
        return bound
    layers = (_Layer * len(plan.layers))(*plan.layers)  # (a copy: the fields are values and addresses)
    for L in layers:
        if not L.sparse:
            continue
        pools = cache.pools.get(L.kv_source)
        if pools is None or cache.ratio[L.kv_source] != L.src_ratio or not kernels.usable(*pools):
            return None
        if L.compress and L.ratio == 2:
            if L.layer not in cache.pending_layers:
                return None
            L.pending_index = cache.pending_layers.index(L.layer)
        L.pools = (_P * 4)(*(t.data_ptr() for t in pools))
        L.pool_pages, L.per_page = pools[0].shape[0], pools[0].shape[1]
    if not (cache.pending.dtype == torch.float32 and kernels.usable(cache.pending, cache.window_codes,
                                                                  cache.window_scales, cache.window_pos)):
        return None
    bound = plan.bound[cache] = _Bound(layers)
    return bound


def step_ok(streams: torch.Tensor, ctx, plan: DecodePlan) -> _Bound | None:
    """The plan bound to this step's cache when the step may run it: one new token per row (decode), streams of the
    plan's dtype, contiguous on the CPU, a :class:`~deepseek_v41.cache.paged_context.PagedContext` (its class marked
    ``PAGED``: that module imports this package) computing in fp32 (no image spans, no training state) whose
    positions the kernels take, a cache the plan can bind, and no hook on the plan's modules; else None."""
    if not (streams.dim() == 4 and streams.shape[1] == 1 and streams.dtype == plan.dtype
            and streams.shape[2] == plan.layers[0].hc and streams.shape[3] == plan.layers[0].D
            and type(ctx).__dict__.get("PAGED") is True and not plan.blocks[0].training):
        return None
    pos = ctx.positions
    if not (ctx.dtype == torch.float32 and ctx.key_limit is None and ctx.indexer_losses is None
            and not ctx.dense_indexer and ctx.fake_quant and pos.dtype == torch.int64 and pos.shape == streams.shape[:2]
            and ctx.tables.dtype == torch.int64 and kernels.usable(streams, pos, ctx.slots, ctx.tables, ctx.write_from)
            and not plan.hooked_any()):
        return None
    return _bind(plan, ctx.cache)


def run_decode(plan: DecodePlan, bound: _Bound, layers: range, streams: torch.Tensor, pre: torch.Tensor, ctx,
               skip_compress: set[int] | frozenset[int], taps: dict[int, torch.Tensor] | None = None,
               engram_rows: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Transformer.run_layers`` of a decode step the plan takes (:func:`step_ok` gave ``bound``, the plan bound
    to the step's cache): streams [B, 1, hc, D] and ``pre`` [B, 1, hc] through ``layers`` (consecutive, closed),
    one :func:`dsv41_decode_layers` call per ``kernels.FEW_ROWS`` rows and run of layers between Engram layers (each
    row's results are the same whichever rows share its call: every kernel computes a row with the same operations
    at any batch); an Engram layer's module runs in Python on the call's rows (``engram_rows[j]`` [B, 1, columns])
    before its block. ``taps``, when given, receives each layer's input streams [B, 1, hc, D] (copies the calls
    make, as the module loop hands its layer inputs). Returns the new streams and ``pre``, or None when a kernel
    declined (the caller then runs the module path; the pending pairs are as before the call). Raises MemoryError /
    IndexError as the kernels' wrappers do."""
    B, hc = streams.shape[0], streams.shape[2]
    pos, cache = ctx.positions, ctx.cache
    work = _work(plan, bound, ctx, min(B, kernels.FEW_ROWS))
    S = work.step
    S.table_len = ctx.tables.shape[1]
    if skip_compress:
        skip = torch.zeros(len(plan.layers), dtype=torch.int64)
        skip[[j for j in skip_compress if 0 <= j < len(plan.layers)]] = 1
        S.skip_compress = skip.data_ptr()
    else:
        S.skip_compress = work.no_skip.data_ptr()
    phases = []  # [B, 1 or 2, r] fp32 each (kept alive for the calls)
    odd = plan.ratio2 and any(end % 2 == 0 for end in ctx.ends)  # a row at an odd position completes a ratio-2 pair
    N = max(ctx.ends)  # past every position of the step; the widest candidate pool: N // ratio entries in blocks
    pairs = torch.cat((pos - 1, pos), 1) if odd else None  # the positions _pair_phases takes
    rows_at = (pos + 1).flatten()  # their rows in the phase tables
    pair_rows_at = (pairs + 1).flatten() if odd else None
    for i, rope in enumerate(plan.ropes):
        phases.append(_phases(plan, i, rope, pos, N, rows_at))
        phases.append(_phases(plan, i, rope, pairs, N, pair_rows_at) if odd else (None, None))
    if any(t is not None and not (t.dtype == torch.float32 and t.is_contiguous()) for p in phases for t in p):
        return None
    streams, pre = streams.contiguous(), upcast(pre).contiguous()
    buffers = (torch.empty_like(streams), torch.empty_like(streams))
    pre_out = torch.empty((B, 1, hc), dtype=torch.float32)
    width = max([-(-(N // L.src_ratio) // L.block) for L in plan.layers if L.is_candidate_source] or [1])
    if width > S.pool_width:  # (grows with the context)
        work.pool = torch.empty((len(plan.layers), work.rows, 2 * width), dtype=torch.bool)
        S.pool, S.pool_width = work.pool.data_ptr(), 2 * width
    tapped = None
    if taps is not None:
        tapped = torch.empty((len(plan.layers), *streams.shape), dtype=streams.dtype)
        S.taps_stride = tapped[0].numel() * tapped.element_size()
    else:
        S.taps = None
    runs = plan.runs(layers)
    counts, written = work.counts, None
    pending = cache.pending[ctx.slots] if work.rows < B and plan.ratio2 else None  # restored if a call declines
    lib, out = kernels.library(), 0
    for start in range(0, B, work.rows):  # (row addresses by arithmetic: no tensor is sliced for them)
        rows = slice(start, min(B, start + work.rows))
        S.B = rows.stop - start
        S.positions, S.slots, S.tables, S.write_from = (_row(t, start) for t in (pos, ctx.slots, ctx.tables,
                                                                                  ctx.write_from))
        S.streams[0], S.streams[1], S.pre_out = _row(buffers[0], start), _row(buffers[1], start), \
            _row(pre_out, start)
        for i in range(len(plan.ropes)):
            (cos, sin), (pair_cos, pair_sin) = phases[2 * i], phases[2 * i + 1]
            S.cos[i], S.sin[i] = _row(cos, start), _row(sin, start)
            if pair_cos is not None:
                S.pair_cos[i], S.pair_sin[i] = _row(pair_cos, start), _row(pair_sin, start)
        if tapped is not None:
            S.taps = _row(tapped[0], start)
        ctypes.memset(counts.data_ptr(), 0, counts.numel() * counts.element_size())
        x, p, at = streams, pre, start  # this call's rows: x from row `at` on, p from row `start` on
        for first, stop in runs:
            engram = plan.blocks[first].engram
            if engram is not None:
                x, at = engram(x[at:at + S.B], engram_rows[first][rows], None).contiguous(), 0
            S.streams_in, S.pre_in = _row(x, at), _row(p, start)
            status = lib.dsv41_decode_layers(bound.layers, first, stop, ctypes.byref(S))
            if status:
                if pending is not None:
                    cache.pending[ctx.slots] = pending
                if status == 1:
                    return None
                if status == -2:
                    raise MemoryError("decode_layers kernel: no memory for its scratch")
                if status == -1:
                    raise IndexError("an entry index lies past its block table")
                raise IndexError(f"an expert index lies outside [0, {plan.layers[S.failed_layer].E})")
            out = 0 if S.streams_out == S.streams[0] else 1
            x, p, at = buffers[out], pre_out, start
        counted = counts[2].tolist()
        written = counted if written is None else [a + b for a, b in zip(written, counted, strict=True)]
    if plan.compressing:  # (as add_entries counts them; a decode step never fills the context's decoded entries)
        for j, count in enumerate(written):
            if count:
                ctx.entries_written[j] = ctx.entries_written.get(j, 0) + count
    if tapped is not None:
        for j in layers:
            taps[j] = tapped[j]
    return buffers[out], pre_out


def _row(t: torch.Tensor, row: int) -> int:
    """The address of ``t[row]`` (``t[row:].data_ptr()`` without making the view)."""
    return t.data_ptr() + row * t.stride(0) * t.element_size()


PHASE_TABLE_BYTES = 8 << 20  # the most one RoPE table's phases by position (cos and sin) may take


def _phases(plan: DecodePlan, i: int, rope: RotaryEmbedding, pos: torch.Tensor, high: int,
            rows_at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope.phases(pos)``: (cos, sin) fp32 [B, T, r] at positions ``pos`` [B, T] (int64, in [-1, high)),
    read from a table of every position's phases that ``rope.phases`` computed once (``plan.phase_tables[i]``,
    grown by doubling while it takes at most PHASE_TABLE_BYTES; past that, ``rope.phases`` itself): two row gathers
    instead of the ~10 small torch ops of a call, the most costly Python of a decode step (issue 25). The same
    values bit for bit, as torch computes each element's cos / sin alone whatever the tensor's shape
    (tests/kernels/test_decode_plan.py checks the table against ``rope.phases``). ``rows_at``: ``(pos + 1).flatten()``
    when the caller has it."""
    table = plan.phase_tables.get(i)
    if table is None or table[0].shape[0] <= high:
        rows = max(2 * high, 1024) + 1  # positions -1 .. rows - 2
        if rows * rope.rope_dim * 8 > PHASE_TABLE_BYTES:
            return rope.phases(pos)
        cos, sin = rope.phases(torch.arange(-1, rows - 1, device=pos.device)[:, None])
        table = plan.phase_tables[i] = (cos[:, 0].contiguous(), sin[:, 0].contiguous())
    at = (pos + 1).flatten() if rows_at is None else rows_at
    shape = (*pos.shape, table[0].shape[1])
    return table[0].index_select(0, at).view(shape), table[1].index_select(0, at).view(shape)


@dataclass
class _Work:
    """What :func:`run_decode` reuses from step to step for calls of ``rows`` rows: the ``_Step`` (its cache fields
    set once), the picks, candidate pools and per-layer counts it points to, and a no-skip mask."""

    rows: int
    step: _Step
    topk: torch.Tensor
    pool: torch.Tensor
    counts: torch.Tensor
    no_skip: torch.Tensor


def _work(plan: DecodePlan, bound: _Bound, ctx, rows: int) -> _Work:
    work = bound.work.get(rows)
    if work is None:
        cache, n_layers = ctx.cache, len(plan.layers)
        S = _Step(R=cache.window_rows, ring_layers=cache.window_codes.shape[1], pending_layers=cache.pending.shape[1],
                  block_size=cache.block_size, lut_rows=kernels.INDEX_LUT_ROWS, topk_width=max(plan.index_topk, 1),
                  pool_width=1)
        S.ring_codes, S.ring_scales = cache.window_codes.data_ptr(), cache.window_scales.data_ptr()
        S.ring_pos, S.pending = cache.window_pos.data_ptr(), cache.pending.data_ptr()
        work = _Work(rows, S, torch.empty((n_layers, rows, S.topk_width), dtype=torch.int64),
                     torch.empty((n_layers, rows, 1), dtype=torch.bool), torch.zeros((3, n_layers), dtype=torch.int64),
                     torch.zeros(n_layers, dtype=torch.int64))
        S.topk, S.pool = work.topk.data_ptr(), work.pool.data_ptr()
        S.k, S.nblocks, S.written = (work.counts[i].data_ptr() for i in range(3))
        bound.work[rows] = work
    return work
