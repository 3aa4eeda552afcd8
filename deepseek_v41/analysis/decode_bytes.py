"""Bytes one decode step reads from memory, from a loaded model in the formats the engine reads (issue 25).

A decode step at batch B is bound by memory: every dense weight is read once per step whatever B is, the routed
experts only for the experts the step's tokens pick, and each sequence's KV. Divided by the host's copy
bandwidth this gives the floor a step cannot go below (``bench/engine.py`` prints it beside the measured time).
"""

from __future__ import annotations

from deepseek_v41 import kernels
from deepseek_v41.cache.layout import KVLayout
from deepseek_v41.kernels.fast.moe import pack_copies
from deepseek_v41.model.moe import MoE


def expected_distinct_experts(n_experts: int, k: int, batch: int) -> float:
    """Expected number of distinct experts among ``batch`` tokens that each pick ``k`` of ``n_experts`` (uniform,
    independent tokens): ``E * (1 - (1 - k / E) ** B)``; exactly ``k`` for one token."""
    return n_experts * (1 - (1 - k / n_experts) ** batch)


def _expert_bytes(moe: MoE, batch: int) -> tuple[float, str]:
    """Bytes of one routed expert of ``moe`` in the format a ``batch``-token decode step reads, and its name: the
    fast backend's packed FP4 copy (codes + UE8M0 scales) or bf16 copy when it holds every expert and the step
    takes the few-token kernel, else the experts' parameters. The copies are made now if no decode step made them
    yet (:func:`~deepseek_v41.kernels.fast.moe.pack_copies`)."""
    experts = list(moe.experts)
    packed = moe.__dict__.get("_fast_moe")
    if packed is not None and batch <= kernels.FEW_ROWS:
        pack_copies(packed)
        if packed.fp4 is not None and packed.fp4_all:
            return sum(t.nbytes for t in packed.fp4) / len(experts), "packed FP4"
        if packed.bf16 is not None and packed.bf16_all:
            return sum(t.nbytes for t in packed.bf16) / len(experts), "bf16 copy"
    return sum(p.nbytes for p in experts[0].parameters()), str(next(experts[0].parameters()).dtype)


def decode_step_bytes(model, batch: int, context: int) -> dict[str, float]:
    """Bytes read by one decode step of ``batch`` sequences at ``context`` tokens each, by part (a dict; "total"
    is their sum). ``model``: a loaded :class:`~deepseek_v41.model.transformer.Transformer`, after the engine
    installed its fast paths (:func:`deepseek_v41.kernels.fast.install`) when it did.

    - ``dense``: every parameter but the routed experts, the embedding and the LM head (attention projections,
      compressors, indexers, norms, mHC, shared experts, routers), at their loaded dtype, read once per step;
    - ``lm_head``: the head (and final norm), once per step;
    - ``embedding``: one row per sequence;
    - ``routed_experts``: per MoE layer, the expected number of distinct experts the step touches
      (:func:`expected_distinct_experts`: exactly k at batch 1) times one expert's bytes in the format the engine
      reads (``_expert_bytes``: packed FP4 codes + scales on the fast backend's few-token kernel);
    - ``kv``: per sequence, every compressed entry of every kv-source layer (main entry + index key, packed FP4,
      :class:`~deepseek_v41.cache.layout.KVLayout`) — an upper bound, the sparse attention reads the main entries
      of its top-k only — plus ``min(context, sliding_window)`` FP8 window rows per layer. Entries several layers
      share are counted once.

    Buffers (RoPE frequencies, router statistics) and activations are not counted. DSpark draft layers
    (``mtp.*``) are not counted: a plain decode step does not run them. Raises ValueError for ``batch`` or
    ``context`` below 1, and for a model with Engram tables (their gathered rows are not counted here).
    """
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be at least 1, got batch={batch}, context={context}")
    cfg = model.config
    if cfg.engram_layer_ids:
        raise ValueError("decode_step_bytes does not count Engram table reads; use a config without Engram layers")
    parts = {"dense": 0.0, "lm_head": 0.0, "embedding": 0.0, "routed_experts": 0.0, "kv": 0.0}
    for name, p in model.named_parameters():
        if ".experts." in name or name.startswith("mtp."):
            continue
        if name.startswith("embed."):
            parts["embedding"] += batch * p.nbytes / p.shape[0]
        elif name.startswith(("head.", "norm.")):
            parts["lm_head"] += p.nbytes
        else:
            parts["dense"] += p.nbytes
    for block in model.layers:
        moe = block.ffn
        if isinstance(moe, MoE):
            one, _ = _expert_bytes(moe, batch)
            parts["routed_experts"] += expected_distinct_experts(len(moe.experts), moe.gate.topk, batch) * one
    layout = KVLayout.from_config(cfg)
    window = min(context, cfg.sliding_window) * layout.window_row_bytes * cfg.num_hidden_layers
    parts["kv"] = batch * (layout.global_bytes_per_token * context + window)
    parts["total"] = sum(parts.values())
    return parts


def expert_format(model, batch: int) -> str:
    """The format :func:`decode_step_bytes` counted the routed experts in ("packed FP4", "bf16 copy" or the
    parameters' dtype), from the first MoE layer; "none" without one."""
    moe = next((b.ffn for b in model.layers if isinstance(b.ffn, MoE)), None)
    return "none" if moe is None else _expert_bytes(moe, batch)[1]
