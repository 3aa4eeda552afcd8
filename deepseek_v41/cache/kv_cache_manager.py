"""The KV cache manager: one engine's pages, sequence slots, prefix hashes, lookup, page registration and SWA
snapshots (SPEC.md §4.1, §4.3; vLLM v1's ``KVCacheManager``, nano-vllm's ``BlockManager``).

The scheduler owns it and calls it whenever a sequence's cache state changes:

- :meth:`KVCacheManager.admit` when a waiting sequence is admitted: a slot, the salted chain hashes of its full
  blocks and the prefix-cache lookup. A hit takes the cached pages, restores the SWA snapshot, moves
  ``num_computed`` / ``write_from`` to the hit's start and marks the sequence's Engram history for the model runner
  to rebuild (``Sequence.rebuild_engram_history``);
- ``blocks.grow`` / ``blocks.can_grow`` (:class:`~deepseek_v41.cache.block_manager.BlockManager`): pages for the
  positions a step writes;
- :meth:`KVCacheManager.on_computed` after a forward: registers the newly completed pages and takes the prompt's
  snapshot;
- :meth:`KVCacheManager.free` on preemption, finish (with the finished sequence's snapshot) or abort.

It never runs the model: whatever a hit leaves to recompute (replayed window state, the Engram history) is
computed by the model runner at the sequence's next prefill chunk. :func:`build_kv_cache_manager` sizes the pool
and builds the prefix cache's tiers from :class:`CacheConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepseek_v41.cache.fingerprint import model_fingerprint
from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.cache.prefix_cache import PrefixCache, chain_hashes, image_block_keys, span_safe_pages
from deepseek_v41.cache.redis_store import RedisPages, RedisStore
from deepseek_v41.cache.store import PageCodec, PageStore
from deepseek_v41.cache.swa_pool import SwaPool, default_swa_pool_bytes
from deepseek_v41.disagg.connector import build_kv_connector

DEFAULT_KV_POOL_BYTES = 1 << 30  # the default KV pool's cap, unless one sequence of max_model_len needs more


@dataclass
class CacheConfig:
    """The cache settings of an engine (vLLM's ``CacheConfig``; the fields are ``EngineArgs``' of the same names,
    documented there): pool size, slots, window slack and the prefix cache's tiers."""

    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 64
    num_kv_pages: int | None = None
    kv_cache_memory_bytes: int | None = None
    window_slack_rows: int = 16
    enable_prefix_caching: bool = True
    cache_dir: str | None = None
    cache_max_bytes: int = 16 * 1024**3
    swa_pool_bytes: int | None = None
    replay: str = "bounded"
    redis_url: str | None = None
    kv_transfer_config: Any = None  # a deepseek_v41.disagg.config.KVTransferConfig (issue 29) or None


