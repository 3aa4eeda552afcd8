"""Keep freed host memory for the next forward instead of handing it back to the OS (glibc ``mallopt``).

A CPU forward allocates and frees the same large temporaries at every step (activations of a prefill chunk,
expert hidden states, mHC streams). glibc serves a request of at least its *mmap threshold* with a fresh
``mmap`` and returns it with ``munmap`` when freed, and trims free memory above its *trim threshold* from the top
of the heap; the pages of such memory are faulted in and zeroed again on the next touch. Both thresholds start
small (128 KiB) and glibc raises them as it sees large blocks freed, so how often a step re-faults its
temporaries depends on the order of every allocation since the process started: measured on the bench-8m model,
one tree of this project re-faulted ~19,000 pages (~75 MB) per 1K-token prefill and another none, for the
same forward (bench/README.md, "Host memory"), a 5-10% difference in prefill speed that followed unrelated code
changes.

:func:`keep_freed_memory` fixes both thresholds once, as glibc's ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` environment variables would (and as a server would with tcmalloc or jemalloc): blocks
up to :data:`MMAP_THRESHOLD` come from the heap, and up to :data:`TRIM_THRESHOLD` of free heap is kept for reuse.
The engine's model runner calls it for a CPU model. It changes nothing

- when the environment already sets a malloc setting (any ``MALLOC_..._`` variable, e.g.
  ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_ARENA_MAX``, or ``GLIBC_TUNABLES``): the user's choice stands;
- when ``DSV41_KEEP_FREED_MEMORY=0``;
- where the C library is not glibc (macOS, musl): their allocators have other rules.

The cost is memory: up to :data:`TRIM_THRESHOLD` of freed heap stays in the process's resident set between
steps, and is reused by the next one. The values are a measured balance (bench/README.md, "Issue 24"): at glibc's
largest mmap threshold (32 MiB) with a 256 MiB trim threshold, every temporary of a 2K-token prefill chunk came
from the heap, whose fragmentation raised an 8K prefill's peak resident memory by 5-30 % from run to run; at
8 MiB / 64 MiB the peak matches glibc's own choice and a repeated 1K or 2K prefill still faults almost no pages
(the blocks above 8 MiB are few and large, so their faults are a small share of the step). What loading a model
freed is handed back once, after the fast backend's install (:func:`release_freed_memory`, glibc's
``malloc_trim``; only where the thresholds were set), so it is not kept for nothing.
"""

from __future__ import annotations

import ctypes
import os
import threading

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 8 << 20  # bytes: larger blocks are mapped and unmapped (see below)
TRIM_THRESHOLD = 64 << 20  # bytes of free heap kept for the next step
USER_SETTINGS = ("MALLOC_", "GLIBC_TUNABLES")  # prefixes of the environment variables glibc's malloc reads
SWITCH = "DSV41_KEEP_FREED_MEMORY"

_lock = threading.Lock()
_state: dict[str, str | None] = {"outcome": None}


def keep_freed_memory() -> str:
    """Set glibc's mmap threshold to :data:`MMAP_THRESHOLD` and its trim threshold to :data:`TRIM_THRESHOLD`
    bytes, once per process (process-wide; later calls return the first call's outcome).

    Returns what happened, for the log: ``"set"``, or why nothing was set (``"off"`` by ``DSV41_KEEP_FREED_MEMORY
    =0``, ``"user"`` when a malloc tunable is in the environment, ``"not glibc"``, ``"refused"`` when glibc
    rejected a value). Never raises."""
    with _lock:
        if _state["outcome"] is None:
            _state["outcome"] = _apply()
        return _state["outcome"]


def release_freed_memory() -> bool:
    """Hand the free pages of glibc's heaps back to the OS now (``malloc_trim(0)``): after loading and packing a
    model, the blocks its loading freed would otherwise stay resident until a forward reuses them. True when
    memory was released; False where nothing was (or the C library is not glibc). Never raises."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim(0) == 1


def _apply() -> str:
    if os.environ.get(SWITCH, "1").strip() == "0":
        return "off"
    if any(name.startswith(USER_SETTINGS) for name in os.environ):
        return "user"
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "not glibc"
    if not hasattr(libc, "gnu_get_libc_version"):  # musl has a mallopt that does nothing
        return "not glibc"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "refused"
    return "set"
