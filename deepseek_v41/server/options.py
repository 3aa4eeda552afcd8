"""The vLLM serve flags a script may pass, checked and turned into what they mean here.

``vllm serve`` scripts carry flags this server has no use for or serves differently; each one is either accepted
with its meaning here or refused with the reason (never silently ignored when it would change the result):

- ``--allowed-origins`` / ``--allowed-methods`` / ``--allowed-headers``: JSON lists (vLLM's form) or one bare
  value; CORS (FastAPI's ``CORSMiddleware``), vLLM's defaults ``["*"]``.
- ``--tool-call-parser``: only ``deepseek_v41`` (the official DSML format is always parsed).
- ``--kv-cache-dtype``: only ``auto``; the KV format (packed MXFP4 main KV, FP4 index keys, FP8 window) is fixed
  by the model.
- ``--chat-template``: refused; V4.1 prompts come from the official encoder, which no Jinja template reproduces.
- ``--gpu-memory-utilization``: the fraction of free device memory (RAM on CPU) the KV pool may take, turned
  into the engine's ``kv_cache_memory_bytes`` (:func:`kv_budget_bytes`).

Source: vLLM ``vllm/entrypoints/openai/cli_args.py``, ``vllm/engine/arg_utils.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from deepseek_v41.config import ModelConfig
from deepseek_v41.model.transformer import Transformer

TOOL_CALL_PARSERS = ("deepseek_v41",)
KV_CACHE_DTYPES = ("auto",)


def json_list(value: str, flag: str) -> list[str]:
    """``value`` as a list of strings: a JSON list (``'["http://a", "http://b"]'``, as vLLM) or one bare value
    (``http://a`` or ``*``). Raises ValueError naming ``flag`` for JSON that is not a list of strings."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return [value]
    if isinstance(parsed, str):
        return [parsed]
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise ValueError(f"{flag} takes a JSON list of strings such as '[\"*\"]' or one value, got {value!r}")
    return parsed


def check_tool_call_parser(name: str | None) -> str | None:
    """Why ``--tool-call-parser name`` is refused, or None when it is accepted (None or ``deepseek_v41``)."""
    if name is None or name in TOOL_CALL_PARSERS:
        return None
    return (f"--tool-call-parser {name!r} is not available: this server always parses the model's own DSML tool "
            f"calls; give {', '.join(TOOL_CALL_PARSERS)} or leave the flag out")


def check_kv_cache_dtype(dtype: str) -> str | None:
    """Why ``--kv-cache-dtype dtype`` is refused, or None for ``auto``."""
    if dtype in KV_CACHE_DTYPES:
        return None
    return (f"--kv-cache-dtype {dtype!r} is not available: the KV cache format is fixed by the model (packed MXFP4 "
            f"main KV, FP4 index keys, FP8 window KV; SPEC.md §4.1); give auto or leave the flag out")


def chat_template_refusal(template: str) -> str:
    """Why ``--chat-template`` is refused (always: see the module docstring)."""
    return (f"--chat-template {template!r}: DeepSeek-V4.1 has no Jinja chat template; prompts are rendered by the "
            f"official encoder (deepseek_v41.chat.encode_messages), which a template cannot reproduce (thinking, "
            f"DSML tools, reasoning effort). Leave the flag out; per-request options go in chat_template_kwargs")


def available_ram_bytes() -> int:
    """RAM available to new allocations (Linux ``MemAvailable``; else the free physical pages)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_memory_bytes(device) -> int:
    """Free memory of the torch ``device``: the GPU's free bytes for CUDA, available RAM for CPU and MPS
    (unified memory)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return available_ram_bytes()


def weight_bytes(model_dir: str | Path, dtype) -> int:
    """Bytes the weights of ``model_dir`` take once loaded with ``dtype`` (parameters and buffers of the model
    built on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_pretrained(model_dir))
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * (itemsize if t.is_floating_point() else t.element_size())
               for t in (*model.parameters(), *model.buffers()))


def kv_budget_bytes(fraction: float, free_bytes: int, weights: int) -> int:
    """The KV pool's byte budget for ``--gpu-memory-utilization fraction``: that fraction of the memory left free
    once the weights are loaded (``free_bytes`` measured before loading, minus ``weights``). Raises ValueError for
    a fraction outside (0, 1]."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
    return int(fraction * max(0, free_bytes - weights))
