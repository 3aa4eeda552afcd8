"""Fused CPU kernels: the decode step's chains of small tensor ops as single C calls (bench/README.md).

At decode size (a few tokens) nearly all of a step's time is dispatch: ~3,800 tensor ops of a few µs each.
The C library of ``csrc/`` does the worst chains in one call each: the FP8 window ring (read, quantize, write), FP4
entries written to and read from pages through the block tables, FP4 / FP8 quantization, RoPE, RMSNorm, the mHC
mixing (coefficients with Sinkhorn, collapse, expand), the few-query attention, the MoE router and experts (routed
experts read in the checkpoint's FP4 format, or bf16), the indexer's queries, scores and top-k, the candidate
pool's blocks and a Reindex layer's picks inside them, the attention's projections, its compressed entries and
index keys, and a GEMV for the projections of a few tokens. It is
plain C (with the GCC / Clang vector extension for its accumulators), one file per concept beside one header,
compiled by the system C compiler on first use (about a second) into a cache folder and called through
:mod:`ctypes`; no torch headers, nothing to install (:mod:`~deepseek_v41.kernels.loader`).

The memory-bound kernels split their work over the library's own thread pool (:mod:`~deepseek_v41.kernels.pool`,
:func:`set_threads`); results do not depend on the thread count.

Callers use a kernel only where :func:`usable` says so (CPU, contiguous, no autograd) and keep their torch code
as the fallback, which runs everywhere else (CUDA, ``meta``, training, float64) and wherever the library cannot
be built: no compiler, or ``DSV41_CPU_KERNELS=0``. The quantization kernels, RoPE, the top-k, the candidate
pool's blocks and the argmax give the torch code's results exactly; the others add in another order (and, for
bf16 tensors, compute in fp32 without the bf16 roundings between the steps they fuse), so they agree to rounding
and run only under ``torch.inference_mode`` (``tests/kernels`` checks both); a Reindex layer's picks are the
torch code's up to its scores' rounding.

One module per file of ``csrc/``, each holding its kernels' ctypes signatures (``SIGNATURES``, handed to
:func:`~deepseek_v41.kernels.loader.register`) beside their wrappers: :mod:`~deepseek_v41.kernels.codecs` (FP8 /
FP4 blocks, paged FP4 entries), :mod:`~deepseek_v41.kernels.window` (the SWA window ring),
:mod:`~deepseek_v41.kernels.rope_norm`, :mod:`~deepseek_v41.kernels.hyper` (mHC),
:mod:`~deepseek_v41.kernels.gemv`, :mod:`~deepseek_v41.kernels.attention`, :mod:`~deepseek_v41.kernels.compressor`,
:mod:`~deepseek_v41.kernels.moe`, :mod:`~deepseek_v41.kernels.indexer`, :mod:`~deepseek_v41.kernels.topk`
(top-k, argmax, the candidate pool) and :mod:`~deepseek_v41.kernels.pool`; this package re-exports every wrapper.
Environment (``DSV41_CPU_KERNELS``, ``DSV41_KERNEL_CACHE``, ``CC``): :mod:`~deepseek_v41.kernels.loader`.
"""

from __future__ import annotations

from deepseek_v41.kernels.attention import (
    MAX_ATTEND_HEADS,
    attend_few,
    attn_epilogue,
    attn_prologue,
    band_logits,
    band_output,
)
from deepseek_v41.kernels.checks import FEW_ROWS, ROW_ON_STACK
from deepseek_v41.kernels.codecs import (
    FP4_FORMATS,
    WIDENS_TO_FP32,
    fp4_dequantize,
    fp4_gather,
    fp4_quantize,
    fp4_scatter,
    fp8_dequantize,
    fp8_quantize_values,
)
from deepseek_v41.kernels.compressor import compress
from deepseek_v41.kernels.gemv import GEMV_MACS, linear
from deepseek_v41.kernels.hyper import MAX_HC, hc_collapse, hc_expand, hc_mix
from deepseek_v41.kernels.indexer import INDEX_LUT_ROWS, index_scores, index_select, indexer_queries
from deepseek_v41.kernels.loader import CFLAGS, cache_dir, disabled, library, usable
from deepseek_v41.kernels.loader import _build as _build  # tests build and load the library themselves
from deepseek_v41.kernels.loader import _load as _load
from deepseek_v41.kernels.loader import _state as _state
from deepseek_v41.kernels.moe import SMALL_ROWS, gate, moe_bf16, moe_fp4, swiglu
from deepseek_v41.kernels.pool import pool_sleeps, prefetch, set_spin, set_threads, spin, threads
from deepseek_v41.kernels.rope_norm import rms_norm, rope
from deepseek_v41.kernels.topk import argmax, candidate_blocks, pool_select, topk_set
from deepseek_v41.kernels.window import window_step

__all__ = [
    "CFLAGS", "FEW_ROWS", "FP4_FORMATS", "GEMV_MACS", "INDEX_LUT_ROWS", "MAX_ATTEND_HEADS", "MAX_HC", "ROW_ON_STACK",
    "SMALL_ROWS", "WIDENS_TO_FP32", "argmax", "attend_few", "attn_epilogue", "attn_prologue", "band_logits",
    "band_output", "cache_dir", "candidate_blocks", "compress", "disabled", "fp4_dequantize", "fp4_gather",
    "fp4_quantize", "fp4_scatter", "fp8_dequantize", "fp8_quantize_values", "gate", "hc_collapse", "hc_expand",
    "hc_mix", "index_scores", "index_select", "indexer_queries", "library", "linear", "moe_bf16", "moe_fp4",
    "pool_select", "pool_sleeps", "prefetch", "rms_norm", "rope", "set_spin", "set_threads", "spin", "swiglu",
    "threads", "topk_set", "usable", "window_step",
]
