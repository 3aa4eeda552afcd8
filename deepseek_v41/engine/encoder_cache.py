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
and gives rows back.

Encode / prefill / decode disaggregation (issue 29, ``--ec-transfer-config``): with an EC connector
(deepseek_v41/disagg/ec_connector.py) an ``ec_consumer`` (or ``ec_both``) reads an image's rows from the connector
on an encoder-cache miss before encoding it itself, and an ``ec_producer`` (or ``ec_both``) writes the rows of every
image it encodes; the encode server (deepseek_v41/server/encode_app.py) is an ``ec_producer`` stage without a
language model.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from deepseek_v41.disagg.config import ECTransferConfig
from deepseek_v41.disagg.ec_connector import SharedStorageECConnector, build_ec_connector, ec_fingerprint
from deepseek_v41.model.image_processor import ProcessedImage
from deepseek_v41.model.vision import encode_images


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

    ``ec_connector`` (a :class:`~deepseek_v41.disagg.ec_connector.SharedStorageECConnector`) and ``ec_role`` (one
    of ``"ec_producer"``, ``"ec_consumer"``, ``"ec_both"``; given together or not at all): a consumer looks an
    encoder-cache miss up in the connector before queueing it (rows read are moved to ``device`` when given and
    kept in the cache), a producer writes every image it encodes. Raises ValueError for a role without a
    connector or the reverse, or an unknown role.
    """

    def __init__(self, encode: Callable[[list[ProcessedImage]], Sequence[torch.Tensor]], cache: EncoderCache,
                 ec_connector: SharedStorageECConnector | None = None, ec_role: str | None = None,
                 device: torch.device | str | None = None):
        if (ec_connector is None) != (ec_role is None):
            raise ValueError("a VisionEncoder takes an EC connector and its ec_role together (or neither)")
        if ec_role is not None and ec_role not in ("ec_producer", "ec_consumer", "ec_both"):
            raise ValueError(f"ec_role must be 'ec_producer', 'ec_consumer' or 'ec_both', got {ec_role!r}")
        self.encode = encode
        self.cache = cache
        self.ec_connector, self.ec_role, self.device = ec_connector, ec_role, device
        self.ec_reads = ec_role in ("ec_consumer", "ec_both")
        self.ec_writes = ec_role in ("ec_producer", "ec_both")
        self.queue: OrderedDict[str, ProcessedImage] = OrderedDict()  # hash -> image, waiting to be encoded
        self.ready: dict[str, torch.Tensor] = {}
        self.encode_seconds = 0.0
        self.encode_calls = 0

    def request(self, items: Iterable[Any]) -> None:
        """Ask for the rows of ``items`` (anything with ``hash`` and ``image``: an
        :class:`~deepseek_v41.engine.multimodal.ImageItem`) for the coming forward. An image already held for this
        step counts nothing; a cached one counts a hit; any other counts a miss and, unless a consumer's connector
        has its rows (an EC hit: kept in the cache, not encoded), is queued once."""
        for item in items:
            if item.hash in self.ready or item.hash in self.queue:
                continue
            rows = self.cache.get(item.hash)
            if rows is None and self.ec_reads:
                grid = item.image.grid
                rows = self.ec_connector.get(item.hash, grid.n_llm_h * grid.n_llm_w)
                if rows is not None:
                    rows = rows.to(self.device) if self.device is not None else rows
                    self.cache.put(item.hash, rows)
            if rows is not None:
                self.ready[item.hash] = rows
            else:
                self.queue[item.hash] = item.image

    def run(self) -> int:
        """Encode every queued image in one call (same-grid images batched), keep the rows in the cache (and, for
        a producer, write them to the EC connector) and hold them for this step. Returns the number of images
        encoded. Raises what ``encode`` raises (the queue is then left as it was)."""
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
            if self.ec_writes:
                self.ec_connector.put(image_hash, r)
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
        """The cache's counters and size, the encode calls and the seconds they took; with an EC connector also
        ``ec_transfer``: the role, ``hits`` / ``misses`` (the connector's lookups), ``received_images`` /
        ``received_bytes`` / ``received_seconds`` (files read and decoded for hits), ``sent_images`` /
        ``sent_bytes`` / ``sent_seconds`` (files written), ``rejected`` (bad files quarantined); bytes are file
        bytes, headers included."""
        out = {**self.cache.stats(), "encode_calls": self.encode_calls, "encode_seconds": self.encode_seconds}
        if self.ec_connector is not None:
            ec = self.ec_connector.stats
            out["ec_transfer"] = {
                "role": self.ec_role, "hits": ec["hits"], "misses": ec["misses"],
                "received_images": ec["hits"], "received_bytes": ec["read_bytes"],
                "received_seconds": ec["read_seconds"], "sent_images": ec["images_written"],
                "sent_bytes": ec["written_bytes"], "sent_seconds": ec["write_seconds"], "rejected": ec["rejected"]}
        return out


def build_vision_encoder(model, encoder_cache_size: int | None = None,
                         ec_transfer_config: ECTransferConfig | dict | str | None = None,
                         model_path: str | Path | None = None) -> VisionEncoder | None:
    """The vision encode stage of ``model`` (anything with ``config``, ``vision`` and ``aligner``: the
    ``Transformer`` or a :class:`~deepseek_v41.model.vision.VisionModel`), or None for a text-only model.

    ``encoder_cache_size``: the encoder cache's budget in aligner rows (vLLM's "encoder tokens"; default 16 images
    of ``max_image_tokens``; 0 keeps nothing). ``ec_transfer_config`` (``--ec-transfer-config``; None: no
    transfer): the stage reads and / or writes the rows through the connector of
    :func:`~deepseek_v41.disagg.ec_connector.build_ec_connector`, keyed by
    :func:`~deepseek_v41.disagg.ec_connector.ec_fingerprint` of ``model`` and ``model_path`` (the directory it was
    loaded from; None for a model built in memory; a text-only model has no stage and no transfer). Raises ValueError
    for a negative ``encoder_cache_size`` or a bad ``ec_transfer_config``.
    """
    if ec_transfer_config is not None and not isinstance(ec_transfer_config, ECTransferConfig):
        ec_transfer_config = ECTransferConfig.from_cli(ec_transfer_config)  # checked even for a text-only model
    vision = model.config.vision_config
    if vision is None or getattr(model, "vision", None) is None:
        return None
    size = 16 * vision.max_image_tokens if encoder_cache_size is None else encoder_cache_size
    if size < 0:
        raise ValueError(f"encoder_cache_size must be >= 0 (encoder tokens; 0 keeps nothing), got {size}")
    weight = model.aligner.w2.weight
    cache = EncoderCache(size * model.config.hidden_size * weight.element_size())
    if ec_transfer_config is None:
        return VisionEncoder(functools.partial(encode_images, model), cache)
    connector = build_ec_connector(ec_transfer_config, ec_fingerprint(model, model_path), model.config.hidden_size,
                                   weight.dtype)
    return VisionEncoder(functools.partial(encode_images, model), cache, connector, ec_transfer_config.ec_role,
                         weight.device)
