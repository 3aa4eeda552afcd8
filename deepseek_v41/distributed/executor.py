"""Executors: where an engine's ranks run, as vLLM names them (``distributed_executor_backend``; issue 28).

- :class:`UniExecutor` ("uni"): one process, no worker; every method does nothing.
- :class:`MultiprocExecutor` ("mp"): rank 0 is the calling process (the driver: ``LLM`` or ``dsv41 serve``); the
  other ranks of node 0 are worker processes it spawns (``python -m deepseek_v41.distributed.worker``); the ranks
  of other nodes are started there by ``dsv41 serve --headless`` and connect to node 0. Every worker holds one
  control connection to the driver (``multiprocessing.connection`` on TCP with an authentication key; only
  ``send_bytes`` / ``recv_bytes`` of :mod:`~deepseek_v41.distributed.protocol` messages, never pickle). The
  collectives run on torch.distributed (gloo on CPU, NCCL on CUDA) at ``init_method``.

Ports: ``master_port`` P (0 on one node: free ports are picked) is the torch.distributed store, P + 1 the control
listener. Authentication key: ``DSV41_DIST_AUTHKEY`` from the environment when set (give the same on every node);
otherwise a random key for a single node (handed to its workers in their environment), and on several nodes one
derived from the master address and port (keeps strays out, not attackers: set the variable on an untrusted
network).

Faults: a watchdog thread checks the spawned processes (exit code, signal) and every control connection (EOF, an
``error`` message) every ``WATCH_INTERVAL_S``; the first failure is kept as a ``RuntimeError`` naming the rank
("worker rank 1 (pid 123) died: killed by SIGKILL"), raised by :meth:`Executor.check` and handed to the
callbacks of :meth:`Executor.watch` (the async engine fails every request and the server exits). Workers die with
the driver (``PR_SET_PDEATHSIG`` on Linux; EOF on their control connection elsewhere and across nodes);
:meth:`Executor.shutdown` (also run when the executor is collected and at interpreter exit) asks them to exit,
waits ``SHUTDOWN_WAIT_S`` and kills what is left.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import queue
import subprocess
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from deepseek_v41.distributed import protocol
from deepseek_v41.distributed import worker as worker_main
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.distributed.rank import (
    AUTHKEY_ENV,
    START_TIMEOUT_S,
    authkey,
    describe_exit,
    free_port,
    spawn_worker,
    worker_threads,
)

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.1
SHUTDOWN_WAIT_S = 5.0
class Executor:
    """Where the ranks of one engine run (see the module docstring). The driver calls, in order: :meth:`start`
    (workers spawned or awaited, each sent ``init``), :meth:`wait` ("loaded", then "ready"), then per step
    :meth:`check` and :meth:`send_step`; :meth:`shutdown` at the end."""

    name = "uni"
    init_method: str | None = None

    def __init__(self, config: ParallelConfig):
        self.config = config.validate()
        self._failure: RuntimeError | None = None
        self._callbacks: list[Callable[[RuntimeError], None]] = []

    def start(self, init: dict[str, Any], blobs: tuple[bytes, ...] = ()) -> None:
        """Start the workers and send each the ``init`` message fields (model path, dtype, engine arguments) and
        ``blobs`` (the tokenizer's JSON)."""

    def wait(self, phase: str) -> None:
        """Wait until every worker reported ``phase`` ("loaded" or "ready"); RuntimeError naming a rank that
        failed or died meanwhile."""

    def start_watchdog(self) -> None:
        """Watch the workers from now on (a background thread)."""

    def send_step(self, data: bytes) -> None:
        """Send one step message to every worker; RuntimeError naming a rank that cannot be reached."""

    @property
    def failure(self) -> RuntimeError | None:
        """The first worker failure seen, or None."""
        return self._failure

    def check(self) -> None:
        """Raise the first worker failure seen, if any."""
        if self._failure is not None:
            raise self._failure

    def wait_failure(self, timeout_s: float) -> RuntimeError | None:
        """The failure, waiting up to ``timeout_s`` for the watchdog to see one (after a collective failed)."""
        return self._failure

    def watch(self, callback: Callable[[RuntimeError], None]) -> None:
        """Call ``callback(error)`` once, from the watchdog thread, when a worker fails (immediately if one has)."""
        self._callbacks.append(callback)
        if self._failure is not None:
            callback(self._failure)

    def describe_workers(self) -> str:
        """Each worker's state, for an error message (which one is stopped, gone or running)."""
        return "no worker processes"

    def fail(self, error: RuntimeError) -> None:
        """Record ``error`` as the engine's failure (the first one wins) and tell the :meth:`watch` callbacks."""
        if self._failure is not None:
            return
        self._failure = error
        log.error("%s", error)
        for callback in list(self._callbacks):
            try:
                callback(error)
            except Exception:  # a listener's bug must not hide the failure from the others
                log.exception("executor failure callback %r failed", callback)

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""


class UniExecutor(Executor):
    """One process (``distributed_executor_backend="uni"``): no worker, nothing to send."""


class _Worker:
    """The driver's view of one worker rank: its control connection, and its process when spawned here."""

    def __init__(self, rank: int, conn: Connection, pid: int, host: str, proc: subprocess.Popen | None):
        self.rank, self.conn, self.pid, self.host, self.proc = rank, conn, pid, host, proc

    def name(self) -> str:
        return f"worker rank {self.rank} (pid {self.pid}{'' if self.proc is not None else ', host ' + self.host})"

    def state(self) -> str:
        """What this worker's process is doing, from Linux's /proc (spawned here), e.g. "stopped (SIGSTOP?)"."""
        if self.proc is None:
            return "on another node"
        if self.proc.poll() is not None:
            return describe_exit(self.proc.returncode)
        try:
            code = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "running"
        return {"T": "stopped (SIGSTOP?)", "t": "stopped by a debugger", "D": "in uninterruptible I/O",
                "Z": "exited"}.get(code, "running")

    def dead(self) -> str | None:
        """Why this worker is gone, or None while it lives: its process's exit, an ``error`` message or EOF on its
        connection (consumes what it reads: call from one thread)."""
        if self.proc is not None and self.proc.poll() is not None:
            return f"{self.name()} died: {describe_exit(self.proc.returncode)}"
        try:
            if not self.conn.poll():
                return None
            header, _ = protocol.recv(self.conn)
        except (EOFError, OSError):
            if self.proc is not None:  # a dying process closes its socket first: report its exit when it has one
                try:
                    self.proc.wait(1.0)
                    return f"{self.name()} died: {describe_exit(self.proc.returncode)}"
                except subprocess.TimeoutExpired:
                    pass
            return f"{self.name()} closed its control connection (the process or its node is gone)"
        if header.get("type") == "error":
            return f"{self.name()} failed: {header.get('message')}"
        return f"{self.name()} sent an unexpected {header.get('type')!r} message"


class MultiprocExecutor(Executor):
    """Worker processes (``distributed_executor_backend="mp"``; see the module docstring). Raises RuntimeError
    naming the rank when a worker fails to start, load or build its engine."""

    name = "mp"

    def __init__(self, config: ParallelConfig):
        super().__init__(config)
        host = config.master_addr
        if config.master_port == 0:
            store_port, control_port = free_port(host), free_port(host)
        else:
            store_port, control_port = config.master_port, config.master_port + 1
        self.init_method = f"tcp://{host}:{store_port}"
        self.control = f"{host}:{control_port}"
        self._key = authkey(config)
        self._listener = Listener((host, control_port), authkey=self._key)
        self._workers: dict[int, _Worker] = {}
        self._procs: dict[int, subprocess.Popen] = {}
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, _shutdown, self._listener, self._workers, self._procs, self._stop)

    def start(self, init: dict[str, Any], blobs: tuple[bytes, ...] = ()) -> None:
        config = self.config
        threads = worker_threads(config)
        self._spawn(threads)
        arrived: queue.Queue = queue.Queue()
        accepter = threading.Thread(target=self._accept, args=(config.world_size - 1, arrived), daemon=True,
                                    name="dsv41-accept")
        accepter.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self._workers) < config.world_size - 1:
            self._check_spawned("starting")
            try:
                item = arrived.get(timeout=WATCH_INTERVAL_S)
            except queue.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, config.world_size)) - set(self._workers))
                    raise RuntimeError(f"worker ranks {missing} did not connect to {self.control} within "
                                       f"{START_TIMEOUT_S:.0f} s (other nodes: start them with --headless)") from None
                continue
            if isinstance(item, BaseException):
                raise RuntimeError(f"a worker's control connection failed: {item!r}") from item
            conn, hello = item
            rank = hello.get("rank")
            if not isinstance(rank, int) or not 0 < rank < config.world_size or rank in self._workers:
                conn.close()
                raise RuntimeError(f"a worker said it is rank {rank!r}; expected one of 1..{config.world_size - 1}, "
                                   "each once (are two engines sharing --master-port?)")
            self._workers[rank] = _Worker(rank, conn, int(hello.get("pid", 0)), str(hello.get("host", "?")),
                                          self._procs.get(rank))
            protocol.send(conn, {"type": "init", **init, "init_method": self.init_method, "threads": threads,
                                 "parallel": config.as_dict()}, blobs)

    def _spawn(self, threads: int) -> None:
        """Start this node's worker ranks (1 .. local_world_size - 1) as processes."""
        for rank in range(1, self.config.local_world_size):
            self._procs[rank] = spawn_worker(rank, self.control, self._key, threads)

    def _accept(self, count: int, arrived: queue.Queue) -> None:
        accepted = 0
        while accepted < count:
            try:
                conn = self._listener.accept()
                header, _ = protocol.recv(conn)
            except AuthenticationError:  # not one of ours (another engine's key, a port scan): keep listening
                log.warning("a connection to %s without this engine's key was refused (set the same %s on every "
                            "node)", self.control, AUTHKEY_ENV)
                continue
            except (OSError, EOFError, ValueError) as exc:  # the listener closed, or a bad peer
                if not self._stop.is_set():
                    arrived.put(exc)
                return
            arrived.put((conn, header))
            accepted += 1

    def _check_spawned(self, phase: str) -> None:
        for rank, proc in self._procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"worker rank {rank} (pid {proc.pid}) {describe_exit(proc.returncode)} while "
                                   f"{phase} (its error is printed above)")

    def wait(self, phase: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for worker in self._workers.values():
            while not worker.conn.poll(WATCH_INTERVAL_S):
                self._check_spawned(f"waiting for '{phase}'")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{worker.name()} did not report '{phase}' within {START_TIMEOUT_S:.0f} s")
            try:
                header, _ = protocol.recv(worker.conn)
            except (EOFError, OSError) as exc:
                raise RuntimeError(worker.dead() or f"{worker.name()} closed its control connection") from exc
            if header.get("type") == "error":
                raise RuntimeError(f"{worker.name()} failed: {header.get('message')}")
            if header.get("type") != phase:
                raise RuntimeError(f"{worker.name()} sent {header.get('type')!r}, expected {phase!r}")

    def start_watchdog(self) -> None:
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="dsv41-watchdog")
        self._watchdog.start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            for worker in list(self._workers.values()):
                why = worker.dead()
                if why is not None and not self._stop.is_set():
                    self.fail(RuntimeError(why))
                    return

    def send_step(self, data: bytes) -> None:
        for worker in self._workers.values():
            try:
                worker.conn.send_bytes(data)
            except OSError as exc:
                self.fail(RuntimeError(self.wait_failure(2.0) or f"{worker.name()} cannot be reached: {exc}"))
                raise self._failure from exc

    def wait_failure(self, timeout_s: float) -> RuntimeError | None:
        deadline = time.monotonic() + timeout_s
        while self._failure is None and self._watchdog is not None and self._watchdog.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(WATCH_INTERVAL_S / 2)
        return self._failure

    def describe_workers(self) -> str:
        return "; ".join(f"{w.name()}: {w.state()}" for w in self._workers.values())

    def shutdown(self) -> None:
        self._finalizer()