class KVCacheManager:
    """Pages, slots and the prefix cache of one engine (see the module docstring).

    ``cache``: the engine's :class:`~deepseek_v41.cache.kv_cache.PagedKVCache` (its ``blocks`` is the page
    allocator); ``prefix_cache``: a :class:`~deepseek_v41.cache.prefix_cache.PrefixCache` or None (no prefix
    caching: admission takes a slot only, nothing is registered or snapshotted).
    """

    def __init__(self, cache: PagedKVCache, prefix_cache: PrefixCache | None = None):
        self.cache = cache
        self.blocks = cache.blocks
        self.block_size = cache.block_size
        self.prefix_cache = prefix_cache

    @property
    def capacity_tokens(self) -> int:
        """Token positions the whole pool holds (the reserved null page excluded)."""
        return (self.cache.num_pages - 1) * self.block_size

    @property
    def has_free_slot(self) -> bool:
        return bool(self.cache.free_slots)

    # ------------------------------------------------------------------ sequence lifecycle
    def admit(self, seq, prefill_end: int) -> None:
        """Give a newly admitted (or preempted and returning) sequence a slot, hash its full blocks of positions
        [0, prefill_end) with its ``cache_salt`` (and the content hashes of the images in each block) and look its
        prefix up (SPEC.md §4.3); a hit never ends inside an image span.

        On a hit the sequence holds the cached pages, its window state is restored from the snapshot (or left to
        replay from the hit's start), ``num_computed`` = the hit's start, ``write_from`` = L' (the cached
        length), and ``rebuild_engram_history`` is set: the model runner rebuilds the Engram history from the
        tokens before the start at the next prefill chunk. A preempted sequence resumes where its decoder can be
        rebuilt exactly and keeps the cached / replayed counts of its first admission. Raises RuntimeError when no
        slot is free (the scheduler checks :attr:`has_free_slot` first)."""
        seq.slot = self.cache.acquire_slot()
        pc = self.prefix_cache
        if pc is None:
            return
        tokens = seq.token_at(0, prefill_end)
        seq.block_hashes = chain_hashes(pc.root(seq.cache_salt), tokens, self.block_size, seq.block_hashes,
                                        self._extra_keys(seq))
        hit = pc.match(tokens, seq.block_hashes, seq.decoder_start, len(seq.prompt_token_ids),
                       resumed=bool(seq.output_token_ids), image_spans=seq.image_spans)
        if hit.cached == 0:
            return
        seq.block_table[:] = hit.pages
        seq.registered_pages = len(hit.pages)
        seq.num_computed, seq.write_from = hit.start, hit.cached
        if seq.num_cached_tokens == 0:  # a preempted sequence keeps what its first admission reported
            seq.num_cached_tokens, seq.num_replayed_tokens = hit.cached, hit.replayed
            seq.kv_transfer = (hit.transfer_pages, hit.transfer_bytes, hit.transfer_seconds)
        pc.counters["cached_tokens"] += hit.cached
        pc.counters["replayed_tokens"] += hit.replayed
        pc.restore(seq.slot, hit)
        seq.rebuild_engram_history = True

    def on_computed(self, seq, prompt_done: bool) -> None:
        """After a forward moved ``seq.num_computed``: register its newly completed full pages (device index;
        disk / Redis through the page writer) and, once its prompt is done, snapshot the window at the prompt's
        last page boundary (once per sequence)."""
        pc = self.prefix_cache
        if pc is None:
            return
        P = self.block_size
        full = seq.num_computed // P
        if full > seq.registered_pages:
            seq.block_hashes = chain_hashes(pc.root(seq.cache_salt), seq.token_at(0, full * P), P, seq.block_hashes,
                                            self._extra_keys(seq))
            pc.register(seq.block_table, seq.block_hashes, seq.registered_pages, full)
            seq.registered_pages = full
        if prompt_done and not seq.prompt_snapshot_taken:
            seq.prompt_snapshot_taken = True
            pages = len(seq.prompt_token_ids) // P
            if span_safe_pages(pages, P, seq.image_spans) == pages:  # no hit ever resumes inside an image span
                pc.take_snapshot(seq.slot, P * pages, seq.block_hashes)

    def _extra_keys(self, seq) -> dict[int, list[str]] | None:
        """The image content hashes of ``seq``'s blocks (:func:`~deepseek_v41.cache.prefix_cache.image_block_keys`;
        None for a text prompt)."""
        mm = getattr(seq, "mm_inputs", None)
        if mm is None:
            return None
        return image_block_keys([(item.offset, item.length, item.hash) for item in mm.images], self.block_size)

    def free(self, seq, snapshot: bool = False) -> None:
        """Return ``seq``'s pages (they keep their contents and hashes until reused) and slot. ``snapshot``: a
        sequence that finished; its window at its last page boundary goes to the SWA pool first (SPEC.md §4.3
        policy)."""
        if snapshot and self.prefix_cache is not None and seq.slot is not None:
            P = self.block_size
            pages = seq.num_computed // P
            if span_safe_pages(pages, P, seq.image_spans) == pages:
                self.prefix_cache.take_snapshot(seq.slot, P * pages, seq.block_hashes)
        self.blocks.release(seq.block_table)
        seq.registered_pages = 0
        seq.rebuild_engram_history = False
        if seq.slot is not None:
            self.cache.release_slot(seq.slot)
            seq.slot = None

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes of this process (:meth:`PrefixCache.reset`); True when done (also without
        prefix caching: nothing to forget), False while a sequence holds device pages."""
        return True if self.prefix_cache is None else self.prefix_cache.reset()

    def flush(self) -> None:
        """Wait for the pages (and snapshots) queued for the persistent tiers to be written."""
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Pool and window sizes (``kv_*``, ``window_bytes_per_sequence_*``) and, with prefix caching, the
        ``prefix_cache`` counters: hits, pages read / written per tier, snapshots, cached and replayed tokens,
        read bytes and seconds per tier, the SWA pool's occupancy and each store's own counters."""
        cache = self.cache
        out: dict[str, Any] = {
            "kv_pages_total": cache.num_pages - 1,
            "kv_pages_used": cache.blocks.num_used,
            "kv_allocated_bytes_per_token": cache.allocated_bytes_per_token,
            "kv_global_bytes": cache.global_bytes,
            "window_bytes_per_sequence_logical": cache.window_bytes_per_slot_logical,
            "window_bytes_per_sequence_allocated": cache.window_bytes_per_slot_allocated,
        }
        pc = self.prefix_cache
        if pc is not None:
            prefix: dict[str, Any] = {**pc.counters, **pc.read_stats()}
            if pc.swa_pool is not None:
                prefix["swa_pool_occupancy_bytes"] = pc.swa_pool.occupancy_bytes
                prefix["swa_pool"] = dict(pc.swa_pool.stats)
            if pc.page_store is not None:
                prefix["disk"] = dict(pc.page_store.stats)
            if pc.remote_pages is not None:
                prefix["remote"] = dict(pc.remote_pages.stats)
            out["prefix_cache"] = prefix
        return out


