"""A sequence's block table: its page ids as a Python list, with the tensor a forward reads kept alongside
(vLLM's persistent block table).

Each forward's :class:`~deepseek_v41.cache.paged_context.PagedContext` needs every row's table as an int64
tensor padded with the null page. Building it from the list each step costs time in proportion to the context
(a 16K-token sequence has 1,024 pages of 16 tokens: ~30 µs per decode step). A :class:`BlockTable` keeps that
tensor and brings it up to date from the list when read: appended pages are copied in, any other change of the
list through its methods or operators rewrites it, so the tensor always equals the list. (C functions that write
a list's items directly, such as ``heapq``'s, bypass those methods; nothing does that to a block table.)
"""

from __future__ import annotations

import torch

from deepseek_v41.cache.block_manager import BlockManager


class BlockTable(list):
    """Page ids (``list[int]``) of one sequence, position block ``i`` in page ``self[i]``, plus a padded int64
    tensor copy (:meth:`padded`). Every list operation works as on a list; appending keeps the tensor's prefix,
    other changes resync it on the next read."""

    __slots__ = ("_buffer", "_synced", "_written")

    def __init__(self, pages=()):
        super().__init__(pages)
        self._buffer: torch.Tensor | None = None  # int64 [capacity]; the null page from _written on
        self._synced = 0  # leading entries of _buffer equal to the list's
        self._written = 0  # entries of _buffer that may differ from the null page

    def padded(self, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The pages as int64 [width] on ``device``, the null page after the last one: a view of the kept tensor,
        valid until the table changes (:class:`~deepseek_v41.cache.paged_context.PagedContext` stacks the rows'
        views into a tensor of its own). Raises ValueError when ``width`` is below the number of pages."""
        n = len(self)
        if width < n:
            raise ValueError(f"width {width} is below the table's {n} pages")
        buffer = self._buffer
        device = torch.device(device)
        if (buffer is None or buffer.numel() < width or buffer.device.type != device.type
                or (device.index is not None and buffer.device.index != device.index)):  # "cuda" matches cuda:0
            capacity = max(width, 2 * (buffer.numel() if buffer is not None else 0), 64)
            self._buffer = buffer = torch.full((capacity,), BlockManager.NULL_PAGE, dtype=torch.int64,
                                               device=device)
            self._synced = self._written = 0
        if self._synced < n:
            buffer[self._synced:n] = torch.tensor(self[self._synced:n], dtype=torch.int64, device=buffer.device)
        if self._written > n:
            buffer[n:self._written] = BlockManager.NULL_PAGE
        self._synced = self._written = n
        return buffer[:width]

    # Every list operation that changes an existing entry or removes one makes the kept tensor resync (appending:
    # append, extend, += keep its synced prefix).
    def _changed(self) -> None:
        self._synced = 0

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._changed()

    def __imul__(self, n):
        result = super().__imul__(n)
        self._changed()
        return result

    def insert(self, index, value):
        super().insert(index, value)
        self._changed()

    def pop(self, index=-1):
        value = super().pop(index)
        self._changed()
        return value

    def remove(self, value):
        super().remove(value)
        self._changed()

    def clear(self):
        super().clear()
        self._changed()

    def sort(self, *args, **kwargs):
        super().sort(*args, **kwargs)
        self._changed()

    def reverse(self):
        super().reverse()
        self._changed()

    def __copy__(self) -> BlockTable:
        return BlockTable(self)

    def __deepcopy__(self, memo) -> BlockTable:
        return BlockTable(self)

    def __reduce__(self):
        return BlockTable, (list(self),)
