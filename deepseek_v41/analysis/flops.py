"""FLOPs per token, counted while the real engine step runs on PyTorch's ``meta`` device (SPEC.md §1.5).

``torch.utils.flop_counter.FlopCounterMode`` counts the matmuls of the real modules (the engine's decode step
over a paged cache of the given context, or a prefill), per module. Each module's own matmuls are weighted by
the number format the release runs them in, as the paper does (BF16 1, FP8 0.5, FP4 0.25):

- FP8 (0.5): the dense weights stored FP8 — attention ``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``, shared
  experts, indexer ``wq_b``, Engram ``wkv``;
- FP4 (0.25): routed experts, and the indexer's scoring (FP4 queries against FP4 keys);
- BF16 (1): everything else — embedding / head, compressors, the indexer's key and weight projections, router,
  mHC mixing, and the attention core over the dequantized window rows and compressed entries (the reference's
  ``sparse_attn`` kernel computes in BF16).

Reindex layers score only their candidate pool (the model does), so their cost stops growing once the pool is
full; what still grows with context is the candidate source's full scoring and the dequantization-free parts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch.utils.flop_counter import FlopCounterMode

from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.engine.model_runner import ModelRunner, PrefillMode
from deepseek_v41.model.attention import Attention
from deepseek_v41.progress import ProgressCallback

# An expert's matmuls are named by the expert (Expert.forward calls F.linear on w1 / w3 / w2) or, when hooks are
# installed (FlopCounterMode installs global ones, so experts then call their projections), by w1 / w2 / w3.
_FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|shared_experts(\.w[123])?|indexer\.wq_b|engram\.wkv)$")
_FP4 = re.compile(r"(\.ffn\.experts\.\d+(\.w[123])?|\.indexer\.score)$")
WEIGHTS = {"bf16": 1.0, "fp8": 0.5, "fp4": 0.25}


def format_of(module_name: str) -> str:
    """The number format a module's own matmuls run in (module docstring)."""
    if _FP8.search(module_name):
        return "fp8"
    if _FP4.search(module_name):
        return "fp4"
    return "bf16"


@dataclass
class FlopCount:
    """Matmul FLOPs of one run: ``total`` (unweighted), ``weighted`` and ``by_format`` (unweighted per format)."""

    total: int
    weighted: float
    by_format: dict[str, int]


def _count(counter: FlopCounterMode) -> FlopCount:
    """Split the counter's per-module (inclusive) FLOPs into each module's own, by format.

    The counter names modules by class path (``Block.attn.wq_a``: the 40 blocks add up under one name) and only
    modules whose ``forward`` ran; a module's own FLOPs are its count minus those of the modules nested in it.
    FLOPs outside any module (the LM head in ``Transformer.logits``) are BF16.
    """
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    total = counts.pop("Global", 0)

    def parent(name: str) -> str | None:
        cut = name.rfind(".")
        while cut > 0:
            if name[:cut] in counts:
                return name[:cut]
            cut = name.rfind(".", 0, cut)
        return None

    own = dict(counts)
    for name, flops in counts.items():
        up = parent(name)
        if up is not None:
            own[up] -= flops
    by_format = dict.fromkeys(WEIGHTS, 0)
    for name, flops in own.items():
        by_format[format_of(name)] += flops
    by_format["bf16"] += total - sum(by_format.values())
    return FlopCount(total, sum(WEIGHTS[f] * n for f, n in by_format.items()), by_format)