# ---------------------------------------------------------------------- construction
def build_kv_cache_manager(model, settings: CacheConfig, exact_prefill: bool, draft_layers: int = 0,
                           model_path: str | Path | None = None) -> KVCacheManager:
    """The KV cache manager of an engine serving ``model`` (any module with ``config`` and parameters; its first
    parameter's device and dtype place the cache): the pool sized by :func:`num_kv_pages`, residual rings for
    the CED decoder's inputs when SWA snapshots are on and the prefill is CED (``exact_prefill`` False), rings
    for ``draft_layers`` DSpark draft layers, and with ``enable_prefix_caching`` the prefix cache's tiers.

    Raises ValueError for a pool that cannot hold one sequence of ``max_model_len`` tokens, a negative
    ``swa_pool_bytes``, a ``replay`` other than "bounded" / "exact", SWA snapshots with ``window_slack_rows <
    block_size - 1``, and whatever :class:`~deepseek_v41.cache.kv_cache.PagedKVCache` refuses.
    """
    cfg = model.config
    weight = next(model.parameters())
    num_pages = num_kv_pages(cfg, settings)
    if settings.swa_pool_bytes is not None and settings.swa_pool_bytes < 0:
        raise ValueError(f"swa_pool_bytes must be >= 0 (0 disables the SWA pool), got {settings.swa_pool_bytes}")
    swa_bytes = default_swa_pool_bytes() if settings.swa_pool_bytes is None else settings.swa_pool_bytes
    state_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    # The CED decoder's inputs go into SWA snapshots whenever there is a snapshot pool (in memory, or in Redis
    # with --redis-url); swa_pool_bytes=0 means no snapshots in either, so no residual ring.
    snapshots = settings.enable_prefix_caching and bool(swa_bytes)
    residuals = weight.dtype if snapshots and not exact_prefill else None
    cache = PagedKVCache(cfg, num_pages, settings.block_size, settings.max_num_seqs, settings.window_slack_rows,
                         weight.device, state_dtype, residuals, draft_layers)
    prefix = (_prefix_cache(model, cache, settings, swa_bytes, exact_prefill, model_path)
              if settings.enable_prefix_caching else None)
    return KVCacheManager(cache, prefix)


