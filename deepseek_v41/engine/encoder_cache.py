"""The vision encode stage and its cache (vLLM's encoder cache; VISION_DESIGN.md decision 5).

An image reaches the language model as the aligner's rows [n_llm_h * n_llm_w, hidden_size] (MODEL_REFERENCE.md
§3.18), which depend only on the preprocessed image and the vision weights. :class:`EncoderCache` keeps them by
the image's content hash (:attr:`~deepseek_v41.engine.multimodal.ImageItem.hash`, the same for the same pixels in
any request or process), least recently used first out within a byte budget, so that an image seen again — in
another request, a second sample, a replay after a prefix-cache hit or a preempted sequence coming back — is not
encoded again.

:class:`VisionEncoder` is the encode stage with its own queue: before an engine step runs its prefill chunks,
the engine asks it for the images those chunks hold (:meth:`VisionEncoder.request`); the cached ones are taken
from the cache, the others are queued and :meth:`VisionEncoder.run` encodes all of them in one call (images of
the same patch grid in one batch). The stage holds no engine state: it takes preprocessed images and their hashes
and gives rows back, so it can later move to a process of its own (encode / prefill / decode disaggregation).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from deepseek_v41.model.image_processor import ProcessedImage


class EncoderCache:
    """Aligner rows by image content hash, LRU within ``capacity_bytes`` (0: nothing is kept).

    Counters: ``hits`` (lookups answered from the cache), ``misses`` (lookups that were not), ``evictions``
    (entries dropped to make room), ``encoded_images`` (images encoded by the stage that owns this cache).
    Raises ValueError for a negative capacity.
    """

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"the encoder cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes_used = 0
        self.hits = self.misses = self.evictions = self.encoded_images = 0

    def __contains__(self, image_hash: str) -> bool:
        return image_hash in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, image_hash: str) -> torch.Tensor | None:
        """The rows of ``image_hash`` (made the most recently used), or None; counts a hit or a miss."""
        rows = self._rows.get(image_hash)
        if rows is None:
            self.misses += 1
            return None
        self._rows.move_to_end(image_hash)
        self.hits += 1
        return rows

    def put(self, image_hash: str, rows: torch.Tensor) -> bool:
        """Keep ``rows`` under ``image_hash``, evicting the least recently used entries as needed; False (nothing
        stored or evicted) when the rows alone exceed the capacity."""
        size = rows.numel() * rows.element_size()
        if size > self.capacity_bytes:
            return False
        old = self._rows.pop(image_hash, None)
        if old is not None:
            self.bytes_used -= old.numel() * old.element_size()
        while self.bytes_used + size > self.capacity_bytes:
            _, dropped = self._rows.popitem(last=False)
            self.bytes_used -= dropped.numel() * dropped.element_size()
            self.evictions += 1
        self._rows[image_hash] = rows
        self.bytes_used += size
        return True

    def clear(self) -> None:
        """Drop every entry (the counters are kept)."""
        self._rows.clear()
        self.bytes_used = 0

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "encoded_images": self.encoded_images, "entries": len(self._rows), "bytes_used": self.bytes_used,
                "capacity_bytes": self.capacity_bytes}


class VisionEncoder:
    """The vision encode stage: a queue of images to encode in front of an :class:`EncoderCache`.

    ``encode(images: list[ProcessedImage]) -> list[Tensor]`` computes the aligner rows [rows_i, D] of each image
    (e.g. :func:`deepseek_v41.model.vision.encode_images` on the model, which batches images of one grid).
    Rows handed out for the current engine step stay held (:attr:`ready`) until :meth:`release`, also when the
    cache is too small to keep them.
    """

    def __init__(self, encode: Callable[[list[ProcessedImage]], Sequence[torch.Tensor]], cache: EncoderCache):
        self.encode = encode
        self.cache = cache
        self.queue: OrderedDict[str, ProcessedImage] = OrderedDict()  # hash -> image, waiting to be encoded
        self.ready: dict[str, torch.Tensor] = {}
        self.encode_seconds = 0.0
        self.encode_calls = 0

    def request(self, items: Iterable[Any]) -> None:
        """Ask for the rows of ``items`` (anything with ``hash`` and ``image``: an
        :class:`~deepseek_v41.engine.multimodal.ImageItem`) for the coming forward. An image already held for this
        step counts nothing; a cached one counts a hit; any other counts a miss and is queued once."""
        for item in items:
            if item.hash in self.ready or item.hash in self.queue:
                continue
            rows = self.cache.get(item.hash)
            if rows is not None:
                self.ready[item.hash] = rows
            else:
                self.queue[item.hash] = item.image

    def run(self) -> int:
        """Encode every queued image in one call (same-grid images batched), keep the rows in the cache and hold
        them for this step. Returns the number of images encoded. Raises what ``encode`` raises (the queue is
        then left as it was)."""
        if not self.queue:
            return 0
        hashes, images = list(self.queue), list(self.queue.values())
        started = time.perf_counter()
        rows = list(self.encode(images))
        self.encode_seconds += time.perf_counter() - started
        self.encode_calls += 1
        if len(rows) != len(images):
            raise RuntimeError(f"the vision encoder returned {len(rows)} results for {len(images)} images")
        self.queue.clear()
        for image_hash, r in zip(hashes, rows, strict=True):
            self.ready[image_hash] = r
            self.cache.put(image_hash, r)
        self.cache.encoded_images += len(images)
        return len(images)

    def rows(self, items: Sequence[Any]) -> list[torch.Tensor]:
        """The rows of ``items`` (in order): requested and encoded now unless already held for this step."""
        missing = [item for item in items if item.hash not in self.ready]
        if missing:
            self.request(missing)
            self.run()
        return [self.ready[item.hash] for item in items]

    def release(self) -> None:
        """End of the engine step: the rows held for it are let go (the cache keeps what fits)."""
        self.ready.clear()

    def stats(self) -> dict[str, Any]:
        """The cache's counters and size, the encode calls and the seconds they took."""
        return {**self.cache.stats(), "encode_calls": self.encode_calls, "encode_seconds": self.encode_seconds}
