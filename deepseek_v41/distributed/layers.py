"""The parallel layers a sharded text model runs (issue 28; the layout is :mod:`deepseek_v41.distributed.shard`'s).

Each is a subclass of the model class it stands in for, holding only its rank's part of the weights and calling the
collectives of :class:`~deepseek_v41.distributed.comm.ParallelState`; the fast backend installs only on exact classes
(``kernels.fast.registry.plain``), so a parallel layer is always called as a module:

- :class:`VocabParallelEmbedding` (rows ``[r V/tp, (r+1) V/tp)`` of ``embed``; ids outside give 0; one all-reduce),
  :class:`ParallelLMHead` (the same rows of ``head``; logits all-gathered on the vocabulary dim, so every rank holds
  the same full logits), :class:`VocabParallelSharedVocab` (the DSpark draft's use of those two weights);
- :class:`RowParallelEngramTable` (optional: an Engram table's rows split over the ranks; one all-reduce);
- :class:`RowParallelLinear` (``wo_b``: the input columns of the rank's output groups; one all-reduce);
- :class:`TensorParallelMoE` (every routed expert and the shared expert sliced on the intermediate dim; every rank
  routes all tokens; one all-reduce of the summed output);
- :class:`ExpertParallelMoE` (whole experts ``[r E/ep, (r+1) E/ep)`` per rank; rank r routes token chunk r, sends
  (row, expert) pairs to the owners with all-to-all, combines what comes back, adds the shared expert, and an
  all-gather rebuilds all rows on every rank).

Sums over ranks run in the reference's accumulation dtype (fp32, float64 for a float64 model) before the cast to the
activation dtype, so a float64 sharded model equals one process to rounding (tests/distributed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_v41.distributed.comm import ParallelState
from deepseek_v41.model.dspark import SharedVocab
from deepseek_v41.model.engram import EngramTable
from deepseek_v41.model.linear import Linear, LMHead
from deepseek_v41.model.moe import Expert, MoE, expert_segments
from deepseek_v41.model.norm import cast, upcast


def split_sizes(n: int, parts: int) -> list[int]:
    """The lengths of ``torch.tensor_split`` of n items into ``parts`` chunks (the first ``n % parts`` one longer)."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def _vocab_rows(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local row of each id, clamped to 0 outside; mask of the ids outside ``[start, start + rows)``)."""
    local = ids - start
    outside = (local < 0) | (local >= rows)
    return local.masked_fill(outside, 0), outside


def _embed_shard(ids: torch.Tensor, weight: torch.Tensor, start: int, state: ParallelState) -> torch.Tensor:
    local, outside = _vocab_rows(ids, start, weight.shape[0])
    h = F.embedding(local, weight).masked_fill(outside[..., None], 0)
    return state.all_reduce(h)


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[vocab_start, vocab_start + num_embeddings)`` of the token embedding (``weight`` [V/tp, D]):
    ids [...] long -> [..., D] in the weight's dtype, equal to the full embedding's rows on every rank (each id's
    row comes from its owner, the others add 0: an exact sum). Source: MODEL_REFERENCE.md §3.1; issue 28."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, state: ParallelState):
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=not weight.requires_grad,
                         device=weight.device, dtype=weight.dtype)
        self.vocab_start, self.state = vocab_start, state

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _embed_shard(ids, self.weight, self.vocab_start, self.state)


