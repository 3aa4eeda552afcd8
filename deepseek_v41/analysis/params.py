"""Parameter counts from the real modules built on PyTorch's ``meta`` device (SPEC.md §1.5, MODEL_REFERENCE.md §6).

Groups: ``backbone`` (everything but the ones below: attention, compressors, indexers, MoE, mHC, norms,
embedding, head, Engram projections), ``engram`` (the Engram tables), ``dspark`` (``mtp.*``, which shares the
target's embedding and head), ``vision`` (ViT, aligner, image delimiters).

Active parameters per token: a layer contributes all its parameters except the routed experts, plus
``num_experts_per_tok`` routed experts and the Engram table rows it gathers. ``active_decode`` = every layer +
final norm + LM head. ``active_prefill`` (CED) = the encoder layers + the first decoder layer's KV projection
(attention norm, compressor, index-key projection), since a prefix token runs nothing else; without CED it is
every layer. The embedding lookup (one row) is not counted, as in the paper.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from deepseek_v41.config import ModelConfig
from deepseek_v41.model.checkpoint import keeps_fp32
from deepseek_v41.model.transformer import Transformer

_ENGRAM_TABLE = re.compile(r"(^|\.)engram\.embed\.(weight|scale)$")
_VISION = ("vision.", "aligner.", "image_")


def build_on_meta(cfg: ModelConfig) -> nn.Module:
    """The full model with every parameter on ``meta`` (no memory, no init cost beyond module creation)."""
    with torch.device("meta"):
        return Transformer(cfg)


def _numel(module: nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() for name, p in module.named_parameters() if not name.startswith(skip))


def group_of(name: str) -> str:
    """The accounting group of a parameter name."""
    if _ENGRAM_TABLE.search(name):
        return "engram"
    if name.startswith("mtp."):
        return "dspark"
    if name.startswith(_VISION):
        return "vision"
    return "backbone"


def count_params(model: nn.Module) -> dict[str, int]:
    """Parameter counts of ``model`` (on any device, ``meta`` included) by group and active per token."""
    counts = {"backbone": 0, "engram": 0, "dspark": 0, "vision": 0}
    for name, p in model.named_parameters():
        counts[group_of(name)] += p.numel()
    cfg, plan = model.config, model.plan
    per_layer = []
    for block in model.layers:
        dense = _numel(block, skip=("ffn.experts.", "engram.embed."))
        routed = cfg.num_experts_per_tok * _numel(block.ffn.experts[0])
        gathered = 0
        if block.engram is not None:
            gathered = block.engram.embed.head_dim * model.hasher.layout.n_cols
        per_layer.append(dense + routed + gathered)
    head = _numel(model.norm) + _numel(model.head)
    counts["active_decode"] = sum(per_layer) + head
    if plan.ced:
        first_decoder = model.layers[plan.decoder_layers[0]]
        attn = first_decoder.attn
        kv_projection = (_numel(first_decoder.attn_norm) + _numel(attn.compressor)
                         + _numel(attn.indexer.wk) + _numel(attn.indexer.k_norm))
        counts["active_prefill"] = sum(per_layer[j] for j in plan.encoder_layers) + kv_projection
    else:
        counts["active_prefill"] = sum(per_layer)
    counts["total"] = sum(counts[g] for g in ("backbone", "engram", "dspark", "vision"))
    return counts


def loaded_bytes(model: nn.Module, dtype_bytes: int = 2) -> int:
    """Bytes the model takes once loaded: every parameter at ``dtype_bytes`` except the fp32 ones (mHC, sinks,
    router biases) at 4, and Engram tables kept FP8 (1 byte per value + 1 UE8M0 byte per 32)."""
    total = 0
    for name, p in model.named_parameters():
        if _ENGRAM_TABLE.search(name):
            total += p.numel() + p.numel() // 32
        else:
            total += p.numel() * (4 if keeps_fp32(name) else dtype_bytes)
    return total
