"""Page allocation, block tables and the device tier of the prefix cache (SPEC.md §4.1, §4.3). Never touches
a tensor.

A page holds the global KV of ``block_size`` consecutive token positions of one sequence, for every kv-source
layer at once (a ratio-m layer keeps ``block_size / m`` entries per page). Page 0 is reserved: padded block-table
slots and writes of "no entry" point there, so the model's scatter and gather never need a data-dependent mask.

Pages are reference counted so that sequences with a common prefix share them. A full page can carry the hash
of its prefix (:mod:`deepseek_v41.cache.prefix_cache`): when its last reference goes, it stays in the free list
with its contents and its hash, so a later request with the same prefix can take it back; allocation reuses the
least recently freed page first, evicting its hash (vLLM's prefix caching).
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfPages(RuntimeError):
    """No free page is left (the scheduler preempts a sequence and retries)."""


class BlockManager:
    """Free list (LRU), reference counts and prefix hashes of ``num_pages`` pages of ``block_size`` tokens."""

    NULL_PAGE = 0

    def __init__(self, num_pages: int, block_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.block_size = block_size
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        self.ref_count = [0] * num_pages
        self.page_hash: dict[int, str] = {}
        self.hash_page: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self.free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def allocate(self) -> int:
        """One free page with reference count 1 (the least recently freed; its old prefix hash is evicted).
        Raises OutOfPages when none is free."""
        if not self.free:
            raise OutOfPages("no free KV page")
        page, _ = self.free.popitem(last=False)
        old = self.page_hash.pop(page, None)
        if old is not None:
            del self.hash_page[old]
        self.ref_count[page] = 1
        return page

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append pages to ``table`` until it covers ``num_tokens`` positions (all or nothing).

        Raises OutOfPages, leaving ``table`` unchanged, when there are not enough free pages.
        """
        need = self.pages_for(num_tokens) - len(table)
        if need > len(self.free):
            raise OutOfPages(f"need {need} pages, {len(self.free)} free")
        for _ in range(need):
            table.append(self.allocate())

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(table) <= len(self.free)

    def share(self, page: int) -> None:
        """Add a reference to a page; a free page with cached contents comes back out of the free list."""
        if self.ref_count[page] == 0:
            if page not in self.free:
                raise ValueError(f"page {page} is neither allocated nor free")
            del self.free[page]
        self.ref_count[page] += 1

    def release(self, table: list[int]) -> None:
        """Drop one reference to every page of ``table`` and empty it; pages reaching 0 go to the back of the
        free list (keeping their contents and prefix hash until reallocated)."""
        for page in table:
            self.ref_count[page] -= 1
            if self.ref_count[page] == 0:
                self.free[page] = None
            elif self.ref_count[page] < 0:
                raise RuntimeError(f"page {page} released more often than allocated")
        table.clear()

    # ------------------------------------------------------------------ prefix hashes (device tier)
    def register(self, page: int, block_hash: str) -> None:
        """Mark a full page as holding the prefix ``block_hash`` (first writer wins)."""
        if block_hash in self.hash_page or page in self.page_hash:
            return
        self.hash_page[block_hash] = page
        self.page_hash[page] = block_hash

    def lookup(self, block_hash: str) -> int | None:
        """The page holding ``block_hash`` (allocated or free-but-cached), or None."""
        return self.hash_page.get(block_hash)
