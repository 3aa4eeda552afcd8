"""What one rank of a parallel engine needs to start, shared by the driver (rank 0, ``driver.py``), the executors
that spawn the others (``executor.py``) and the workers themselves (``worker.py``): its thread count, the control
connections' key, how a worker process is started and how its exit reads, its device, its shard of the checkpoint
and its place in the process group (issue 28).

A module of its own so that the worker imports neither the driver nor the executors (the Ray executor's actors run
the worker's ``main``): no import cycle.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from deepseek_v41.distributed.comm import ParallelState, init_distributed
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.distributed.loader import load_sharded
from deepseek_v41.engine.args import EngineArgs
from deepseek_v41.kernels import pool

START_TIMEOUT_S = 600.0  # the workers' hello / load / build, per phase (loading a large checkpoint is slow)
AUTHKEY_ENV = "DSV41_DIST_AUTHKEY"
PARENT_PID_ENV = "DSV41_PARENT_PID"  # a worker whose parent is not this pid any more exits at once


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def authkey(config: ParallelConfig) -> bytes:
    """The control connections' key: ``DSV41_DIST_AUTHKEY`` when set, else a random one (one node: handed to its
    workers in their environment). Raises ValueError for several nodes without ``DSV41_DIST_AUTHKEY`` (a key every
    node could work out alone, anyone reaching the port could too)."""
    given = os.environ.get(AUTHKEY_ENV)
    if given:
        return given.encode()
    if config.nnodes == 1:
        return secrets.token_hex(32).encode()
    raise ValueError(f"--nnodes {config.nnodes}: set {AUTHKEY_ENV} to the same secret on every node (it "
                     "authenticates the workers' control connections to node 0)")


def worker_threads(config: ParallelConfig) -> int:
    """Threads of every rank: the cores of this process divided by the ranks per node, at least 1 (the same count on
    every rank, so that the replicated computations are bitwise identical)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // config.local_world_size)


def describe_exit(returncode: int) -> str:
    """``"killed by SIGKILL"`` / ``"exited with code 1"`` for a ``Popen.returncode``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def spawn_worker(rank: int, control: str, key: bytes, threads: int, model: str | None = None) -> subprocess.Popen:
    """Start ``python -m deepseek_v41.distributed.worker`` for ``rank``, connecting to ``control`` (HOST:PORT) with
    ``key`` (passed in its environment, not on its command line); ``model``: a local path overriding the driver's
    (a headless node whose copy lives elsewhere)."""
    env = {**os.environ, AUTHKEY_ENV: key.decode(), PARENT_PID_ENV: str(os.getpid()), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "deepseek_v41.distributed.worker", "--rank", str(rank), "--control", control]
    if model is not None:
        cmd += ["--model", str(model)]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)



def set_threads(threads: int) -> None:
    """This rank's fixed thread count: torch's intra-op threads and the kernels' pool."""
    torch.set_num_threads(threads)
    pool.set_threads(threads)


def engine_args_from_json(data: dict[str, Any]) -> EngineArgs:
    """EngineArgs from their JSON form (a cost table's dict keys come back as strings)."""
    data = dict(data)
    table = data.get("speculative_cost_table")
    if isinstance(table, dict):
        data["speculative_cost_table"] = {int(k): v for k, v in table.items()}
    return EngineArgs(**data)


def check_engine_args(args: dict[str, Any]) -> None:
    """ValueError for settings a parallel engine does not serve yet (Redis: its asynchronous writes could reach
    the ranks' lookups at different steps)."""
    if args.get("redis_url"):
        raise ValueError("redis_url is not served with several ranks yet (rank 0 is the only cache writer and "
                         "Redis writes are asynchronous); use cache_dir")


def rank_device(device: str, rank: int, config: ParallelConfig) -> str:
    """The device of ``rank``: a bare ``"cuda"`` becomes ``"cuda:<local rank>"`` (one GPU per rank, as vLLM);
    anything else as given (CPU ranks share the host)."""
    return f"cuda:{rank % config.local_world_size}" if device == "cuda" else device


def load_rank(model_path: str | Path, config: ParallelConfig, rank: int, dtype: Any, device: str
              ) -> tuple[Any, ParallelState]:
    """Rank ``rank``'s shard of the checkpoint, reading only its slices of each tensor
    (:func:`~deepseek_v41.distributed.loader.load_sharded`), and its :class:`ParallelState`, which the sharded
    modules hold: its process group is set by :func:`join` (no collective runs before a forward). Raises what
    ``load_sharded`` raises (FileNotFoundError, ConfigError, ValueError, CheckpointError)."""
    state = ParallelState.of(config, rank)
    return load_sharded(model_path, state, dtype=dtype, device=device, shard_engram=config.shard_engram), state


def join(state: ParallelState, config: ParallelConfig, init_method: str | None, device: str) -> None:
    """Join the engine's process group as ``state.rank`` (gloo on CPU, NCCL on CUDA); ``state`` gets the group."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))  # NCCL binds each rank's communicator to its current GPU
    state.group = init_distributed(config, state.rank, init_method or "", device).group
