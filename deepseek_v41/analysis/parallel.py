"""How many ranks a model needs: per-rank weight bytes, KV bytes per token and the bytes a decode step moves between
ranks, computed from the sharded modules built on ``meta`` (issue 28; ``dsv41 report --tensor-parallel-size``).

:func:`parallel_plan` builds the model on ``meta`` with the weights as the loader holds them (``dtype`` for the
dense weights, fp32 where the checkpoint keeps fp32, FP8 Engram tables with their UE8M0 scales), shards it for
rank 0 with :func:`~deepseek_v41.distributed.shard.shard_model` exactly as a served rank is sharded, reads its
weight bytes with :func:`~deepseek_v41.distributed.shard.shard_bytes`, and runs one decode step (a forward of one
new token per sequence) on ``meta``: the collectives of a ``meta`` :class:`~deepseek_v41.distributed.comm.
ParallelState` count the bytes they would move without moving any, so the communication figure is the code's own
(the same counters ``bench/parallel.py`` reads on a real run). Expert parallelism routes data-dependently; on
``meta`` the all-to-all counts a balanced split of the routed pairs (each rank owns ``1 / ep`` of the experts).

The KV cache is replicated: the window KV, compressed entries and index keys are one latent shared by all heads,
computed on every rank (PARALLEL_DESIGN.md), so a rank holds ``global_bytes_per_token`` per token and the whole
window per sequence, whatever the parallel sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from deepseek_v41.analysis.params import build_on_meta
from deepseek_v41.cache.layout import KVLayout
from deepseek_v41.config import ModelConfig
from deepseek_v41.distributed.comm import ParallelState
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.distributed.shard import check_shardable, shard_bytes, shard_model
from deepseek_v41.model.checkpoint import keeps_fp32, weight_files
from deepseek_v41.model.engram import EngramTable

GiB = 1024**3
# Device memories the plan answers "how many tokens of KV fit beside the weights" for (bytes): 80 GiB (H100 /
# A100-80G), 141 GB (H200), 192 GB (B200).
DEVICE_MEMORIES = {"80 GiB": 80 * GiB, "141 GB": 141 * 10**9, "192 GB": 192 * 10**9}


def meta_model_as_loaded(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                         model_path: str | Path | None = None) -> nn.Module:
    """The model on ``meta`` with the dtypes :func:`~deepseek_v41.model.checkpoint.load_model` gives: ``dtype``,
    fp32 for the names the checkpoint keeps in fp32 (mHC, sinks, router biases), and Engram tables as the
    checkpoint stores them: FP8 (E4M3 values + UE8M0 scales per 32 columns, MODEL_REFERENCE.md §5, the official
    format and the default without ``model_path``) or, for a checkpoint directory storing a table unquantized, that
    table's stored dtype (the loader keeps it)."""
    model = build_on_meta(cfg)
    for name, p in model.named_parameters():
        if not keeps_fp32(name):
            p.data = p.data.to(dtype)
    files = weight_files(Path(model_path)) if model_path is not None else {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, EngramTable) or module.table_format != "float":
            continue
        weight = f"{name}.weight"
        if weight in files and f"{name}.scale" not in files:  # stored unquantized: kept in its stored dtype
            with safe_open(files[weight], framework="pt") as f:
                stored = _SAFETENSORS_DTYPES[f.get_slice(weight).get_dtype()]
            module.weight.data = module.weight.data.to(stored)
            continue
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, EngramTable(module.num_rows, module.head_dim, "fp8",
                                                                   device="meta"))
    return model


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def parallel_plan(cfg: ModelConfig, config: ParallelConfig, dtype: torch.dtype = torch.bfloat16,
                  batches: tuple[int, ...] = (1, 8), model_path: str | Path | None = None) -> dict[str, Any]:
    """The plan of serving ``cfg`` under ``config`` with ``dtype`` weights (all units bytes), as a JSON-ready dict:

    - ``weights_per_rank``: rank 0's weight bytes by part (``attention``, ``experts``, ``shared``, ``embed``,
      ``head``, ``engram``, ``other``, ``total``) and ``weights_one_process`` the same unsharded;
    - ``kv_bytes_per_token_per_rank`` (global KV, replicated), ``window_bytes_per_sequence_per_rank``;
    - ``decode_step_comm``: per decode batch size, the bytes rank 0 hands to each collective kind in one decode
      step (``all_reduce``, ``all_gather``, ``all_to_all``, ``total``) and the number of calls;
    - ``kv_tokens_fit``: per device memory in :data:`DEVICE_MEMORIES`, the tokens of global KV that fit on a rank
      beside its weights (0 when the weights alone do not fit).

    The Engram tables are split by rows or kept whole as ``config.shard_engram`` says; ``model_path``: a checkpoint
    directory whose Engram table formats the plan takes (:func:`meta_model_as_loaded`).
    Raises ValueError for a config that does not validate or sizes that do not divide (naming them)."""
    config.validate()
    check_shardable(cfg, config.tensor_parallel_size, config.ep_size)
    model = meta_model_as_loaded(cfg, dtype, model_path)
    whole = shard_bytes(model)
    state = ParallelState.of(config, 0)  # no group: on meta the collectives count and move nothing
    shard_engram = config.shard_engram
    shard_model(model, state, shard_engram=shard_engram)
    weights = shard_bytes(model)
    comm = {}
    for batch in batches:
        state.reset_counts()
        with torch.no_grad():
            model(torch.zeros(batch, 1, dtype=torch.long, device="meta"))
        kinds = {kind: int(state.comm_bytes.get(kind, 0)) for kind in ("all_reduce", "all_gather", "all_to_all")}
        comm[batch] = {**kinds, "total": sum(kinds.values()),
                       "calls": {kind: int(n) for kind, n in state.comm_calls.items()}}
    layout = KVLayout.from_config(cfg)
    kv_per_token = float(layout.global_bytes_per_token)
    fit = {name: max(0, int((memory - weights["total"]) // kv_per_token)) for name, memory in DEVICE_MEMORIES.items()}
    return {
        "tensor_parallel_size": config.tensor_parallel_size,
        "expert_parallel_size": config.ep_size,
        "world_size": config.world_size,
        "dtype": str(dtype).removeprefix("torch."),
        "shard_engram": shard_engram,
        "weights_one_process": whole,
        "weights_per_rank": weights,
        "kv_bytes_per_token_per_rank": kv_per_token,
        "window_bytes_per_sequence_per_rank": int(layout.window_bytes_per_sequence),
        "decode_step_comm": comm,
        "kv_tokens_fit": fit,
    }


def print_plan(plan: dict[str, Any]) -> None:
    """The plan as tables on stdout (``dsv41 report --tensor-parallel-size N``)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    title = (f"Per rank: tensor parallel {plan['tensor_parallel_size']}, expert parallel "
             f"{plan['expert_parallel_size']} ({plan['world_size']} ranks, {plan['dtype']} weights"
             f"{', Engram split by rows' if plan['shard_engram'] else ', Engram tables on every rank'})")
    table = Table(title=title)
    table.add_column("weights")
    table.add_column("one process", justify="right")
    table.add_column("per rank", justify="right")
    for part, value in plan["weights_per_rank"].items():
        table.add_row(part, f"{plan['weights_one_process'][part] / GiB:,.3f} GiB", f"{value / GiB:,.3f} GiB")
    console.print(table)
    console.print(f"KV per token per rank: {plan['kv_bytes_per_token_per_rank']:,.1f} B (global KV, replicated on "
                  f"every rank); window per sequence per rank: {plan['window_bytes_per_sequence_per_rank']:,} B")
    comm = Table(title="Bytes a decode step moves between ranks (rank 0's payload; calls in parentheses)")
    for column in ("decode batch", "all-reduce", "all-gather", "all-to-all", "total"):
        comm.add_column(column, justify="right")
    for batch, row in plan["decode_step_comm"].items():
        cells = [f"{row[kind]:,} ({row['calls'].get(kind, 0)})" for kind in ("all_reduce", "all_gather", "all_to_all")]
        comm.add_row(str(batch), *cells, f"{row['total']:,}")
    console.print(comm)
    for name, tokens in plan["kv_tokens_fit"].items():
        console.print(f"On {name} per rank: {tokens:,} tokens of KV fit beside the weights"
                      + ("" if tokens else " (the weights alone do not fit: more ranks)"))