def _shutdown(listener: Listener, workers: dict[int, _Worker], procs: dict[int, subprocess.Popen],
              stop: threading.Event) -> None:
    """Ask every worker to exit, wait for the spawned ones up to ``SHUTDOWN_WAIT_S``, kill what is left."""
    stop.set()
    for worker in workers.values():
        with contextlib.suppress(OSError):
            protocol.send(worker.conn, {"type": "shutdown"})
    for worker in workers.values():
        worker.conn.close()
    with contextlib.suppress(OSError):
        listener.close()
    deadline = time.monotonic() + SHUTDOWN_WAIT_S
    for proc in procs.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RayWorker:
    """A worker rank as a Ray actor: runs :func:`deepseek_v41.distributed.worker.main` in the actor's process (the
    control protocol is the mp backend's; Ray only places and starts the process)."""

    def run(self, rank: int, control: str, key: str, threads: int) -> int:
        os.environ[AUTHKEY_ENV] = key
        os.environ["OMP_NUM_THREADS"] = str(threads)
        return worker_main.main(["--rank", str(rank), "--control", control])


class _RayState:
    """What a :class:`RayExecutor` started on Ray (held apart from the executor, for its finalizer)."""

    def __init__(self, ray: Any):
        self.ray, self.actors, self.runs, self.group, self.started = ray, [], {}, None, False