class ParallelLMHead(LMHead):
    """Rows ``[vocab_start, vocab_start + V/tp)`` of the LM head (``weight`` [V/tp, D]): x [..., D] fp32 (float64
    stays) -> logits [..., V] in x's dtype, the rank's columns computed here and all-gathered, so every rank holds
    the same full logits. Source: MODEL_REFERENCE.md §3.15; issue 28."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, state: ParallelState):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.vocab_start, self.state = vocab_start, state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.state.all_gather(LMHead.forward(self, x), dim=-1)


class VocabParallelSharedVocab(SharedVocab):
    """The DSpark draft's use of the target's vocab-parallel embedding and head: it is handed their local rows
    (``model.embed.weight``, ``model.head.weight`` [V/tp, D]) and gives what :class:`SharedVocab` gives for the full
    weights (embedding rows all-reduced, base logits all-gathered)."""

    def __init__(self, vocab_start: int, state: ParallelState):
        self.vocab_start, self.state = vocab_start, state

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _embed_shard(ids, weight, self.vocab_start, self.state)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.state.all_gather(SharedVocab.logits(self, x, weight), dim=-1)


class RowParallelEngramTable(EngramTable):
    """Rows ``[row_start, row_start + num_rows)`` of one Engram table (the table split by rows over the tensor-
    parallel ranks, :func:`split_sizes`: the release's row counts are primes' sums, not multiples of tp), float or
    FP8 as the whole table was: row ids [...] long (global) -> [..., head_dim] (the stored dtype, fp32 for FP8),
    each row from its owner, the others adding 0 (one all-reduce, exact). ``global_rows``: the whole table's rows.
    Source: ENGRAM.md §8; issue 28 (Engram tables sharded by rows)."""

    def __init__(self, table: EngramTable, state: ParallelState):
        nn.Module.__init__(self)
        sizes = split_sizes(table.num_rows, state.tp_size)
        self.row_start = sum(sizes[:state.tp_rank])
        rows = slice(self.row_start, self.row_start + sizes[state.tp_rank])
        self.table_format, self.head_dim = table.table_format, table.head_dim
        self.num_rows, self.global_rows, self.state = sizes[state.tp_rank], table.num_rows, state
        if table.scale is None:
            self.weight = nn.Parameter(table.weight.detach()[rows].clone(), requires_grad=table.weight.requires_grad)
            self.scale = None
        else:
            self.register_buffer("weight", table.weight[rows].clone())
            self.register_buffer("scale", table.scale[rows].clone())

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        local, outside = _vocab_rows(rows, self.row_start, self.num_rows)
        return self.state.all_reduce(EngramTable.forward(self, local).masked_fill(outside[..., None], 0))

    def extra_repr(self) -> str:
        return f"rows {self.row_start}..{self.row_start + self.num_rows} of {self.global_rows}, {self.head_dim}, " \
               f"table_format={self.table_format!r}"


class RowParallelLinear(Linear):
    """A bias-free projection whose input columns are split over the tensor-parallel ranks (``weight`` [out,
    in/tp], the columns of the rank's input slice): x [..., in/tp] -> [..., out] in x's dtype, the partial
    products summed over the ranks (one all-reduce). ``wo_b`` of a tensor-parallel attention (MODEL_REFERENCE.md
    §3.7; issue 28)."""

    def __init__(self, weight: torch.Tensor, state: ParallelState):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.state.all_reduce(F.linear(x, self.weight))


class TensorParallelMoE(MoE):
    """:class:`~deepseek_v41.model.moe.MoE` with every routed expert and the shared expert holding the rank's
    slice of the intermediate dim (``w1`` / ``w3`` rows, ``w2`` columns; built by
    :func:`deepseek_v41.distributed.shard.shard_model`). The gate is whole: every rank routes every token alike; the
    routed and shared partial outputs are summed in fp32 (float64 stays) and all-reduced once, then cast to x's
    dtype. x [B, T, D] (+ image_mask [B, T]) -> [B, T, D]. Source: MODEL_REFERENCE.md §3.14; issue 28."""

    state: ParallelState

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        indices, weights = self.gate(flat, None if image_mask is None else image_mask.reshape(-1))
        out = self.dispatch(flat, indices, weights)
        if self.shared_experts is not None:
            out = out + cast(self.shared_experts(flat), out.dtype)
        return cast(self.state.all_reduce(out), flat.dtype).reshape(x.shape)


class ExpertParallelMoE(MoE):
    """:class:`~deepseek_v41.model.moe.MoE` whose rank owns the routed experts ``[expert_start, expert_start +
    len(experts))`` whole (``experts[i]`` is global expert ``expert_start + i``) and the whole shared expert.

    The input x [B, T, D] is the same on every rank; rank r takes row chunk r of the N = B*T rows
    (:func:`split_sizes`), routes it (the whole gate), sends each (row, expert) pair to the expert's owner with one
    all-to-all (the row's bytes and the local expert id), runs its experts on what it received, returns the outputs
    with a second all-to-all, adds them weighted in ascending expert id (the reference's order), adds the shared
    expert, and all-gathers the chunks: [B, T, D] in x's dtype, identical on every rank. A rank whose chunk is
    empty still joins every collective. Source: MODEL_REFERENCE.md §3.14; issue 28 (vLLM / SGLang's expert
    parallelism with replicated attention input).
    """

    state: ParallelState
    expert_start: int

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        sizes = split_sizes(flat.shape[0], self.state.ep_size)
        start = sum(sizes[:self.state.ep_rank])
        rows = slice(start, start + sizes[self.state.ep_rank])
        chunk = flat[rows]
        mask = None if image_mask is None else image_mask.reshape(-1)[rows]
        if chunk.shape[0]:
            indices, weights = self.gate(chunk, mask)
        else:  # (a decode batch smaller than ep) no routing to do; the fast kernels take no empty input
            k = self.gate.topk
            indices = torch.empty((0, k), dtype=torch.long, device=flat.device)
            weights = torch.empty((0, k), dtype=upcast(chunk).dtype, device=flat.device)
        out = self.dispatch(chunk, indices, weights)
        if self.shared_experts is not None and chunk.shape[0]:
            out = out + cast(self.shared_experts(chunk), out.dtype)
        return self.state.all_gather(cast(out, flat.dtype), dim=0, sizes=sizes).reshape(x.shape)

    def dispatch(self, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_k w_k E_{idx_k}(x) of this rank's rows flat [N, D] with global expert ``indices`` / ``weights`` [N, k]
        -> [N, D] in the weights' dtype, the experts run by their owners (two all-to-alls)."""
        state, per_rank = self.state, len(self.experts)
        k, D = indices.shape[-1], flat.shape[-1]
        flat_idx = indices.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)  # by expert id: grouped by owner, each owner's in id order
        token_of = order // k
        slot_weight = weights.reshape(-1)[order]
        expert = flat_idx[order]
        owner = torch.div(expert, per_rank, rounding_mode="floor")
        if flat.device.type == "meta":  # routing unknown: a balanced split (what a plan assumes)
            send_counts = split_sizes(flat_idx.numel(), state.ep_size)
        else:
            send_counts = torch.bincount(owner, minlength=state.ep_size).tolist()
        payload = _pack(flat[token_of], expert - owner * per_rank)
        received, recv_counts = state.all_to_all(payload, send_counts)
        rows, local = _unpack(received, D, flat.dtype)
        back, _ = state.all_to_all(_bytes(self.run_experts(rows, local)), recv_counts)
        y = back.view(flat.dtype).reshape(-1, D)
        out = torch.zeros(flat.shape, dtype=slot_weight.dtype, device=flat.device)
        return out.index_add_(0, token_of, cast(y, out.dtype) * slot_weight[:, None])

    def run_experts(self, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows [M, D] sent to it (``local`` [M] long: the local expert id of each):
        [M, D] in the rows' dtype, in the order received."""
        order = torch.argsort(local, stable=True)
        out = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(expert_segments(local, len(self.experts))):
            if count:
                at = order[start:start + count]
                out[at] = self.experts[e](rows[at])
                start += count
        return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Rows [M, ...] (at least 2-D) of any dtype as uint8 [M, bytes per row] (packed tensors travel as bytes)."""
    return t.contiguous().flatten(1).view(torch.uint8)


def _pack(rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """One all-to-all payload: each row's bytes then its local expert id's 8 bytes: uint8 [M, D * size + 8]."""
    return torch.cat((_bytes(rows), _bytes(local.to(torch.int64)[:, None])), 1)


def _unpack(payload: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    width = dim * torch.empty((), dtype=dtype).element_size()
    rows = payload[:, :width].contiguous().view(dtype)
    return rows, payload[:, width:].contiguous().view(torch.int64)[:, 0]


def _expert_slice(expert: Expert, rows: slice) -> Expert:
    """A new :class:`Expert` holding intermediate rows ``rows`` of ``expert`` (w1 / w3 rows, w2 columns)."""
    w1, w3, w2 = expert.w1.weight, expert.w3.weight, expert.w2.weight
    with torch.device("meta"):  # (built empty; the slices are assigned)
        out = Expert(w1.shape[1], rows.stop - rows.start, expert.swiglu_limit)
    for name, w in (("w1", w1[rows]), ("w3", w3[rows]), ("w2", w2[:, rows])):
        getattr(out, name).weight = nn.Parameter(w.detach().clone(), requires_grad=w1.requires_grad)
    return out


def _moe_shell(cls: type[MoE], moe: MoE, state: ParallelState) -> MoE:
    """An empty ``cls`` instance carrying ``moe``'s settings and gate (experts set by the caller)."""
    out = cls.__new__(cls)
    nn.Module.__init__(out)
    out.n_experts, out.inter_dim, out.swiglu_limit = moe.n_experts, moe.inter_dim, moe.swiglu_limit
    out.gate = moe.gate
    out.state = state
    out.training = moe.training
    return out


def tensor_parallel_moe(moe: MoE, state: ParallelState) -> TensorParallelMoE:
    """``moe`` as a :class:`TensorParallelMoE` holding the rank's intermediate slice of every expert (the sizes
    are checked by the caller)."""
    tp, r = state.tp_size, state.tp_rank
    out = _moe_shell(TensorParallelMoE, moe, state)
    inter = moe.inter_dim // tp
    out.experts = nn.ModuleList(_expert_slice(e, slice(r * inter, (r + 1) * inter)) for e in moe.experts)
    shared = moe.shared_experts
    if shared is not None:
        width = shared.w1.weight.shape[0] // tp
        shared = _expert_slice(shared, slice(r * width, (r + 1) * width))
    out.shared_experts = shared
    out.inter_dim = inter
    return out


def expert_parallel_moe(moe: MoE, state: ParallelState) -> ExpertParallelMoE:
    """``moe`` as an :class:`ExpertParallelMoE` owning the rank's whole experts and the whole shared expert."""
    per_rank = moe.n_experts // state.ep_size
    out = _moe_shell(ExpertParallelMoE, moe, state)
    out.expert_start = state.ep_rank * per_rank
    out.experts = nn.ModuleList(moe.experts[out.expert_start + i] for i in range(per_rank))
    out.shared_experts = moe.shared_experts
    return out
