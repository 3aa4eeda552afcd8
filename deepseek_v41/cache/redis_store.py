"""Redis-backed SWA pool and page tier, shared by the engine processes of one model (SPEC.md §4.3).

:class:`RedisStore` has the snapshot API of :class:`~deepseek_v41.cache.swa_pool.SwaPool` (``put / get /
contains / stats / occupancy_bytes``) with the snapshots in Redis instead of host memory: serialized as
safetensors bytes (no pickle), expiring through Redis' own TTL (``SET ... PX``, refreshed on a hit with ``GETEX ...
PX``). It also holds global KV pages (:class:`RedisPages`): the bytes of a page file (checksummed, with the model
fingerprint, the layout and the block hash in its header; :class:`~deepseek_v41.cache.store.PageCodec`), so that
an engine on another cache directory — another machine — hits the pages an engine wrote. Capacity and eviction
are Redis' ``maxmemory`` and ``maxmemory-policy`` (a warning at start when Redis has no ``maxmemory``).

Keys: ``dsv41:<namespace>:swa:<key>`` and ``dsv41:<namespace>:page:<block hash>``. The namespace must contain the
model fingerprint: entries of different models must never mix (a page's header is checked against the full
fingerprint too).

Redis never blocks the engine thread for long, and a Redis that does not answer is a miss:

- writes (snapshots, pages, deletions) go to a bounded queue (``max_pending_bytes``) served by a background
  thread; a full queue or a Redis marked down drops the write (``stats["dropped"]``);
- reads run on a background thread too; the caller waits at most ``read_timeout`` seconds, then the read is a
  miss and Redis is marked down;
- every connection has connect and read timeouts (``CONNECT_TIMEOUT_SECONDS``, ``SOCKET_TIMEOUT_SECONDS``);
- after a failure (an error, a timeout) Redis is marked down: reads are misses without asking
  (``stats["unavailable"]``), writes are dropped, and every ``RETRY_SECONDS`` one background PING checks whether it
  is back. One warning per outage; ``stats["errors"]`` counts the failed commands.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import redis
import safetensors
import safetensors.torch
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from deepseek_v41.cache.prefix_cache import stop_thread
from deepseek_v41.cache.swa_pool import Snapshot, copy_snapshot, snapshot_nbytes

log = logging.getLogger(__name__)

# Seconds between checks whether a Redis marked down is back.
RETRY_SECONDS = 5.0
# Socket timeouts of every Redis connection (on the background threads).
CONNECT_TIMEOUT_SECONDS = 0.5
SOCKET_TIMEOUT_SECONDS = 1.0
# The longest a caller (the engine thread) waits for a read.
READ_TIMEOUT_SECONDS = 0.5
# Bytes of writes waiting for Redis at most; beyond, writes are dropped.
MAX_PENDING_BYTES = 256 << 20
# Seconds a measured snapshot occupancy is reused.
OCCUPANCY_REFRESH_SECONDS = 1.0
# Redis URLs already warned about (once per process).
_WARNED_MAXMEMORY: set[str] = set()


class _Jobs:
    """A FIFO of write jobs bounded in bytes, with join (``queue.Queue`` bounds items, not bytes)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.items: collections.deque = collections.deque()
        self.bytes = 0
        self.unfinished = 0
        self.closed = False
        self.cond = threading.Condition()

    def put(self, job: tuple, nbytes: int) -> bool:
        with self.cond:
            if self.closed or (self.items and self.bytes + nbytes > self.max_bytes):
                return False
            self.items.append((job, nbytes))
            self.bytes += nbytes
            self.unfinished += 1
            self.cond.notify_all()
            return True

    def take(self) -> tuple | None:
        """The next job (blocking), or None once closed."""
        with self.cond:
            while not self.items and not self.closed:
                self.cond.wait()
            if not self.items:
                return None
            job, nbytes = self.items.popleft()
            self.bytes -= nbytes
            return job

    def done(self) -> None:
        with self.cond:
            self.unfinished -= 1
            self.cond.notify_all()

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.unfinished:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _write_loop(ref: weakref.ref, jobs: _Jobs) -> None:
    """The writer thread: holds the store only while it runs a job, so a dropped store is collected."""
    while True:
        job = jobs.take()
        if job is None:
            return
        store = ref()
        if store is None:
            return
        try:
            store._write(job)
        finally:
            jobs.done()
            del store


