"""The kernels' thread pool (``csrc/pool.c``) and prefetch hints.

The memory-bound kernels (projections, the MoE, the window step, gathers, mHC mixing, attention, index scores,
top-k) split their work over the library's own thread pool (:func:`set_threads`; one thread until it is called):
items of rows or tokens, each computed by the same operations whichever thread takes it, so results do not depend
on the thread count. A few-token engine step hands torch's threads to the pool and runs torch on one thread
meanwhile (engine/model_runner.py): two pools spinning on the same cores would stall each other.
"""

from __future__ import annotations

import ctypes
import math
import os

import torch

from deepseek_v41.kernels.loader import library, register

SIGNATURES = {
    "dsv41_set_threads": ([ctypes.c_int], ctypes.c_int),
    "dsv41_set_spin": ([ctypes.c_int64], None),
    "dsv41_get_spin": ([], ctypes.c_int64),
    "dsv41_pool_sleeps": ([], ctypes.c_long),
    "dsv41_prefetch": ([ctypes.c_void_p, ctypes.c_int64], None),
}
register(SIGNATURES)

_state = {"threads": 1}


def set_threads(threads: int) -> int:
    """Let the kernels' jobs (projections, experts, attention, mHC mixing, index scores, ...) run on up to
    ``threads`` threads: the caller plus
    ``threads - 1`` worker threads of the library's own pool, started (or stopped) here; 1 keeps every job on the
    caller. Results do not depend on it (each output is computed the same way by whichever thread). Returns the
    threads now used (1 when the library is off). Raises ValueError for ``threads`` < 1."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    lib = library()
    _state["threads"] = 1 if lib is None else lib.dsv41_set_threads(threads)
    return _state["threads"]


def set_spin(seconds: float) -> None:
    """How long the pool's workers spin for the next job after one before they sleep (a sleeping worker is woken
    by the next job, ~10-50 µs later, while the caller already takes its items). A few-token forward calls the
    pool every ~100 µs and wants them spinning (engine/model_runner.py sets 2 ms there); outside one, torch's own
    threads need those cores, so it sets 0. Negative counts as 0; nothing happens when the library is off. The
    setting is process-wide: a prefill in one thread sets 0 while another thread's decode may be running (its
    workers then sleep between its kernels until its next step sets the spin again). Raises ValueError for a
    time that is not finite."""
    if not math.isfinite(seconds):
        raise ValueError(f"spin time must be a finite number of seconds, got {seconds}")
    lib = library()
    if lib is not None:
        lib.dsv41_set_spin(int(max(seconds, 0.0) * 1e9))


def spin() -> float:
    """The pool's spin time in seconds (:func:`set_spin`; 0.002 until it is set, 0.0 when the library is off)."""
    lib = library()
    return 0.0 if lib is None else lib.dsv41_get_spin() / 1e9


def pool_sleeps() -> int:
    """How many times the pool's workers went to sleep (their spin time over, or descheduled while spinning) since
    the library loaded; 0 when it is off. For tests and diagnostics."""
    lib = library()
    return 0 if lib is None else lib.dsv41_pool_sleeps()


def prefetch(addresses: torch.Tensor) -> None:
    """Prefetch hints for the memory at int64 ``addresses`` [n] (two 64-byte lines each; model/warm.py). A
    prefetch reads nothing and never faults, so stale addresses are harmless, and no addresses (n = 0) are no
    hints: the one wrapper that takes an empty tensor. Nothing happens when the library is off."""
    lib = library()
    if lib is not None:
        lib.dsv41_prefetch(addresses.data_ptr(), addresses.numel())


def threads() -> int:
    """The threads the kernels' jobs run on (:func:`set_threads`; 1 until it is called, and in a forked child)."""
    return _state["threads"]


def _forked_child() -> None:
    _state["threads"] = 1  # the library's pool has no workers in a forked child (only the forking thread survives)


os.register_at_fork(after_in_child=_forked_child)
