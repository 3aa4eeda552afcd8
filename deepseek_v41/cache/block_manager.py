"""Page allocation and block tables (SPEC.md §4.1). Never touches a tensor.

A page holds the global KV of ``block_size`` consecutive token positions of one sequence, for every kv-source
layer at once (a ratio-m layer keeps ``block_size / m`` entries per page). Page 0 is reserved: padded block-table
slots and writes of "no entry" point there, so the model's scatter and gather never need a data-dependent mask.
Pages are reference counted so that prefix caching can share them between sequences.
"""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    """No free page is left (the scheduler preempts a sequence and retries)."""


class BlockManager:
    """Free list and reference counts of ``num_pages`` pages of ``block_size`` tokens (page 0 reserved)."""

    NULL_PAGE = 0

    def __init__(self, num_pages: int, block_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.block_size = block_size
        self.free: deque[int] = deque(range(1, num_pages))
        self.ref_count = [0] * num_pages

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
        """One free page with reference count 1. Raises OutOfPages when none is free."""
        if not self.free:
            raise OutOfPages("no free KV page")
        page = self.free.popleft()
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
        """Add a reference to an allocated page (prefix sharing)."""
        if self.ref_count[page] <= 0:
            raise ValueError(f"page {page} is not allocated")
        self.ref_count[page] += 1

    def release(self, table: list[int]) -> None:
        """Drop one reference to every page of ``table`` and empty it; pages reaching 0 return to the free list."""
        for page in table:
            self.ref_count[page] -= 1
            if self.ref_count[page] == 0:
                self.free.append(page)
            elif self.ref_count[page] < 0:
                raise RuntimeError(f"page {page} released more often than allocated")
        table.clear()