class RedisStore:
    """Snapshots and pages in Redis, off the caller's thread (SPEC.md §4.3; see the module docstring).

    Args:
        url: ``redis://host:port/db``.
        namespace: key prefix shared by the processes that may see each other's entries; must contain the model
            fingerprint (and nothing that differs between those processes).
        ttl_seconds: a snapshot not accessed (put or hit) for this many seconds expires (Redis ``PX``).
        page_ttl_seconds: a page not accessed (put or hit) for this long expires (72 h, the persistent store's
            TTL; Redis' ``maxmemory`` policy may evict it earlier).
        clock: seconds since the epoch, for the retry delay (injectable for tests).
        read_timeout: seconds a read may keep its caller waiting before it is a miss.
        max_pending_bytes: bytes of queued writes at most.

    Never raises for Redis failures. ``put`` raises TypeError when ``snapshot`` is not a dict of tensors.
    """

    read_tier = "remote"  # the ``tier`` label of its read counters (``dsv41:prefix_cache_read_bytes_total``)

    def __init__(
        self,
        url: str,
        namespace: str,
        ttl_seconds: float = 300.0,
        page_ttl_seconds: float = 72 * 3600,
        clock: Callable[[], float] = time.time,
        read_timeout: float = READ_TIMEOUT_SECONDS,
        max_pending_bytes: int = MAX_PENDING_BYTES,
    ):
        if not namespace or any(c.isspace() for c in namespace):
            raise ValueError(f"namespace must be non-empty without whitespace (include the model fingerprint), "
                             f"got {namespace!r}")
        if ttl_seconds <= 0 or page_ttl_seconds <= 0 or read_timeout <= 0:
            raise ValueError(f"ttl_seconds, page_ttl_seconds and read_timeout must be > 0, got {ttl_seconds}, "
                             f"{page_ttl_seconds}, {read_timeout}")
        self.url = url
        self.namespace = namespace
        self.ttl_seconds = ttl_seconds
        self.page_ttl_seconds = page_ttl_seconds
        self.clock = clock
        self.read_timeout = read_timeout
        # One immediate retry: a pooled connection may be stale after a server restart.
        self._redis = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
                                           socket_timeout=SOCKET_TIMEOUT_SECONDS, retry=Retry(NoBackoff(), 1))
        self._prefix = f"dsv41:{namespace}:"
        self._lock = threading.Lock()
        self._down = False
        self._down_until = float("-inf")
        self._probing = False
        self._stats = dict(hits=0, misses=0, puts=0, errors=0, dropped=0, unavailable=0, pages_read=0,
                           pages_written=0, read_bytes=0, read_seconds=0.0)
        self._occupancy, self._occupancy_at, self._occupancy_queued = 0, float("-inf"), False
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="dsv41-redis-read")
        self._jobs = _Jobs(max_pending_bytes)
        self._writer = threading.Thread(target=_write_loop, args=(weakref.ref(self), self._jobs),
                                        name="dsv41-redis-write", daemon=True)
        self._stop_writer = weakref.finalize(self, stop_thread, self._jobs.close, self._writer)  # see stop_thread
        self._writer.start()
        self._jobs.put(("check",), 0)

    # ----------------------------------------------------------------------------------------- snapshots

    def put(self, key: str, snapshot: Snapshot) -> bool:
        """Queue ``snapshot`` for Redis under ``key`` with the TTL; False when it is dropped (Redis down, queue
        full)."""
        nbytes = snapshot_nbytes(snapshot)  # type check before any I/O
        return self._enqueue(("snapshot", key, copy_snapshot(snapshot)), nbytes)

    def get(self, key: str) -> Snapshot | None:
        """The snapshot under ``key`` (fresh CPU tensors), or None when absent, expired, unreadable (then deleted),
        Redis fails or does not answer within ``read_timeout``. A hit restarts the TTL."""
        name = self._swa_key(key)
        start = time.perf_counter()
        data = self._read(lambda r: r.getex(name, px=self._ttl_ms(self.ttl_seconds)))
        if data is None:
            self._count("misses")
            return None
        try:
            snapshot = safetensors.torch.load(data)
        except (safetensors.SafetensorError, ValueError) as exc:
            log.warning("prefix cache: unreadable snapshot %s in Redis (%s); deleted", name, exc)
            self._enqueue(("delete", name), 0)
            self._count("misses")
            return None
        self._count_read(len(data), time.perf_counter() - start, "hits")
        return snapshot

    def contains(self, key: str) -> bool:
        """True when an unexpired snapshot is stored under ``key`` (not an access: the TTL is unchanged)."""
        return bool(self._read(lambda r: r.exists(self._swa_key(key))))

    @property
    def occupancy_bytes(self) -> int:
        """Bytes of this namespace's serialized snapshots in Redis, as last measured (0 before the first
        measurement). The engine reads it after every step, so it never waits: a value older than
        ``OCCUPANCY_REFRESH_SECONDS`` queues a new measurement (a SCAN, O(keys)) on the writer thread."""
        with self._lock:
            stale = not self._occupancy_queued and time.monotonic() - self._occupancy_at > OCCUPANCY_REFRESH_SECONDS
            self._occupancy_queued |= stale
        if stale and not (self._available() and self._jobs.put(("occupancy",), 0)):
            with self._lock:
                self._occupancy_queued = False
        return self._occupancy

    @property
    def stats(self) -> dict:
        """Counters of this client: hits, misses (snapshots), puts (snapshots written), pages_read, pages_written,
        errors (failed or timed-out Redis commands), dropped (writes not sent: Redis down or the queue full),
        unavailable (reads answered as misses without asking, Redis being down); read_bytes and read_seconds
        (bytes of the values that ``get`` and :meth:`RedisPages.get` returned a snapshot or a page from, and the
        seconds from sending the GET to the decoded value: their ratio is the read bandwidth; misses, timeouts
        and rejected values are not counted; :meth:`get_page` alone counts neither)."""
        with self._lock:
            return dict(self._stats)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` seconds until the queued writes are sent (or dropped); True when none is left."""
        return self._jobs.join(timeout)

    # ----------------------------------------------------------------------------------------- pages

    def put_page(self, block_hash: str, data: bytes) -> bool:
        """Queue the page bytes ``data`` under ``block_hash`` with the page TTL; False when dropped."""
        return self._enqueue(("page", block_hash, data), len(data))

    def get_page(self, block_hash: str) -> bytes | None:
        """The page bytes under ``block_hash`` (the TTL restarts), or None (absent, Redis down or slow)."""
        data = self._read(lambda r: r.getex(self._page_key(block_hash), px=self._ttl_ms(self.page_ttl_seconds)))
        if data is not None:
            self._count("pages_read")
        return data

    def delete_page(self, block_hash: str) -> None:
        """Queue the deletion of the page under ``block_hash`` (it failed validation)."""
        self._enqueue(("delete", self._page_key(block_hash)), 0)

    # ----------------------------------------------------------------------------------------- internals

    def _swa_key(self, key: str) -> str:
        return self._prefix + "swa:" + key

    def _page_key(self, block_hash: str) -> str:
        return self._prefix + "page:" + block_hash

    @staticmethod
    def _ttl_ms(seconds: float) -> int:
        return max(1, round(seconds * 1000))

    @staticmethod
    def _escape(pattern: str) -> str:
        # A namespace may contain glob characters; SCAN MATCH must take them literally.
        return "".join("\\" + c if c in "*?[]\\" else c for c in pattern)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _count_read(self, nbytes: int, seconds: float, hit: str | None = None) -> None:
        """Add one successful read of ``nbytes`` that took ``seconds`` (and count ``hit`` when given)."""
        with self._lock:
            self._stats["read_bytes"] += nbytes
            self._stats["read_seconds"] += seconds
            if hit is not None:
                self._stats[hit] += 1

    def _available(self) -> bool:
        """False while Redis is marked down; then, once per RETRY_SECONDS, a PING on the background reader
        checks whether it is back (the caller never waits for it)."""
        with self._lock:
            if not self._down:
                return True
            if self._probing or self.clock() < self._down_until:
                return False
            self._probing = True
            self._down_until = self.clock() + RETRY_SECONDS
        self._reader.submit(self._probe)
        return False

    def _probe(self) -> None:
        try:
            self._redis.ping()
        except (redis.RedisError, OSError) as exc:
            with self._lock:
                self._probing = False
            self._fail(exc)
            return
        with self._lock:
            self._probing, self._down = False, False
        log.info("prefix cache: Redis at %s is back", self.url)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._stats["errors"] += 1
            self._down_until = self.clock() + RETRY_SECONDS
            warn, self._down = not self._down, True
        if warn:
            log.warning("prefix cache: Redis at %s failed (%s); its snapshots and pages are misses, checking again "
                        "every %.0f s", self.url, exc, RETRY_SECONDS)

    def _read(self, command: Callable[[redis.Redis], Any]) -> Any:
        """Run ``command`` on the background reader and wait at most ``read_timeout``; None when Redis is down,
        fails or does not answer in time (then it is marked down)."""
        if not self._available():
            self._count("unavailable")
            return None
        future = self._reader.submit(command, self._redis)
        try:
            return future.result(timeout=self.read_timeout)
        except FutureTimeout:
            self._fail(TimeoutError(f"no answer within {self.read_timeout} s"))
        except (redis.RedisError, OSError) as exc:
            self._fail(exc)
        return None

    def _enqueue(self, job: tuple, nbytes: int) -> bool:
        if not self._available() or not self._jobs.put(job, nbytes):
            self._count("dropped")
            return False
        return True

    def _write(self, job: tuple) -> None:
        """Run one queued write on the writer thread (dropped while Redis is down)."""
        kind = job[0]
        if kind == "check":
            self._check_maxmemory()
            return
        if kind == "occupancy":
            self._measure_occupancy()
            return
        with self._lock:
            down = self._down
        if down:
            self._count("dropped")
            return
        try:
            if kind == "snapshot":
                _, key, snapshot = job
                data = safetensors.torch.save(snapshot)
                self._redis.set(self._swa_key(key), data, px=self._ttl_ms(self.ttl_seconds))
                self._count("puts")
            elif kind == "page":
                _, block_hash, data = job
                self._redis.set(self._page_key(block_hash), data, px=self._ttl_ms(self.page_ttl_seconds))
                self._count("pages_written")
            else:
                self._redis.delete(job[1])
        except (redis.RedisError, OSError) as exc:
            self._fail(exc)

    def _measure_occupancy(self) -> None:
        try:
            with self._lock:
                down = self._down
            if down:
                return
            keys = list(self._redis.scan_iter(match=self._escape(self._prefix) + "swa:*", count=1000))
            pipe = self._redis.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(k)
            total = sum(pipe.execute()) if keys else 0
            with self._lock:
                self._occupancy, self._occupancy_at = total, time.monotonic()
        except (redis.RedisError, OSError) as exc:
            self._fail(exc)
        finally:
            with self._lock:
                self._occupancy_queued = False

    def _check_maxmemory(self) -> None:
        """Warn once when Redis has no memory bound (pages and snapshots then leave only through their TTL)."""
        try:
            limit = int(self._redis.config_get("maxmemory").get("maxmemory", 0))
        except (redis.RedisError, OSError, ValueError):
            return  # CONFIG may be disabled; a dead Redis shows at the first real command
        if limit == 0 and self.url not in _WARNED_MAXMEMORY:
            _WARNED_MAXMEMORY.add(self.url)
            log.warning("prefix cache: Redis at %s has no maxmemory: snapshots and pages leave it only through "
                        "their TTL; set maxmemory and maxmemory-policy allkeys-lru to bound it", self.url)


class RedisPages:
    """Global KV pages in Redis, in the page file format (SPEC.md §4.3): what lets an engine on another cache
    directory hit the prefixes an engine wrote.

    ``store``: the :class:`RedisStore` (its namespace contains the fingerprint); ``codec``: the
    :class:`~deepseek_v41.cache.store.PageCodec` of the model and layout. A value that fails validation
    (corrupted, another model, another layout, another hash) is a miss and is deleted, with one warning per kind.
    """

    def __init__(self, store: RedisStore, codec: Any):
        self.store, self.codec = store, codec
        self._warned: set[str] = set()
        self.rejected = 0

    def get(self, block_hash: str) -> dict[str, torch.Tensor] | None:
        """The page under ``block_hash`` (fresh CPU tensors of the layout), or None."""
        start = time.perf_counter()
        data = self.store.get_page(block_hash)
        if data is None:
            return None
        page, kind = self.codec.decode(block_hash, data) if len(data) <= self.codec.size(block_hash) \
            else (None, "oversize")
        if page is None:
            self.rejected += 1
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("prefix cache: rejected page %s from Redis (%s), deleted; further rejections of this "
                            "kind are only counted", block_hash, kind)
            self.store.delete_page(block_hash)
        else:
            self.store._count_read(len(data), time.perf_counter() - start)
        return page

    def contains(self, block_hash: str) -> bool:
        """Whether Redis holds a page under ``block_hash`` now (False while Redis is down; not an access)."""
        store = self.store
        return bool(store._read(lambda r: r.exists(store._page_key(block_hash))))

    def put(self, block_hash: str, page: dict[str, torch.Tensor]) -> bool:
        """Encode ``page`` and queue it for Redis; False when dropped. Raises ValueError for a page that does not
        match the layout."""
        self.codec.check_page(page)
        return self.store.put_page(block_hash, self.codec.encode(block_hash, page))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queued pages are sent (see :meth:`RedisStore.flush`)."""
        return self.store.flush(timeout)

    @property
    def stats(self) -> dict:
        """The store's counters and ``rejected`` (pages that failed validation)."""
        return {**self.store.stats, "rejected": self.rejected}

