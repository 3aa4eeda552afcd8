"""Redis-backed SWA pool and page index, shared by the engine processes of one model (SPEC.md §4.3).

Same snapshot API as :class:`~deepseek_v41.cache.swa_pool.SwaPool` (``put / get / contains / stats /
occupancy_bytes``), with the snapshots in Redis instead of host memory: serialized as safetensors bytes (no
pickle), expiring through Redis' own TTL (``SET ... PX``, refreshed on a hit with ``GETEX ... PX``); capacity and
eviction are Redis' ``maxmemory`` policy. The page index says which global KV pages some process has persisted,
so that processes sharing a cache directory need not stat files to know.

Keys: ``dsv41:<namespace>:swa:<key>`` (a string per snapshot) and ``dsv41:<namespace>:pages`` (a sorted set of
block hashes scored by the time they were added). The namespace must contain the model fingerprint: snapshots of
different models must never mix.

Redis is a cache here: a connection error, a timeout or an error reply is a miss (or a refused put) with one
warning per outage; after an error the store does not try Redis again for ``RETRY_SECONDS``, so a dead server
costs the engine nothing per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import redis
import safetensors
import safetensors.torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from deepseek_v41.cache.swa_pool import Snapshot, copy_snapshot, snapshot_nbytes

log = logging.getLogger(__name__)

# Seconds without trying Redis after a failed command.
RETRY_SECONDS = 5.0


class RedisStore:
    """Snapshots and a page index in Redis (SPEC.md §4.3).

    Args:
        url: ``redis://host:port/db``.
        namespace: key prefix shared by the processes that may see each other's entries; must contain the model
            fingerprint (and nothing that differs between those processes).
        ttl_seconds: a snapshot not accessed (put or hit) for this many seconds expires (Redis ``PX``).
        page_ttl_seconds: a page index entry not re-added for this long is no longer reported (72 h, the
            persistent store's TTL).
        clock: seconds since the epoch, for the page index scores and the retry delay (injectable for tests);
            it must agree between processes, so it is wall-clock time.

    Never raises for Redis failures. ``put`` raises TypeError when ``snapshot`` is not a dict of tensors.
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        ttl_seconds: float = 300.0,
        page_ttl_seconds: float = 72 * 3600,
        clock: Callable[[], float] = time.time,
    ):
        if not namespace or any(c.isspace() for c in namespace):
            raise ValueError(f"namespace must be non-empty without whitespace (include the model fingerprint), "
                             f"got {namespace!r}")
        if ttl_seconds <= 0 or page_ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds and page_ttl_seconds must be > 0, got {ttl_seconds}, {page_ttl_seconds}")
        self.url = url
        self.namespace = namespace
        self.ttl_seconds = ttl_seconds
        self.page_ttl_seconds = page_ttl_seconds
        self.clock = clock
        # Short timeouts and one immediate retry (a pooled connection may be stale after a server restart): a slow
        # cache must not stall a request longer than recomputing would.
        self._redis = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=2.0,
                                           retry=Retry(NoBackoff(), 1))
        self._prefix = f"dsv41:{namespace}:"
        self._lock = threading.Lock()
        self._down_until = float("-inf")
        self._down = False
        self._stats = dict(hits=0, misses=0, puts=0, errors=0)

    # ----------------------------------------------------------------------------------------- snapshots

    def put(self, key: str, snapshot: Snapshot) -> bool:
        """Store ``snapshot`` under ``key`` with the TTL; False when Redis is unreachable or refuses it."""
        snapshot_nbytes(snapshot)  # type check before any I/O
        data = safetensors.torch.save(copy_snapshot(snapshot))
        ok = self._call(lambda r: r.set(self._swa_key(key), data, px=self._ttl_ms(self.ttl_seconds)))
        if ok:
            self._count("puts")
        return bool(ok)

    def get(self, key: str) -> Snapshot | None:
        """The snapshot under ``key`` (fresh CPU tensors), or None when absent, expired, unreadable (then deleted)
        or Redis fails. A hit restarts the TTL."""
        name = self._swa_key(key)
        data = self._call(lambda r: r.getex(name, px=self._ttl_ms(self.ttl_seconds)))
        if data is None:
            self._count("misses")
            return None
        try:
            snapshot = safetensors.torch.load(data)
        except (safetensors.SafetensorError, ValueError) as exc:
            log.warning("prefix cache: unreadable snapshot %s in Redis (%s); deleted", name, exc)
            self._call(lambda r: r.delete(name))
            self._count("misses")
            return None
        self._count("hits")
        return snapshot

    def contains(self, key: str) -> bool:
        """True when an unexpired snapshot is stored under ``key`` (not an access: the TTL is unchanged)."""
        return bool(self._call(lambda r: r.exists(self._swa_key(key))))

    @property
    def occupancy_bytes(self) -> int:
        """Bytes of this namespace's serialized snapshots in Redis (a SCAN: O(keys), for metrics, not per
        request); 0 when Redis fails."""

        def total(r: redis.Redis) -> int:
            keys = list(r.scan_iter(match=self._escape(self._prefix) + "swa:*", count=1000))
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(k)
            return sum(pipe.execute()) if keys else 0

        return self._call(total) or 0

    @property
    def stats(self) -> dict:
        """Counters of this client: hits, misses, puts, errors (failed Redis commands)."""
        with self._lock:
            return dict(self._stats)

    # ----------------------------------------------------------------------------------------- page index

    def add_pages(self, hashes: Iterable[str]) -> None:
        """Record that the pages ``hashes`` are persisted (now); drops index entries older than the page TTL."""
        now = self.clock()
        mapping = dict.fromkeys(hashes, now)
        if not mapping:
            return
        key = self._prefix + "pages"

        def add(r: redis.Redis) -> None:
            pipe = r.pipeline(transaction=False)
            pipe.zadd(key, mapping)
            pipe.zremrangebyscore(key, "-inf", f"({now - self.page_ttl_seconds}")
            pipe.pexpire(key, self._ttl_ms(self.page_ttl_seconds))  # an abandoned namespace disappears
            pipe.execute()

        self._call(add)

    def has_page(self, block_hash: str) -> bool:
        """True when some process recorded ``block_hash`` within the page TTL; False too when Redis fails."""
        score = self._call(lambda r: r.zscore(self._prefix + "pages", block_hash))
        return score is not None and self.clock() - score <= self.page_ttl_seconds

    def remove_page(self, block_hash: str) -> None:
        """Forget ``block_hash`` (its file was evicted or rejected)."""
        self._call(lambda r: r.zrem(self._prefix + "pages", block_hash))

    # ----------------------------------------------------------------------------------------- internals

    def _swa_key(self, key: str) -> str:
        return self._prefix + "swa:" + key

    @staticmethod
    def _ttl_ms(seconds: float) -> int:
        return max(1, round(seconds * 1000))

    @staticmethod
    def _escape(pattern: str) -> str:
        # A namespace may contain glob characters; SCAN MATCH must take them literally.
        return "".join("\\" + c if c in "*?[]\\" else c for c in pattern)

    def _count(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1

    def _call(self, command: Callable[[redis.Redis], object]):
        """Run ``command`` on the client; None when Redis is down (warning once per outage)."""
        if self.clock() < self._down_until:
            return None
        try:
            result = command(self._redis)
        except (redis.RedisError, OSError) as exc:
            with self._lock:
                self._stats["errors"] += 1
                self._down_until = self.clock() + RETRY_SECONDS
                warn, self._down = not self._down, True
            if warn:
                log.warning("prefix cache: Redis at %s failed (%s); snapshots there are misses, retrying every %.0f s",
                            self.url, exc, RETRY_SECONDS)
            return None
        if self._down:
            self._down = False
            log.info("prefix cache: Redis at %s is back", self.url)
        return result
