"""A worker rank of a parallel engine, and a headless node's launcher (issue 28).

``python -m deepseek_v41.distributed.worker --rank R --control HOST:PORT [--model PATH]`` (spawned by the driver's
:class:`~deepseek_v41.distributed.executor.MultiprocExecutor`, or by :func:`run_node` on another node; the control
key comes in ``DSV41_DIST_AUTHKEY``): connect to the driver, say ``hello``, receive ``init`` (model path, dtype,
engine arguments, the tokenizer, thread count), load its shard (``loaded``: only its slices of the checkpoint),
join the process group, build the rank's :class:`~deepseek_v41.engine.engine.LLMEngine` (``ready``), then follow
the driver step by step
(``driver.py`` describes the execution model): apply the step's events, check rank 0's digest of the previous
step's outputs against this rank's own (a mismatch is a ``RuntimeError``: the ranks diverged), step.

The worker exits 0 on ``shutdown`` or when the driver closes the connection; on any error it sends ``error`` with
the message (the driver fails naming this rank) and exits 1. It dies with its parent (``PR_SET_PDEATHSIG`` on
Linux) and ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the driver decides).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client
from typing import Any

import torch.distributed as dist
from tokenizers import Tokenizer

from deepseek_v41.distributed import protocol
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.distributed.rank import (
    AUTHKEY_ENV,
    PARENT_PID_ENV,
    START_TIMEOUT_S,
    authkey,
    describe_exit,
    engine_args_from_json,
    join,
    load_rank,
    rank_device,
    set_threads,
    spawn_worker,
    worker_threads,
)
from deepseek_v41.engine.engine import LLMEngine

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (``prctl(PR_SET_PDEATHSIG)``), and exit now if the
    parent is gone already; elsewhere nothing (EOF on the control connection ends the worker)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(1)


def connect(control: str, key: bytes, timeout_s: float = START_TIMEOUT_S):
    """A control connection to ``control`` (HOST:PORT), retried while the driver is not listening yet."""
    host, _, port = control.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client((host, int(port)), authkey=key)
        except (ConnectionRefusedError, ConnectionResetError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def apply_event(engine: LLMEngine, event: dict[str, Any], blobs: list[bytes]) -> None:
    """Replay one of rank 0's calls on this rank's engine (``blobs``: the step message's raw bytes)."""
    op = event["op"]
    if op == "add":
        images = {"multi_modal_data": {"image": protocol.images_from_entries(event["images"], blobs)}} \
            if event.get("images") else {}
        engine.add_request(event["request_id"], event["prompt_token_ids"], protocol.params_from_dict(event["params"]),
                           prompt=event["prompt"], arrival_time=event["arrival_time"], cache_salt=event["cache_salt"],
                           **images)
    elif op == "abort":
        engine.abort_request(event["request_id"])
        engine.release(event["request_id"])
    elif op == "reset_prefix_cache":
        engine.reset_prefix_cache(event["reset_running_requests"])
    else:
        raise ValueError(f"unknown event {op!r}")


def follow(conn, engine: LLMEngine, rank: int) -> bool:
    """Step with the driver until ``shutdown`` (returns True) or EOF: the driver went away without one (returns
    False). Raises RuntimeError when this rank's outputs differ from rank 0's."""
    digest = None
    while True:
        try:
            header, blobs = protocol.recv(conn)
        except (EOFError, OSError):
            return False  # the driver is gone
        kind = header["type"]
        if kind == "shutdown":
            return True
        if kind != "step":
            raise ValueError(f"unexpected control message {kind!r}")
        if header["digest"] is not None and header["digest"] != digest:
            raise RuntimeError(f"rank {rank} diverged from rank 0 at step {header['step'] - 1}: its outputs differ "
                               f"(digest {digest} vs rank 0's {header['digest']})")
        for event in header["events"]:
            apply_event(engine, event, blobs)
        engine.pending_observation = header["observation"]
        outputs = engine.step()
        digest = protocol.outputs_digest(outputs)
        for out in outputs:
            if out.finished:
                engine.release(out.request_id)


def driver_gone(conn) -> bool:
    """True when the driver closed the control connection or asked this worker to shut down."""
    try:
        if not conn.poll(0.5):
            return False
        header, _ = protocol.recv(conn)
    except (EOFError, OSError, ValueError):
        return True
    return header.get("type") == "shutdown"


def run_rank(conn, rank: int, model_override: str | None) -> bool:
    """Build this rank's engine from the driver's ``init`` and follow the driver; True when it ended with a
    ``shutdown``, False when the driver went away without one."""
    init, blobs = protocol.recv(conn)
    if init["type"] != "init":
        raise ValueError(f"expected 'init', got {init['type']!r}")
    set_threads(init["threads"])
    config = ParallelConfig(**init["parallel"])
    path = model_override or init["model"]
    device = rank_device(init["device"], rank, config)
    model, state = load_rank(path, config, rank, init["dtype"], device)
    protocol.send(conn, {"type": "loaded", "rank": rank})
    join(state, config, init["init_method"], device)
    tokenizer = Tokenizer.from_str(blobs[0].decode()) if blobs else None
    engine = LLMEngine(model, engine_args_from_json(init["engine_args"]), tokenizer, model_path=path)
    engine.lockstep_threads = init["threads"]
    if engine.prefix_cache is not None:
        engine.prefix_cache.make_read_only()
    protocol.send(conn, {"type": "ready", "rank": rank})
    return follow(conn, engine, rank)


def main(argv: list[str] | None = None) -> int:
    """The worker process (see the module docstring); returns its exit status."""
    parser = argparse.ArgumentParser(prog="python -m deepseek_v41.distributed.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--control", required=True, help="the driver's control listener, HOST:PORT")
    parser.add_argument("--model", default=None, help="this node's path of the model (default: the driver's)")
    args = parser.parse_args(argv)
    die_with_parent()
    if threading.current_thread() is threading.main_thread():  # (a Ray actor may run this on another thread)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {args.rank} %(name)s: %(message)s")
    conn = connect(args.control, os.environ[AUTHKEY_ENV].encode())
    protocol.send(conn, {"type": "hello", "rank": args.rank, "pid": os.getpid(), "host": socket.gethostname()})
    try:
        if run_rank(conn, args.rank, args.model):
            return 0
        log.error("the engine's rank 0 (%s) went away without shutting down this rank", args.control)
        return 1
    except BaseException as exc:
        if driver_gone(conn):  # the driver shut down under a step (its collectives then fail here): not an error
            return 0
        traceback.print_exc()
        with contextlib.suppress(OSError):
            protocol.send(conn, {"type": "error", "rank": args.rank, "message": f"{type(exc).__name__}: {exc}"})
        return 1
    finally:
        conn.close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_node(config: ParallelConfig, model: str | None = None) -> int:
    """A headless node (``--headless``, node_rank > 0): start this node's ranks as workers connecting to node 0's
    control port (``master_port + 1``) and wait for them; returns 0 when they all ended cleanly, else the first
    failure's status (the others are stopped). Ctrl-C / SIGTERM stop them too."""
    config.validate()
    local = config.local_world_size
    first = config.node_rank * local
    key = authkey(config)
    control = f"{config.master_addr}:{config.master_port + 1}"
    procs = {rank: spawn_worker(rank, control, key, worker_threads(config), model)
             for rank in range(first, first + local)}
    signal.signal(signal.SIGTERM, _interrupt)
    status = 0
    try:
        while procs:
            for rank, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[rank]
                if code != 0:
                    log.error("worker rank %d (pid %d) %s", rank, proc.pid, describe_exit(code))
                    status = status or 1
                    return status
            time.sleep(0.2)
        return status
    except KeyboardInterrupt:
        return 130
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