class RayExecutor(MultiprocExecutor):
    """Ray actors (``distributed_executor_backend="ray"``): the worker ranks are :class:`RayWorker` actors in one
    placement group of one CPU bundle each, on the Ray cluster of ``RAY_ADDRESS`` or a local one started here
    (stopped again at shutdown); everything else is the mp backend's (control connections to ``master_addr``,
    which must be an address the actors reach: this node's address on a multi-node cluster). Raises ValueError
    when Ray is not installed (``pip install ray``)."""

    name = "ray"

    def __init__(self, config: ParallelConfig):
        try:
            ray = importlib.import_module("ray")
        except ImportError as exc:
            raise ValueError("distributed_executor_backend 'ray' needs Ray (pip install ray); or use 'mp'") from exc
        super().__init__(config)
        self._ray = _RayState(ray)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _ray_shutdown, self._ray, self._listener, self._workers,
                                           self._procs, self._stop)

    def _spawn(self, threads: int) -> None:
        state, ray = self._ray, self._ray.ray
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, configure_logging=False)
            state.started = True
        placement = importlib.import_module("ray.util.placement_group")
        strategies = importlib.import_module("ray.util.scheduling_strategies")
        state.group = placement.placement_group([{"CPU": 1}] * (self.config.world_size - 1), strategy="PACK")
        ray.get(state.group.ready(), timeout=START_TIMEOUT_S)
        actor_class = ray.remote(num_cpus=1)(RayWorker)
        for rank in range(1, self.config.world_size):
            actor = actor_class.options(scheduling_strategy=strategies.PlacementGroupSchedulingStrategy(
                state.group, placement_group_bundle_index=rank - 1)).remote()
            state.actors.append(actor)
            state.runs[actor.run.remote(rank, self.control, self._key.decode(), threads)] = rank

    def _check_spawned(self, phase: str) -> None:
        state = self._ray
        done, _ = state.ray.wait(list(state.runs), num_returns=len(state.runs), timeout=0)
        for ref in done:
            rank = state.runs[ref]
            try:
                status = state.ray.get(ref)
            except Exception as exc:  # the actor died or raised
                raise RuntimeError(f"worker rank {rank} (Ray actor) failed while {phase}: {exc}") from exc
            raise RuntimeError(f"worker rank {rank} (Ray actor) exited with status {status} while {phase}")


def _ray_shutdown(state: _RayState, listener: Listener, workers: dict[int, _Worker],
                  procs: dict[int, subprocess.Popen], stop: threading.Event) -> None:
    """The mp shutdown; then the actors' runs awaited (``SHUTDOWN_WAIT_S``), the actors killed, the placement group
    removed and a Ray started here stopped."""
    _shutdown(listener, workers, procs, stop)
    ray = state.ray
    with contextlib.suppress(Exception):  # Ray's errors at teardown (a dead actor, a cluster gone) change nothing
        ray.wait(list(state.runs), num_returns=len(state.runs), timeout=SHUTDOWN_WAIT_S)
    for actor in state.actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)
    if state.group is not None:
        with contextlib.suppress(Exception):
            importlib.import_module("ray.util.placement_group").remove_placement_group(state.group)
    if state.started:
        ray.shutdown()


def make_executor(config: ParallelConfig) -> Executor:
    """The executor of ``config.backend``: "uni", "mp" or "ray" (ValueError when Ray is not installed)."""
    backend = config.validate().backend
    if backend == "uni":
        return UniExecutor(config)
    if backend == "mp":
        return MultiprocExecutor(config)
    return RayExecutor(config)
