"""The prefix cache: reuse a prompt's global KV across requests and restarts (SPEC.md §4.3).

Prefix identity is a hash chain over page-sized token blocks, salted by the model fingerprint and a per-request
``cache_salt``. Tiers: device pages (shared, ref-counted, see :class:`~deepseek_v41.cache.block_manager.
BlockManager`) -> the **SWA pool** of window snapshots in host memory (or Redis) -> the **persistent store** of
global KV pages on disk. Window KV never goes to disk: on a hit without a snapshot, the engine rebuilds it by
replaying a bounded number of tokens.

With N prompt tokens, P the page size and w the window, the reused length is ``L' = P * floor(min(match, N-1) / P)``
(a page multiple; the last prompt token is always computed). What the engine then runs, in CED mode:

- **snapshot at L'** (exact): windows from the snapshot, encoder over [L', N), decoder inputs for positions < L'
  from the snapshot's residuals;
- **bounded replay** (default): encoder over [max(0, L' - w), N) with windows truncated at that start (an
  approximation, measured);
- **exact replay** (``replay="exact"``): encoder over [max(0, min(L', D) - R), N), R = encoder layers x (w - 1),
  the receptive field of the encoder windows, D = the decoder start max(0, N - w) (``LayerPlan.decoder_start``)
  (exact).

Replayed positions write window rows and residuals only; compressed entries, index keys and pending pairs of
[0, L') come from the pages. In ``exact`` prefill mode every layer resumes from the snapshot (which then holds
every layer's window rows); without one the prompt is a miss.

A preempted sequence comes back (:meth:`PrefixCache.match` with ``resumed``) with N = prompt + output tokens,
but its decoder start D stays that of its prompt (the decoder ran over every token since): it resumes at a
snapshot whose window reaches back to D (in practice its prompt's), or replays exactly from
max(0, min(L', D) - R), whatever ``replay`` says, so that preemption never changes its tokens.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.cache.store import PageCodec
from deepseek_v41.cache.swa_pool import SwaPool

log = logging.getLogger(__name__)

REPLAY_MODES = ("bounded", "exact")
# Where prefix-cache reads come from (the ``tier`` label of ``dsv41:prefix_cache_read_bytes_total``): page files,
# the host SWA pool, Redis (pages and, with Redis as the pool, snapshots). Each store names its own (``read_tier``).
READ_TIERS = ("disk", "swa_pool", "remote")


def chain_hashes(root: str, tokens: list[int], block_size: int, start: list[str] | None = None,
                 extra_keys: dict[int, list[str]] | None = None) -> list[str]:
    """Hashes of every full block of ``tokens``: ``h_i = sha256(h_{i-1} || block_i)`` with ``h_{-1} = root``.
    ``start`` holds already computed hashes of the first blocks (extended, not recomputed).

    ``extra_keys`` (vLLM's extra keys; VISION_DESIGN.md decision 6): block index -> content hashes of the images
    whose spans overlap that block (:func:`image_block_keys`); such a block hashes as
    ``sha256(h_{i-1} || block_i || "image:" key ...)``, so two prompts whose ids agree but whose images differ
    part at the first block of the differing image. Blocks without extra keys hash exactly as without them
    (text prompts keep their hashes, and the pages on disk stay valid)."""
    out = list(start or [])
    prev = out[-1] if out else root
    for i in range(len(out), len(tokens) // block_size):
        block = np.asarray(tokens[i * block_size:(i + 1) * block_size], dtype="<i4").tobytes()
        keys = extra_keys.get(i) if extra_keys else None
        if keys:
            block += b"".join(b"\0image:" + key.encode() for key in keys)
        prev = hashlib.sha256(bytes.fromhex(prev) + block).hexdigest()
        out.append(prev)
    return out


def image_block_keys(images: list[tuple[int, int, str]], block_size: int) -> dict[int, list[str]]:
    """The extra keys of :func:`chain_hashes` for images given as (span offset, span length, content hash):
    block index -> the hashes of the images whose spans [offset, offset + length) overlap that block, in prompt
    order."""
    keys: dict[int, list[str]] = {}
    for offset, length, image_hash in images:
        for i in range(offset // block_size, (offset + length - 1) // block_size + 1):
            keys.setdefault(i, []).append(image_hash)
    return keys


def span_safe_pages(pages: int, block_size: int, spans: list[tuple[int, int]] | None) -> int:
    """The most pages (<= ``pages``) a prefix-cache hit may keep so that it does not end inside an image span
    [s, e) of ``spans``: a boundary strictly inside a span moves down to the page boundary at or below s
    (VISION_DESIGN.md decision 6; the span then runs whole in the sequence's next chunk)."""
    for s, e in spans or ():
        if s < pages * block_size < e:
            pages = min(pages, s // block_size)
    return pages


@dataclass
class Hit:
    """What a request reuses: ``cached`` = L' tokens (pages ``pages``), computation restarts at ``start``
    (= L' with a snapshot, the replay start otherwise), ``snapshot`` the SWA snapshot restored, if any."""

    cached: int
    start: int
    pages: list[int]
    snapshot: dict[str, torch.Tensor] | None
    transfer_pages: int = 0  # pages read from the KV connector (disaggregated prefill, issue 29)
    transfer_bytes: int = 0  # their KV bytes (tensor payload, without file headers)
    transfer_seconds: float = 0.0

    @property
    def replayed(self) -> int:
        return self.cached - self.start


class PrefixCache:
    """Matching, page registration and SWA snapshots for one engine (see the module docstring).

    ``exact_prefill``: the engine prefills in ``exact`` mode (a hit then needs a snapshot of every layer's
    window). ``page_store``: a :class:`~deepseek_v41.cache.store.PageStore` (persistent tier) or None;
    ``swa_pool``: a :class:`~deepseek_v41.cache.swa_pool.SwaPool` / :class:`~deepseek_v41.cache.redis_store.
    RedisStore` or None; ``remote_pages``: a :class:`~deepseek_v41.cache.redis_store.RedisPages` (global KV pages
    shared through Redis: read after the disk, written with it) or None. ``connector``: a KV connector of a
    disaggregated server (:mod:`deepseek_v41.disagg.connector`; the same page-tier interface), read last when
    ``connector_read`` (a kv_consumer) and written with the other tiers when ``connector_write`` (a kv_producer);
    the pages it returns are counted per lookup (:class:`Hit` ``transfer_*``). With a page store, remote pages or
    a connector written to, the page-writer thread starts here, with the engine.
    """

    def __init__(self, cache: PagedKVCache, fingerprint: str, exact_prefill: bool, replay: str = "bounded",
                 page_store: Any | None = None, swa_pool: Any | None = None, remote_pages: Any | None = None,
                 connector: Any | None = None, connector_read: bool = False, connector_write: bool = False):
        if replay not in REPLAY_MODES:
            raise ValueError(f"replay must be one of {REPLAY_MODES}, got {replay!r}")
        self.cache, self.fingerprint = cache, fingerprint
        self.exact_prefill, self.replay = exact_prefill, replay
        self.page_store, self.swa_pool, self.remote_pages = page_store, swa_pool, remote_pages
        self.connector = connector
        self.connector_read = connector is not None and connector_read
        self.connector_write = connector is not None and connector_write
        self.page_payload_bytes = PageCodec(fingerprint, cache.page_layout()).payload_bytes  # KV bytes of a page
        self._transfer = [0, 0, 0.0]  # pages, bytes, seconds read from the connector by the current lookup
        self.block_size = cache.block_size
        cfg, plan = cache.config, cache.plan
        self.window = cfg.sliding_window
        n = cfg.num_hidden_layers
        self.snapshot_layers = list(range(n)) if exact_prefill or not plan.ced else list(plan.encoder_layers)
        self.receptive_field = len(self.snapshot_layers) * (self.window - 1)
        self.counters = {"device_pages_hit": 0, "disk_pages_read": 0, "disk_pages_written": 0,
                         "remote_pages_read": 0, "connector_pages_read": 0,
                         "connector_pages_written": 0, "connector_read_seconds": 0.0,
                         "connector_write_seconds": 0.0, "snapshots_hit": 0, "snapshots_written": 0, "cached_tokens": 0,
                         "replayed_tokens": 0}
        # Page writes (an fsync each; encoding for Redis) run on a background thread started with the engine, off
        # the request path; the store is used under one lock from both threads.
        self._store_lock = threading.Lock()
        self._writes: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        if page_store is not None or remote_pages is not None or self.connector_write:
            self._writer = threading.Thread(target=_page_writer, args=(weakref.ref(self), self._writes),
                                            name="dsv41-page-writer", daemon=True)
            # The thread ends with the prefix cache, and at interpreter exit (finalize runs then too) before the
            # interpreter finalizes: a daemon thread still waking up then aborted the process (status 134).
            self._stop_writer = weakref.finalize(self, stop_thread, functools.partial(self._writes.put, None),
                                                 self._writer)
            self._writer.start()

    def make_read_only(self) -> None:
        """Read the persistent tiers, never write them: a worker rank of a parallel engine, whose rank 0 writes the
        pages every rank computes alike (issue 28). The page-writer thread stops and the disk store never evicts
        (rank 0's store keeps the budget)."""
        if self._writer is not None:
            self._stop_writer()
            self._writer = None
        if self.page_store is not None:
            self.page_store.max_bytes = sys.maxsize

    def root(self, salt: str | None) -> str:
        """The chain's root: the model fingerprint and the request's cache salt."""
        return hashlib.sha256(f"{self.fingerprint}\0{salt or ''}".encode()).hexdigest()

    def snapshot_key(self, block_hash: str) -> str:
        return f"{block_hash}-{'exact' if self.exact_prefill else 'ced'}"

    # ------------------------------------------------------------------ lookup
    def match(self, tokens: list[int], hashes: list[str], decoder_start: int | None = None,
              prompt_len: int | None = None, resumed: bool = False,
              image_spans: list[tuple[int, int]] | None = None) -> Hit:
        """Find the longest cached prefix of ``tokens`` (hashes of its full blocks given) that the engine can
        resume from, and take its pages (shared device pages, or pages loaded from disk into new device pages).
        Returns a Hit with ``cached=0`` on a miss. Never raises for a bad cache: unreadable pages are misses.

        ``decoder_start``: the first position the CED decoder runs over (default: the layer plan's
        :meth:`~deepseek_v41.plan.LayerPlan.decoder_start` of ``len(tokens)``, a new request). The decoder's
        inputs of [decoder_start, start) must come from the snapshot's residuals, so a hit never starts after
        ``decoder_start`` unless its snapshot holds them (a resumed, preempted sequence has generated far past its
        prompt, and its decoder start lies far behind its last page).
        ``prompt_len``: the prompt's length (default ``len(tokens)``): the boundary of the prompt's snapshot, tried
        when the longest usable boundary has none. ``resumed``: a preempted sequence coming back; without a
        snapshot it replays exactly (``replay="exact"``'s start) whatever ``replay`` says, so that preemption
        never changes what a sequence computes. ``image_spans``: the prompt's image spans [s, e): a hit never
        ends strictly inside one (:func:`span_safe_pages`; the replay start of a hit may).
        """
        blocks = self.cache.blocks
        self._transfer = [0, 0, 0.0]
        n = len(tokens)
        D = self.cache.plan.decoder_start(n) if decoder_start is None else decoder_start
        N = n if prompt_len is None else prompt_len
        limit = min(len(hashes), (n - 1) // self.block_size)
        pages: list[int] = []
        device: list[bool] = []  # per page: found on the device (else read from disk)
        for i in range(limit):
            page = blocks.lookup(hashes[i])
            device.append(page is not None)
            if page is not None:
                blocks.share(page)
            else:
                page = self._from_disk(hashes[i])
                if page is None:
                    device.pop()
                    break
            pages.append(page)
        keep = span_safe_pages(len(pages), self.block_size, image_spans)
        if keep < len(pages):
            blocks.release(pages[keep:])
            del pages[keep:], device[keep:]
        if not pages:
            return Hit(0, 0, [], None)
        for j in self._snapshot_boundaries(len(pages), D, N):
            if span_safe_pages(j, self.block_size, image_spans) != j:
                continue  # the prompt's boundary inside an image span: not a place to resume
            snapshot = self.swa_pool.get(self.snapshot_key(hashes[j - 1]))
            if snapshot is None or not self._resumable(snapshot, j * self.block_size, D):
                continue
            blocks.release(pages[j:])
            self.counters["snapshots_hit"] += 1
            self.counters["device_pages_hit"] += sum(device[:j])
            return Hit(j * self.block_size, j * self.block_size, pages[:j], snapshot, *self._transfer)
        if self.exact_prefill:
            blocks.release(pages)  # exact prefill needs every layer's windows: without a snapshot, a miss
            return Hit(0, 0, [], None)
        self.counters["device_pages_hit"] += sum(device)
        cached = len(pages) * self.block_size
        if self.replay == "bounded" and not resumed:
            start = min(max(0, cached - self.window), D)  # (a new request's replay start is always <= D)
        else:
            start = max(0, min(cached, D) - self.receptive_field)
        return Hit(cached, start, pages, None, *self._transfer)

    def _snapshot_boundaries(self, matched: int, decoder_start: int, prompt_len: int) -> list[int]:
        """Page counts whose snapshot a hit of ``matched`` pages may resume from, best first: the longest whose
        window starts at or before the decoder start (CED; any in exact prefill), then the prompt's boundary."""
        if self.swa_pool is None:
            return []
        P = self.block_size
        best = matched if self.exact_prefill else min(matched, (decoder_start + self.window) // P)
        prompt = min(matched, prompt_len // P)
        return [j for j in dict.fromkeys((best, prompt)) if j > 0]

    def _resumable(self, snapshot: dict[str, torch.Tensor], boundary: int, decoder_start: int) -> bool:
        """Whether the decoder can resume at ``boundary`` from ``snapshot``: its inputs of [decoder_start,
        boundary) must be the snapshot's residuals (CED; exact prefill restores every layer's rows)."""
        if self.exact_prefill or boundary <= decoder_start:
            return True
        return (self.cache.residuals and "residual_streams" in snapshot
                and int(snapshot["positions"][0]) <= decoder_start)

    def _from_disk(self, block_hash: str) -> int | None:
        """Load the page of ``block_hash`` into a new device page from the disk store, else from Redis (then it is
        also written to the disk store); None on a miss or without a free device page."""
        store, remote = self.page_store, self.remote_pages
        connector = self.connector if self.connector_read else None
        if (store is None and remote is None and connector is None) or not self.cache.blocks.free:
            return None
        tensors = None
        if store is not None:
            with self._store_lock:
                tensors = store.get(block_hash)
            self.counters["disk_pages_read"] += tensors is not None
        if tensors is None and remote is not None:
            tensors = remote.get(block_hash)
            if tensors is not None:
                self.counters["remote_pages_read"] += 1
                if store is not None:
                    self._writes.put((block_hash, tensors, False, False))
        if tensors is None and connector is not None:
            started = time.perf_counter()
            tensors = connector.get(block_hash)
            if tensors is not None:
                seconds = time.perf_counter() - started
                self._transfer[0] += 1
                self._transfer[1] += self.page_payload_bytes
                self._transfer[2] += seconds
                self.counters["connector_pages_read"] += 1
                self.counters["connector_read_seconds"] += seconds
        if tensors is None:
            return None
        page = self.cache.blocks.allocate()
        self.cache.write_page(page, tensors)
        self.cache.blocks.register(page, block_hash)
        return page

    def read_stats(self) -> dict[str, dict[str, float]]:
        """``{"read_bytes": {tier: bytes}, "read_seconds": {tier: seconds}}`` over ``READ_TIERS``: what the stores
        returned on hits (page files and Redis values as stored, snapshots as tensor bytes) and the seconds their
        reads took (read + decode, or the copy out of the host pool), so that bytes / seconds is a tier's read
        bandwidth. A store used in two roles (Redis as pages and pool) counts once; absent tiers are 0."""
        read_bytes = dict.fromkeys(READ_TIERS, 0)
        read_seconds = dict.fromkeys(READ_TIERS, 0.0)
        # A connector names its tier itself (shared storage is "remote", not this server's disk); Redis pages count
        # in their store's.
        connector = self.connector if hasattr(self.connector, "read_tier") else getattr(self.connector, "store", None)
        stores = (self.page_store, self.swa_pool, getattr(self.remote_pages, "store", None), connector)
        for store in {id(s): s for s in stores if s is not None}.values():
            tier = getattr(store, "read_tier", None)
            if tier in read_bytes:
                stats = store.stats
                read_bytes[tier] += stats.get("read_bytes", 0)
                read_seconds[tier] += stats.get("read_seconds", 0.0)
        return {"read_bytes": read_bytes, "read_seconds": read_seconds}

    # ------------------------------------------------------------------ writes
    def register(self, table: list[int], hashes: list[str], first: int, upto: int) -> None:
        """Record the full pages ``first .. upto - 1`` of a sequence (device index; disk and Redis when
        configured, written by the page-writer thread)."""
        for i in range(first, upto):
            page = table[i]
            self.cache.blocks.register(page, hashes[i])
            if self._writer is not None:
                self._writes.put((hashes[i], self.cache.read_page(page), True, self.connector_write))

    def _write(self, block_hash: str, tensors: dict[str, torch.Tensor], to_remote: bool, to_connector: bool) -> None:
        """Write one page to the disk store, (``to_remote``) queue it for Redis and (``to_connector``) put it in
        the KV connector; on the page-writer thread."""
        if self.page_store is not None:
            with self._store_lock:
                # Count files written, not pages found already stored (after a restart, or by another
                # process): the same figure as the store's own pages_written.
                before = self.page_store.stats["pages_written"]
                self.page_store.put(block_hash, tensors)
                self.counters["disk_pages_written"] += self.page_store.stats["pages_written"] - before
        if to_remote and self.remote_pages is not None:
            self.remote_pages.put(block_hash, tensors)
        if to_connector and self.connector is not None:
            started = time.perf_counter()
            self.counters["connector_pages_written"] += bool(self.connector.put(block_hash, tensors))
            self.counters["connector_write_seconds"] += time.perf_counter() - started

    def flush(self) -> None:
        """Wait until every page queued for the persistent store is written, and (a bounded wait) until the pages
        and snapshots queued for Redis are sent."""
        self._writes.join()
        if self.connector_write:
            self.connector.flush()
        stores = (getattr(self.remote_pages, "store", None), self.swa_pool)
        for store in {id(s): s for s in stores if hasattr(s, "flush")}.values():
            store.flush()

    def take_snapshot(self, slot: int, boundary: int, hashes: list[str]) -> bool:
        """Copy the window rows (and decoder inputs) of [boundary - w, boundary) of slot ``slot`` into the SWA
        pool under the chain hash of ``boundary``; False when there is no pool or nothing to take."""
        if self.swa_pool is None or boundary <= 0 or boundary // self.block_size > len(hashes):
            return False
        key = self.snapshot_key(hashes[boundary // self.block_size - 1])
        if self.swa_pool.contains(key):
            return False
        snapshot = self.cache.snapshot(slot, boundary, self.snapshot_layers)
        if snapshot is None or not self.swa_pool.put(key, snapshot):
            return False
        self.counters["snapshots_written"] += 1
        return True

    def drop_device_tier(self) -> None:
        """Forget which free device pages hold which prefix (as if they had all been reused): later hits come
        from the persistent store. Pages in use are not touched."""
        blocks = self.cache.blocks
        for page in [p for p in blocks.page_hash if blocks.ref_count[p] == 0]:
            del blocks.hash_page[blocks.page_hash.pop(page)]

    def reset(self) -> bool:
        """Forget this process's cached prefixes (``LLMEngine.reset_prefix_cache``): the device index and the
        snapshots of the in-memory SWA pool. Only when no device page is in use (no sequence holds a page): then
        every page is free and loses its prefix hash, and True is returned; otherwise nothing changes and False is
        returned (a running sequence's pages and its registered hashes must stay consistent).

        The persistent tiers are not touched: the disk pages under ``cache_dir`` and Redis (pages, and snapshots
        when Redis is the SWA pool) are keyed by the model fingerprint taken when the engine was built, and other
        processes serving the same checkpoint may share them. After changing the weights in place, an engine with
        those tiers would read them again: use a new engine (or a new ``cache_dir`` / Redis database)."""
        blocks = self.cache.blocks
        if blocks.num_used:
            return False
        self.drop_device_tier()
        if isinstance(self.swa_pool, SwaPool):  # the in-memory pool (a Redis pool is a persistent tier)
            self.swa_pool.clear()
        return True

    def restore(self, slot: int, hit: Hit) -> None:
        """Put a hit's snapshot into the sequence's slot."""
        if hit.snapshot is not None:
            self.cache.restore(slot, hit.snapshot, self.snapshot_layers)


def stop_thread(stop: Any, thread: threading.Thread, timeout: float = 10.0) -> None:
    """Ask a background writer thread to end (``stop()``) and wait for it, at most ``timeout`` seconds, unless
    called on that thread itself (the last reference to its owner dropped there). Run by ``weakref.finalize``
    when the owner is collected and at interpreter exit, so that no writer thread is still running while the
    interpreter finalizes: one that was (woken by its stop job, or finishing a write) made the process abort at
    exit ("terminate called without an active exception", exit status 134) after a clean run."""
    stop()
    if thread is not threading.current_thread() and thread.is_alive():
        thread.join(timeout)


def _page_writer(ref: weakref.ref, writes: queue.Queue) -> None:
    """The page-writer thread: holds the prefix cache only while it writes, so a dropped engine is collected (a
    None job, queued when it is, ends the thread)."""
    while True:
        job = writes.get()
        try:
            cache = ref() if job is not None else None
            if cache is None:
                return
            cache._write(*job)
        except Exception:  # noqa: BLE001 - a failed write is a cache miss later, never a crash of the engine
            log.exception("writing prefix-cache page %s failed", job[0])
        finally:
            cache = None
            writes.task_done()