def num_kv_pages(cfg, settings: CacheConfig) -> int:
    """Pages of the global KV pool, the reserved null page included.

    Raises ValueError when an explicitly sized pool (``num_kv_pages`` or ``kv_cache_memory_bytes``) cannot
    hold one sequence of ``max_model_len`` tokens: such a pool would cut every long output short (vLLM
    refuses it at start too). The default pool holds ``max_num_seqs`` such sequences, capped at
    ``DEFAULT_KV_POOL_BYTES`` (1 GiB) but never below one sequence.
    """
    P = settings.block_size
    needed = -(-settings.max_model_len // P)  # pages of one sequence of max_model_len tokens
    page_bytes = max(1, PagedKVCache(cfg, 2, P, 1, 0, "meta").global_bytes // 2)
    wanted = settings.max_num_seqs * needed
    if settings.num_kv_pages is not None:
        pages, given = settings.num_kv_pages, f"num_kv_pages={settings.num_kv_pages}"
    elif settings.kv_cache_memory_bytes is not None:
        pages = max(0, min(wanted, settings.kv_cache_memory_bytes // page_bytes))
        given = f"kv_cache_memory_bytes={settings.kv_cache_memory_bytes}: {pages} pages of {page_bytes} bytes"
    else:
        # At most DEFAULT_KV_POOL_BYTES, but never less than one sequence of max_model_len tokens.
        return max(needed, min(wanted, DEFAULT_KV_POOL_BYTES // page_bytes)) + 1  # + the reserved null page
    if pages < needed:
        tokens = max(0, pages) * P
        smaller = f" or set max_model_len <= {tokens}" if tokens >= 2 else ""
        raise ValueError(f"the KV pool ({given}, {tokens} tokens) cannot hold one sequence of "
                         f"max_model_len={settings.max_model_len} tokens: that needs {needed} pages of {P} tokens "
                         f"(num_kv_pages >= {needed} or kv_cache_memory_bytes >= {needed * page_bytes}); "
                         f"raise the pool{smaller}")
    return pages + 1  # + the reserved null page


def _prefix_cache(model, cache: PagedKVCache, settings: CacheConfig, swa_bytes: int, exact_prefill: bool,
                  model_path: str | Path | None) -> PrefixCache:
    """The prefix cache over ``cache`` with its tiers: the SWA pool (host memory, or Redis with ``redis_url``;
    none with ``swa_bytes`` 0), the disk page store under ``cache_dir`` and Redis pages."""
    if settings.replay not in ("bounded", "exact"):
        raise ValueError(f"replay must be 'bounded' or 'exact', got {settings.replay!r}")
    if swa_bytes and settings.window_slack_rows < settings.block_size - 1:
        raise ValueError(f"SWA snapshots need window_slack_rows >= block_size - 1 ({settings.block_size - 1}), "
                         f"got {settings.window_slack_rows}: the rings must still hold the window before the last "
                         f"page boundary (or set swa_pool_bytes=0)")
    fingerprint = model_fingerprint(model, model_path)
    page_store = swa_pool = remote_pages = connector = None
    transfer = settings.kv_transfer_config
    if transfer is not None:
        connector = build_kv_connector(transfer, fingerprint, cache.page_layout())
    # A prefill server's persistent tier is its connector: it writes each page there once (not a second time to a
    # disk store of its own, which its response would wait for too) and finds its own earlier pages there.
    producer = transfer is not None and transfer.prefill_only
    if settings.cache_dir is not None and not producer:
        page_store = PageStore(Path(settings.cache_dir).expanduser() / fingerprint[:16], fingerprint,
                               cache.page_layout(), settings.cache_max_bytes)
    if settings.redis_url is not None:
        # Redis shares the pages (any cache_dir, or none) and, unless swa_pool_bytes=0, the SWA snapshots.
        redis_store = RedisStore(settings.redis_url, namespace=fingerprint[:32])
        remote_pages = RedisPages(redis_store, PageCodec(fingerprint, cache.page_layout()))
        swa_pool = redis_store if swa_bytes else None
    elif swa_bytes:
        swa_pool = SwaPool(swa_bytes)
    return PrefixCache(cache, fingerprint, exact_prefill, settings.replay, page_store, swa_pool, remote_pages,
                       connector, connector_read=transfer is not None and (transfer.is_consumer or producer),
                       connector_write=transfer is not None and transfer.is_producer)