def _meta_runner(model, tokens: int, block_size: int, mode: str):
    """A model runner over ``model`` (built on meta) and a one-sequence paged cache of ``tokens`` positions."""
    pages = -(-tokens // block_size)
    cache = PagedKVCache(model.config, pages + 1, block_size, 1, 16, "meta")
    for module in model.modules():
        if isinstance(module, Attention):
            module.query_chunk = max(module.query_chunk, tokens)  # meta holds no memory: one chunk, fewer ops
    return ModelRunner(model, cache, PrefillMode(mode)), pages


class _MetaSequence:
    """The bits of :class:`~deepseek_v41.engine.sequence.Sequence` the runner reads, for a sequence of
    ``num_tokens`` tokens whose ids do not matter (meta tensors hold no values)."""

    def __init__(self, num_tokens: int, num_computed: int, decoder_start: int, pages: int):
        self.slot, self.block_table = 0, list(range(1, pages + 1))
        self.num_tokens, self.num_computed, self.decoder_start = num_tokens, num_computed, decoder_start
        self.decoder_done = self.write_from = 0
        self.rebuild_engram_history = False
        self.mm_inputs = None  # text only

    def token_at(self, start: int, end: int) -> list[int]:
        return [0] * (end - start)

    def token_types(self, start: int, end: int) -> None:
        return None  # text only

    def images_in(self, start: int, end: int) -> list:
        return []


def decode_flops(model, context: int, block_size: int = 16) -> FlopCount:
    """FLOPs of one decode step of ``model`` (built on meta, :func:`~deepseek_v41.analysis.params.build_on_meta`)
    at batch 1 with ``context`` tokens already in the cache."""
    runner, pages = _meta_runner(model, context + 1, block_size, "exact")
    seq = _MetaSequence(context + 1, context, 0, pages)
    with FlopCounterMode(display=False) as counter:
        runner.decode([seq])
    return _count(counter)


def prefill_flops(model, prompt: int, mode: str, block_size: int = 16) -> FlopCount:
    """FLOPs of ``model`` (on meta) prefilling a ``prompt``-token prompt in one chunk, ``mode`` "exact" or "ced"."""
    runner, pages = _meta_runner(model, prompt, block_size, mode)
    seq = _MetaSequence(prompt, 0, model.plan.decoder_start(prompt), pages)
    with FlopCounterMode(display=False) as counter:
        runner.prefill(seq, 0, prompt)
    return _count(counter)


DECODE_CONTEXTS = {"4K": 4096, "16K": 16384, "64K": 65536, "256K": 262144, "1M": 1048576}


def flops_runs(model, contexts: dict[str, int] | None = None) -> list[str]:
    """The meta runs :func:`flops_section` makes, in order: one per decode context, then the prefill modes."""
    return ([f"decode at {label}" for label in contexts or DECODE_CONTEXTS]
            + ["prefill exact"] + (["prefill ced"] if model.plan.ced else []))


def flops_section(model, contexts: dict[str, int] | None = None, prefill_prompt: int = 65536,
                  progress: ProgressCallback | None = None) -> dict:
    """The ``flops`` block of ``dsv41 report`` for ``model`` built on meta: decode FLOPs per token by context
    (weighted and not, and by format), the weighted growth from the first to the last context, and prefill FLOPs
    per token (exact and CED) for a ``prefill_prompt``-token prompt. ``progress(done, total, what)`` is called
    before each meta run (:func:`flops_runs`, several seconds each for the flash config) and after the last."""
    contexts = contexts or DECODE_CONTEXTS
    runs = flops_runs(model, contexts)
    step = iter(range(len(runs) + 1))

    def report(what: str = "") -> None:
        done = next(step)
        if progress is not None:
            progress(done, len(runs), what)

    decode = {}
    for label, n in contexts.items():
        report(f"decode at {label}")
        decode[label] = decode_flops(model, n)
    first, last = list(contexts)[0], list(contexts)[-1]
    out = {
        "decode_per_token": {label: c.weighted for label, c in decode.items()},
        "decode_per_token_unweighted": {label: c.total for label, c in decode.items()},
        "decode_per_token_by_format": {label: c.by_format for label, c in decode.items()},
        f"decode_growth_{first.lower()}_to_{last.lower()}": decode[last].weighted / decode[first].weighted - 1,
        "prefill_prompt_tokens": prefill_prompt,
    }
    report("prefill exact")
    prefill = {"exact": prefill_flops(model, prefill_prompt, "exact")}
    if model.plan.ced:
        report("prefill ced")
        prefill["ced"] = prefill_flops(model, prefill_prompt, "ced")
    report()
    out["prefill_per_token"] = {mode: c.weighted / prefill_prompt for mode, c in prefill.items()}
    out["prefill_per_token_unweighted"] = {mode: c.total / prefill_prompt for mode, c in prefill.items()}
    return out
