"""Tensor and expert parallel sharding of the text model (issue 28): :func:`shard_model` and :func:`shard_bytes`.

The layout (PARALLEL_DESIGN.md; the reference's ``ParallelEmbedding`` / ``ColumnParallelLinear`` /
``RowParallelLinear`` split, MODEL_REFERENCE.md):

- Attention (tensor parallel): rank r keeps heads ``[r H/tp, (r+1) H/tp)``: those rows of ``wq_b`` (a plain
  ``Linear`` with fewer rows), of ``attn_sink``, and the output groups ``[r G/tp, (r+1) G/tp)`` of ``wo_a`` (the
  heads of a group are contiguous); ``wo_b`` becomes a :class:`~deepseek_v41.distributed.layers.RowParallelLinear`
  over those groups' columns (one all-reduce per layer). ``wq_a``, ``q_norm``, ``wkv``, ``kv_norm``, the compressor
  and the indexer stay whole on every rank: the window KV, the compressed entries and the index keys are one latent
  shared by all heads (K = V), so they cannot be split by head, and the indexer's top-k must be the same on every
  rank (splitting its heads would all-reduce a [T, entries] score matrix per layer). Every rank holds the whole KV
  cache.
- MoE, tensor parallel only: the gate whole, each routed expert and the shared expert sliced on the intermediate
  dim (:class:`~deepseek_v41.distributed.layers.TensorParallelMoE`, one all-reduce per layer).
- MoE with expert parallelism: rank r owns routed experts ``[r E/ep, (r+1) E/ep)`` whole, the shared expert whole
  (:class:`~deepseek_v41.distributed.layers.ExpertParallelMoE`: two all-to-alls and one all-gather per layer).
- Embedding and LM head: vocab-parallel rows ``[r V/tp, (r+1) V/tp)``; the DSpark draft, which is handed those
  weights, applies them through :class:`~deepseek_v41.distributed.layers.VocabParallelSharedVocab`.
- Whole on every rank: norms, mHC parameters, Engram tables (host-resident on every rank; ``shard_engram=True``
  splits them by rows over the tensor-parallel ranks instead) and the hasher, the vision tower and aligner, the
  draft's ``main_proj`` / ``main_norm`` / Markov and confidence heads.

The DSpark draft's blocks (``model.mtp``) are Blocks and shard like the target's. The model holds decoded weights
(the checkpoint's FP8 / FP4 tensors are decoded at load), so slices are plain tensor slices; a checkpoint whose
routed experts are FP4 (``quantization_config.expert_dtype == "fp4"``) also needs each rank's intermediate slice to
be whole 32-column blocks, so that its experts stay FP4 values in 1x32 blocks (the fast backend's packed copies).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from deepseek_v41.config import ModelConfig
from deepseek_v41.distributed.comm import ParallelState
from deepseek_v41.distributed.layers import (
    ParallelLMHead,
    RowParallelEngramTable,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelSharedVocab,
    expert_parallel_moe,
    tensor_parallel_moe,
)
from deepseek_v41.kernels import fast as fast_backend
from deepseek_v41.model.attention import Attention, GroupedLinear
from deepseek_v41.model.block import Block
from deepseek_v41.model.linear import Linear
from deepseek_v41.quant.weights import FP4_EXPERT_BLOCK

PARTS = ("attention", "experts", "shared", "embed", "head", "engram", "other")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_shardable(cfg: ModelConfig, tp: int, ep: int) -> None:
    """Raise ValueError listing every size of ``cfg`` that ``tensor_parallel_size`` ``tp`` / expert parallel size
    ``ep`` does not divide, with the sizes that would (issue 28)."""
    fp4 = cfg.quantization_config is not None and cfg.quantization_config.expert_dtype == "fp4"
    rules: list[tuple[str, int, int, str]] = []  # (what, size, step, parallel flag)
    if tp > 1:
        rules += [("num_attention_heads", cfg.num_attention_heads, 1, "tensor_parallel_size"),
                  ("o_groups", cfg.o_groups, 1, "tensor_parallel_size"),
                  ("vocab_size", cfg.vocab_size, 1, "tensor_parallel_size")]
        if ep == 1:
            step = FP4_EXPERT_BLOCK if fp4 else 1
            rules.append(("moe_intermediate_size" + (" (FP4 experts: in 32-column blocks)" if fp4 else ""),
                          cfg.moe_intermediate_size, step, "tensor_parallel_size"))
            if cfg.n_shared_experts:
                rules.append(("moe_intermediate_size * n_shared_experts (the shared expert)",
                              cfg.moe_intermediate_size * cfg.n_shared_experts, 1, "tensor_parallel_size"))
    if ep > 1:
        rules.append(("n_routed_experts", cfg.n_routed_experts, 1, "expert parallel size"))
        if cfg.num_nextn_predict_layers:
            rules.append(("dspark_n_routed_experts", cfg.dspark_n_routed_experts, 1, "expert parallel size"))
    problems, fits = [], {}
    for what, size, step, flag in rules:
        n = tp if flag == "tensor_parallel_size" else ep
        allowed = [d for d in _divisors(size) if (size // d) % step == 0]
        fits[flag] = set(allowed) if flag not in fits else fits[flag] & set(allowed)
        if size % (n * step):
            problems.append(f"{what} = {size} does not split over {flag} {n}; allowed {flag} values for it: "
                            f"{', '.join(map(str, allowed))}")
    if problems:
        every = "; ".join(f"{flag} values that fit every size: {', '.join(map(str, sorted(v)))}"
                          for flag, v in fits.items())
        raise ValueError("cannot shard this model: " + "; ".join(problems) + f" ({every})")


def _rows(t: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    """Part ``index`` of ``parts`` equal slices of ``t`` along ``dim``, as a tensor of its own (the full one can
    be freed)."""
    n = t.shape[dim] // parts
    return t.detach().narrow(dim, index * n, n).clone()


def _param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=like.requires_grad)


def _shard_attention(attn: Attention, state: ParallelState) -> None:
    tp, r = state.tp_size, state.tp_rank
    wq_b, wo_a, wo_b = attn.wq_b, attn.wo_a, attn.wo_b
    local = Linear(wq_b.in_features, wq_b.out_features // tp, bias=False, device="meta")
    local.weight = _param(_rows(wq_b.weight, 0, r, tp), wq_b.weight)
    attn.wq_b = local
    attn.attn_sink = _param(_rows(attn.attn_sink, 0, r, tp), attn.attn_sink)
    groups = wo_a.groups // tp
    grouped = GroupedLinear.__new__(GroupedLinear)
    nn.Module.__init__(grouped)
    grouped.groups, grouped.rank = groups, wo_a.rank
    grouped.weight = _param(_rows(wo_a.weight, 0, r, tp), wo_a.weight)
    attn.wo_a = grouped
    attn.wo_b = RowParallelLinear(_param(_rows(wo_b.weight, 1, r, tp), wo_b.weight), state)
    attn.n_heads //= tp
    attn.o_groups //= tp


def _blocks(model: nn.Module) -> list[Block]:
    blocks = list(model.layers)
    if getattr(model, "mtp", None) is not None:
        blocks += list(model.mtp)
    return blocks


def shard_model(model: nn.Module, state: ParallelState, shard_engram: bool = False) -> nn.Module:
    """Shard a :class:`~deepseek_v41.model.transformer.Transformer` (its DSpark draft included) in place for the
    rank of ``state`` (module docstring: the layout) and return it. Works on ``meta`` tensors (planning: no
    collective runs until a forward). A world of one rank returns the model unchanged. The CPU fast backend, if
    installed, is installed again on the sharded modules. Every rank must shard the same model alike (the same
    weights, the same ``state`` sizes).

    ``shard_engram``: split each Engram table by rows over the tensor-parallel ranks
    (:class:`~deepseek_v41.distributed.layers.RowParallelEngramTable`, one all-reduce of the looked-up rows per
    Engram layer) instead of keeping it whole on every rank (no effect without tensor parallelism).

    Raises ValueError when a size does not divide (heads, output groups, vocabulary, intermediate dims, experts),
    naming it and the parallel sizes that would fit, and for a model sharded already. Source: issue 28;
    PARALLEL_DESIGN.md.
    """
    tp, ep = state.tp_size, state.ep_size
    if tp == 1 and ep == 1:
        return model
    if getattr(model, "parallel_state", None) is not None:
        raise ValueError("this model is sharded already (model.parallel_state is set); shard an unsharded model")
    check_shardable(model.config, tp, ep)
    fast = model.__dict__.get("_fast_installed") is not None
    if fast:
        fast_backend.uninstall(model)
    for block in _blocks(model):
        if tp > 1:
            _shard_attention(block.attn, state)
        if ep > 1:
            block.ffn = expert_parallel_moe(block.ffn, state)
        elif tp > 1:
            block.ffn = tensor_parallel_moe(block.ffn, state)
    if tp > 1:
        V = model.config.vocab_size
        start = state.tp_rank * (V // tp)
        model.embed = VocabParallelEmbedding(_param(_rows(model.embed.weight, 0, state.tp_rank, tp),
                                                    model.embed.weight), start, state)
        model.head = ParallelLMHead(_param(_rows(model.head.weight, 0, state.tp_rank, tp), model.head.weight),
                                    start, state)
        if model.mtp is not None:
            model.mtp.vocab = VocabParallelSharedVocab(start, state)
        if shard_engram:
            for block in model.layers:
                if block.engram is not None:
                    block.engram.embed = RowParallelEngramTable(block.engram.embed, state)
    model.parallel_state = state
    if fast:
        fast_backend.install(model)
    return model


def _part(name: str) -> str:
    if name.startswith("embed."):
        return "embed"
    if name.startswith("head."):
        return "head"
    if ".engram." in name:
        return "engram"
    if ".ffn.experts." in name:
        return "experts"
    if ".ffn.shared_experts." in name:
        return "shared"
    if ".attn." in name:
        return "attention"
    return "other"


def shard_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of this rank's weights (every tensor of ``model.state_dict()``: parameters and persistent buffers
    such as FP8 Engram tables and their scales), by part: ``attention`` (the target's and the draft's), ``experts``
    (routed), ``shared`` (shared experts), ``embed``, ``head``, ``engram``, ``other`` (norms, mHC, gates, vision,
    draft heads), and ``total``. Works on ``meta`` models (the plan) and loaded shards alike. Source: issue 28."""
    out = Counter({part: 0 for part in PARTS})
    for name, t in model.state_dict(keep_vars=True).items():
        out[_part(name)] += t.numel() * t.element_size()
    out["total"] = sum(out[p] for p in PARTS)
    return dict(out)
