"""SWA pool: window snapshots in host memory with a byte capacity, LRU eviction and a short TTL (SPEC.md §4.3).

A snapshot at page boundary b holds what resuming exactly at b needs (the encoder layers' window rows for
[b−w, b) and the encoder's final residual streams for those positions; in ``exact`` prefill mode also the
decoder layers' window rows). The pool only sees ``dict[str, torch.Tensor]`` values under string keys: it knows
nothing of layers or positions. Window state is kept minutes, not days: it is large per sequence and bounded
replay can rebuild it from the persistent global KV.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

Snapshot = dict[str, torch.Tensor]


def snapshot_nbytes(snapshot: Snapshot) -> int:
    """Bytes of the tensors' elements (what the pool charges against its capacity). Raises TypeError when
    ``snapshot`` is not a dict of tensors."""
    if not isinstance(snapshot, dict) or not all(isinstance(t, torch.Tensor) for t in snapshot.values()):
        raise TypeError("a snapshot is a dict[str, torch.Tensor]")
    return sum(t.numel() * t.element_size() for t in snapshot.values())


def copy_snapshot(snapshot: Snapshot) -> Snapshot:
    """Contiguous host copies of the tensors (the engine reuses its buffers; callers may write into theirs)."""
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in snapshot.items()}


def default_swa_pool_bytes() -> int:
    """10% of the memory this process may use, in bytes: physical RAM, or a smaller cgroup v2 limit
    (SPEC.md §4.3: ``swa_pool_bytes`` default)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        total = 0
    if total <= 0:
        total = _meminfo_total()
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit)) if total else int(limit)
    except OSError:
        pass
    return total // 10


def _meminfo_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class SwaPool:
    """In-memory snapshots by string key (SPEC.md §4.3).

    Args:
        capacity_bytes: bound on the stored tensors' bytes; least recently used snapshots are evicted to stay
            under it. 0 disables the pool (every put is refused, every get a miss).
        ttl_seconds: a snapshot not accessed (put or hit) for this many seconds is a miss and is dropped.
        clock: seconds, monotonic in practice (injectable for tests).

    Thread-safe. Stores copies on put and hands out copies on get. Never raises for a miss; ``put`` raises
    TypeError only when ``snapshot`` is not a dict of tensors.
    """

    read_tier = "swa_pool"  # the ``tier`` label of its read counters (``dsv41:prefix_cache_read_bytes_total``)

    def __init__(self, capacity_bytes: int, ttl_seconds: float = 300.0, clock: Callable[[], float] = time.monotonic):
        if capacity_bytes < 0 or ttl_seconds <= 0:
            raise ValueError(f"capacity_bytes must be >= 0 and ttl_seconds > 0, got {capacity_bytes}, {ttl_seconds}")
        self.capacity_bytes = capacity_bytes
        self.ttl_seconds = ttl_seconds
        self.clock = clock
        self._lock = threading.Lock()
        # key -> (snapshot, bytes, last access); least recently used first, so expired entries form a prefix.
        self._entries: OrderedDict[str, tuple[Snapshot, int, float]] = OrderedDict()
        self._occupancy = 0
        self._stats = dict(hits=0, misses=0, puts=0, evictions=0, expired=0, read_bytes=0, read_seconds=0.0)

    def put(self, key: str, snapshot: Snapshot) -> bool:
        """Store a copy of ``snapshot`` under ``key`` (replacing any previous one); False when it does not fit
        in the capacity at all (a previous snapshot under ``key`` is dropped then too)."""
        nbytes = snapshot_nbytes(snapshot)
        if self.capacity_bytes == 0 or nbytes > self.capacity_bytes:
            with self._lock:
                self._drop(key)
            return False
        stored = copy_snapshot(snapshot)  # outside the lock: the copy is the slow part
        with self._lock:
            now = self.clock()
            self._expire(now)
            self._drop(key)
            while self._occupancy + nbytes > self.capacity_bytes:
                self._drop(next(iter(self._entries)))
                self._stats["evictions"] += 1
            self._entries[key] = (stored, nbytes, now)
            self._occupancy += nbytes
            self._stats["puts"] += 1
        return True

    def get(self, key: str) -> Snapshot | None:
        """A copy of the snapshot under ``key``, or None when it is absent or expired (then dropped)."""
        with self._lock:
            now = self.clock()
            self._expire(now)
            entry = self._entries.get(key)
            if entry is None:
                self._stats["misses"] += 1
                return None
            snapshot, nbytes, _ = entry
            self._entries[key] = (snapshot, nbytes, now)
            self._entries.move_to_end(key)
            self._stats["hits"] += 1
        start = time.perf_counter()
        out = copy_snapshot(snapshot)  # stored tensors are never written, so copying outside the lock is safe
        seconds = time.perf_counter() - start
        with self._lock:
            self._stats["read_bytes"] += nbytes
            self._stats["read_seconds"] += seconds
        return out

    def contains(self, key: str) -> bool:
        """True when an unexpired snapshot is stored under ``key`` (not an access: LRU order and TTL unchanged)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and self.clock() - entry[2] <= self.ttl_seconds

    def clear(self) -> int:
        """Drop every snapshot (``LLMEngine.reset_prefix_cache``); returns how many there were. Counters are kept
        (they are cumulative, like the engine's)."""
        with self._lock:
            n = len(self._entries)
            self._entries.clear()
            self._occupancy = 0
            return n

    @property
    def occupancy_bytes(self) -> int:
        """Bytes of the stored snapshots (expired ones not yet dropped included)."""
        with self._lock:
            return self._occupancy

    @property
    def stats(self) -> dict:
        """Counters hits, misses, puts, evictions (for capacity), expired, read_bytes and read_seconds (bytes of the
        snapshots ``get`` copied out on hits, and the seconds the copies took: their ratio is the read bandwidth);
        and entries, occupancy_bytes."""
        with self._lock:
            return dict(self._stats, entries=len(self._entries), occupancy_bytes=self._occupancy)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._occupancy -= entry[1]

    def _expire(self, now: float) -> None:
        while self._entries:
            key, (_, _, last) = next(iter(self._entries.items()))
            if now - last <= self.ttl_seconds:
                return
            self._drop(key)
            self._stats["expired"] += 1
