"""vLLM's engine options that have one meaning here, checked once for ``LLM(...)`` and ``dsv41 serve`` alike.

- ``pipeline_parallel_size``: only 1 (tensor / expert parallelism: :mod:`deepseek_v41.distributed.config`).
- ``kv_cache_dtype``: only ``auto``; the KV format (packed MXFP4 main KV, FP4 index keys, FP8 window) is fixed by
  the model (SPEC.md §4.1).
- ``gpu_memory_utilization``: the fraction of the memory left free once the weights are loaded (device memory;
  RAM on CPU and MPS) that the KV pool may take, turned into the engine's ``kv_cache_memory_bytes``
  (:func:`kv_budget_bytes`). The budget is an upper bound: the pool never holds more than ``max_num_seqs``
  sequences of ``max_model_len`` tokens (:func:`pool_description`).
- ``trust_remote_code``: accepted; no code from the model directory is ever run.

Each check takes the name the caller's user wrote (``kv_cache_dtype`` for ``LLM``, ``--kv-cache-dtype`` for the
command line) so its message names it. Source: vLLM ``vllm/engine/arg_utils.py``, ``vllm/config/cache.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from deepseek_v41.config import ModelConfig
from deepseek_v41.model.transformer import Transformer

KV_CACHE_DTYPES = ("auto",)


def check_parallel_size(option: str, size: int) -> str | None:
    """Why ``option`` (``pipeline_parallel_size`` / ``--pipeline-parallel-size``) ``= size`` is refused, or None for
    1. Tensor and expert parallelism are checked by :meth:`~deepseek_v41.distributed.config.ParallelConfig.validate`.
    """
    if size == 1:
        return None
    return f"{option} {size}: no pipeline parallelism (split the model with tensor / expert parallelism); give 1"


def check_kv_cache_dtype(dtype: str, option: str = "kv_cache_dtype") -> str | None:
    """Why ``option`` ``dtype`` is refused, or None for ``auto``."""
    if dtype in KV_CACHE_DTYPES:
        return None
    return (f"{option} {dtype!r} is not available: the KV cache format is fixed by the model (packed MXFP4 main "
            f"KV, FP4 index keys, FP8 window KV; SPEC.md §4.1); give auto or leave it out")


def available_ram_bytes() -> int:
    """RAM available to new allocations (Linux ``MemAvailable``; else the free physical pages)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_memory_bytes(device: Any) -> int:
    """Free memory of the torch ``device``: the GPU's free bytes for CUDA, available RAM for CPU and MPS
    (unified memory)."""

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return available_ram_bytes()


def weight_bytes(model_dir: str | Path, dtype: Any) -> int:
    """Bytes the weights of ``model_dir`` take once loaded with the torch ``dtype`` (parameters and buffers of the
    model built on the meta device: nothing is allocated). Raises FileNotFoundError / ConfigError for a missing or
    bad ``config.json``."""


    with torch.device("meta"):
        model = Transformer(ModelConfig.from_pretrained(model_dir))
    return module_bytes(model, torch.empty((), dtype=dtype).element_size())


def module_bytes(model: Any, float_itemsize: int | None = None) -> int:
    """Bytes of ``model``'s parameters and buffers; floating tensors counted at ``float_itemsize`` bytes per element
    when given (the dtype they will be loaded in), else at their own."""
    return sum(t.numel() * (float_itemsize if float_itemsize and t.is_floating_point() else t.element_size())
               for t in (*model.parameters(), *model.buffers()))


def kv_budget_bytes(fraction: float, free_bytes: int, weights: int,
                    option: str = "gpu_memory_utilization") -> int:
    """The KV pool's byte budget for ``option`` ``fraction``: that fraction of the memory left free once the weights
    are loaded (``free_bytes`` measured before loading, minus ``weights``). Raises ValueError naming ``option`` for
    a fraction outside (0, 1]."""
    if not 0 < fraction <= 1:
        raise ValueError(f"{option} must be in (0, 1], got {fraction}")
    return int(fraction * max(0, free_bytes - weights))


def pool_description(engine: Any, with_cap: bool = False) -> str:
    """The KV pool ``engine`` (an ``LLMEngine``) allocated, for a log line: its pages and bytes; ``with_cap`` adds
    that it never holds more than ``max_num_seqs`` sequences of ``max_model_len`` tokens whatever the memory
    budget (the budget is an upper bound, as vLLM's)."""
    stats, args = engine.stats, engine.args
    size = stats["kv_global_bytes"]
    size_text = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
    text = f"{stats['kv_pages_total']} KV pages = {size_text}"
    if not with_cap:
        return text
    cap = args.max_num_seqs * -(-engine.max_model_len // args.block_size)
    return (f"{text} (the pool holds at most max_num_seqs {args.max_num_seqs} x max_model_len "
            f"{engine.max_model_len} tokens = {cap} pages; raise max_num_seqs to use more of the budget)")
