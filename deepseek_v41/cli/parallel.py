"""The parallel flags ``dsv41 serve`` and ``dsv41 generate`` share (vLLM's names; issue 28).

``--tensor-parallel-size N``, ``--enable-expert-parallel``, ``--expert-parallel-size N`` (SGLang's ``--ep-size``),
``--distributed-executor-backend uni|mp|ray``, multi-node ``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port``, ``--headless`` (a worker node: runs its ranks, serves nothing) and
``--distributed-timeout-s``. Checked once by :meth:`~deepseek_v41.distributed.config.ParallelConfig.validate`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NoReturn

import typer

from deepseek_v41.distributed.config import EXECUTOR_BACKENDS, ParallelConfig
from deepseek_v41.distributed.worker import run_node

# ParallelConfig's field names, written as their flags in the CLI's messages.
FIELDS = ("tensor_parallel_size", "enable_expert_parallel", "expert_parallel_size", "data_parallel_size",
          "distributed_executor_backend",
          "nnodes", "node_rank", "master_addr", "master_port", "distributed_timeout_s", "shard_engram")


def tensor_parallel_size_option() -> Any:
    return typer.Option(1, "--tensor-parallel-size", "-tp", help="Ranks splitting attention heads, dense / expert "
                        "intermediate dims and the vocabulary (worker processes; needs the mp backend).")


def enable_expert_parallel_option() -> Any:
    return typer.Option(False, "--enable-expert-parallel", help="Split the routed experts whole over the "
                        "tensor-parallel ranks (all-to-all dispatch) instead of slicing each.")


def expert_parallel_size_option() -> Any:
    return typer.Option(None, "--expert-parallel-size", help="Experts over this many ranks, attention replicated "
                        "(SGLang's ep-size; tensor parallel size 1).")


def backend_option() -> Any:
    return typer.Option(None, "--distributed-executor-backend", help=f"{' | '.join(EXECUTOR_BACKENDS)} (default: "
                        "uni for one rank, mp for several).")


def nnodes_option() -> Any:
    return typer.Option(1, "--nnodes", help="Nodes the ranks are spread over (mp backend).")


def node_rank_option() -> Any:
    return typer.Option(0, "--node-rank", help="This node's index; node 0 runs the engine's rank 0 and serves.")


def master_addr_option() -> Any:
    return typer.Option("127.0.0.1", "--master-addr", help="Node 0's address (the collectives' store and the "
                        "workers' control connections).")


def master_port_option() -> Any:
    return typer.Option(0, "--master-port", help="Node 0's port P for the collectives' store (P + 1: control); 0 "
                        "picks free ports (one node only).")


def headless_option() -> Any:
    return typer.Option(False, "--headless", help="A worker node (node rank > 0): run this node's ranks, serve "
                        "nothing.")


def timeout_option() -> Any:
    return typer.Option(60.0, "--distributed-timeout-s", help="Seconds a collective may wait for a rank before "
                        "the engine fails naming it.")


def shard_engram_option() -> Any:
    return typer.Option(True, "--shard-engram/--no-shard-engram", help="Split the Engram tables by rows over the "
                        "tensor-parallel ranks (default), or keep them whole on every rank.")


def data_parallel_size_option() -> Any:
    return typer.Option(1, "--data-parallel-size", "-dp", help="Engine replicas behind this server, each with its "
                        "own KV pool, sharing --cache-dir (one rank each).")


def parallel_config(fail: Any, tensor_parallel_size: int, enable_expert_parallel: bool,
                    expert_parallel_size: int | None, backend: str | None, nnodes: int, node_rank: int,
                    master_addr: str, master_port: int, headless: bool, timeout_s: float,
                    shard_engram: bool = True, data_parallel_size: int = 1) -> ParallelConfig:
    """The flags as a validated :class:`ParallelConfig`; ``fail(message)`` (exit 2) for a bad combination, and for
    data parallelism over several ranks per replica (one process holds one torch.distributed world: not yet)."""
    config = ParallelConfig(tensor_parallel_size, enable_expert_parallel, expert_parallel_size, data_parallel_size,
                            backend, nnodes, node_rank, master_addr, master_port, headless, timeout_s, shard_engram)
    try:
        config.validate()
        if config.data_parallel_size > 1 and config.world_size > 1:
            raise ValueError(f"data_parallel_size {config.data_parallel_size} with {config.world_size} ranks per "
                             "replica is not served yet (one process holds one torch.distributed world); give "
                             "data_parallel_size 1 or one rank per replica")
        return config
    except ValueError as exc:
        fail(re.sub(r"(?<![\w-])(" + "|".join(FIELDS) + r")(?!\w)", lambda m: "--" + m[1].replace("_", "-"),
                    str(exc)))
    raise AssertionError("fail() returned")


def llm_kwargs(config: ParallelConfig) -> dict[str, Any]:
    """``LLM(...)``'s keyword arguments of ``config`` for one engine replica (``data_parallel_size`` is the
    server's: each replica is an ``LLM`` of its own)."""
    return {name: getattr(config, name) for name in FIELDS if name != "data_parallel_size"}


def run_headless(config: ParallelConfig, model: Path) -> NoReturn:
    """Run this worker node's ranks until the engine ends (``--headless``); exits with their status (2 for a
    setting refused before any rank starts, e.g. no ``DSV41_DIST_AUTHKEY``)."""
    try:
        status = run_node(config, str(model))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(status)
