"""The encoder-cache (EC) transfer: an image's aligner rows moved from an encode server to the prefill side.

An image reaches the language model as its aligner rows [n_llm_h * n_llm_w, hidden_size] (MODEL_REFERENCE.md §3.18),
which depend only on the preprocessed image and the vision weights, and which the encoder cache already keys by the
image's content hash (:func:`deepseek_v41.engine.multimodal.image_hash`). An ``ec_producer`` (the encode server,
deepseek_v41/server/encode_app.py) writes the rows of every image it encodes; an ``ec_consumer`` reads an image's
rows before encoding it itself (:class:`~deepseek_v41.engine.encoder_cache.VisionEncoder`). vLLM's names
(``--ec-transfer-config``, ``ec_producer`` / ``ec_consumer``; ``vllm/distributed/ec_transfer``).

:class:`SharedStorageECConnector` keeps one file per image on a shared directory in the page format of the
persistent prefix cache (deepseek_v41/cache/store.py, SPEC.md §4.3: magic, format version, JSON header with the
fingerprint and the layout, sha256 over header and payload), with its discipline: atomic writes (temp file, fsync,
rename), reads that never follow a symlink nor open what is not a regular file, never read past the exact size,
and a bad file moved to ``quarantine/``. The layout of an image's file is ``{"rows": ((n, hidden_size), dtype)}``:
the reader knows ``n`` from the processed image's grid and demands exactly that layout. So a truncated, corrupt,
other-model (fingerprint), other-dtype or other-shape file is a miss, never used.

The fingerprint (:func:`ec_fingerprint`) names what computes the rows: the load dtype, the vision config, the
LLM width and the vision tower + aligner weights (the content of the files holding them, or the tensors of a model
built in memory). Producer and consumer loading the same directory in the same dtype share rows; anything else
misses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch

from deepseek_v41.cache.fingerprint import file_digests
from deepseek_v41.cache.store import PageCodec, PageStore
from deepseek_v41.disagg.config import ECTransferConfig
from deepseek_v41.model.checkpoint import weight_files
from deepseek_v41.model.vision import checkpoint_name_candidates

EC_FORMAT_VERSION = 1
ROWS = "rows"  # the one tensor of an image's file
# The parameters whose values decide the rows (the delimiter vectors do not: they never reach the aligner).
VISION_PREFIXES = ("vision.", "aligner.")
DEFAULT_MAX_BYTES = 8 * 1024**3


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SharedStorageECConnector:
    """Aligner rows by image content hash, one checksummed file per image under ``directory`` (module docstring).

    Args:
        directory: the shared directory (created when missing); several processes may share it.
        fingerprint: :func:`ec_fingerprint` of the vision weights; a file of another fingerprint is a miss.
        hidden_size: the LLM width D (the rows' width).
        dtype: the rows' dtype (the aligner weights' dtype).
        max_bytes: budget over the files (headers included); least recently used images are deleted beyond it.

    ``get(image_hash, num_rows) -> Tensor [num_rows, D] | None`` (CPU, ``dtype``), ``put(image_hash, rows) -> bool``.
    Never raises on I/O (the store's rule: an unwritable directory turns writes off with one warning); raises
    ValueError for mis-shaped rows given to ``put`` or a bad ``num_rows``. Counters (:attr:`stats`): ``hits``,
    ``misses`` (lookups), ``read_bytes`` / ``read_seconds`` (files read and decoded for hits), ``images_written``
    / ``written_bytes`` / ``write_seconds`` (files this process wrote, headers included; an image already stored
    is only marked recently used and not counted), and the page store's ``rejected`` (quarantined), ``evictions``
    and ``bytes_used``.
    """

    def __init__(self, directory: str | Path, fingerprint: str, hidden_size: int, dtype: torch.dtype,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.hidden_size, self.dtype = int(hidden_size), dtype
        self.store = PageStore(directory, fingerprint, self._layout(0), max_bytes, format_version=EC_FORMAT_VERSION)
        self.directory, self.fingerprint = self.store.directory, fingerprint
        self._codecs: dict[int, PageCodec] = {}
        self._lock = threading.Lock()
        self._counts = dict(hits=0, misses=0, images_written=0, written_bytes=0, write_seconds=0.0)

    def _layout(self, num_rows: int) -> dict:
        return {ROWS: ((num_rows, self.hidden_size), _dtype_name(self.dtype))}

    def _codec(self, num_rows: int) -> PageCodec:
        if not isinstance(num_rows, int) or num_rows <= 0:
            raise ValueError(f"num_rows must be a positive int (the image's n_llm_h * n_llm_w), got {num_rows!r}")
        codec = self._codecs.get(num_rows)
        if codec is None:
            codec = self._codecs[num_rows] = PageCodec(self.fingerprint, self._layout(num_rows), EC_FORMAT_VERSION)
        return codec

    def get(self, image_hash: str, num_rows: int) -> torch.Tensor | None:
        """The rows [num_rows, hidden_size] (``dtype``, CPU, owned by the caller) stored for ``image_hash``, or None
        (a miss: no file, or a file that is not exactly a valid file of this fingerprint and shape, quarantined)."""
        page = self.store.get(image_hash, self._codec(num_rows))
        with self._lock:
            self._counts["hits" if page is not None else "misses"] += 1
        return None if page is None else page[ROWS]

    def put(self, image_hash: str, rows: torch.Tensor) -> bool:
        """Store ``rows`` [n, hidden_size] (``dtype``, any device) under ``image_hash``; True when the image's file
        is in the directory afterwards (written now, or already there and valid: then only marked recently used).
        Raises ValueError for rows of another width, rank or dtype."""
        if rows.dim() != 2 or rows.shape[1] != self.hidden_size or rows.dtype != self.dtype:
            raise ValueError(f"rows must be [n, {self.hidden_size}] {self.dtype}, got {list(rows.shape)} {rows.dtype}")
        codec = self._codec(int(rows.shape[0]))
        with self._lock:  # one writer at a time in this process, so that the store's write counter is ours
            before, start = self.store.stats["pages_written"], time.perf_counter()
            stored = self.store.put(image_hash, {ROWS: rows}, codec)
            if self.store.stats["pages_written"] > before:
                self._counts["images_written"] += 1
                self._counts["written_bytes"] += codec.size(image_hash)
                self._counts["write_seconds"] += time.perf_counter() - start
        return stored

    def contains(self, image_hash: str) -> bool:
        """A file exists for ``image_hash`` (not validated: ``get`` may still reject it)."""
        return self.store.contains(image_hash)

    def flush(self, timeout: float = 10.0) -> bool:
        """Writes are synchronous: always True (the KV connectors' interface)."""
        return True

    def file_bytes(self, image_hash: str, num_rows: int) -> int:
        """The size of a valid file of ``image_hash`` with ``num_rows`` rows: the rows' bytes
        (``num_rows * hidden_size * itemsize``) plus the header."""
        return self._codec(num_rows).size(image_hash)

    @property
    def stats(self) -> dict[str, Any]:
        """The counters of the class docstring."""
        store = self.store.stats
        with self._lock:
            counts = dict(self._counts)
        return {**counts, "read_bytes": store["read_bytes"], "read_seconds": store["read_seconds"],
                "rejected": store["rejected"], "evictions": store["evictions"], "bytes_used": store["bytes_used"],
                "disabled": store["disabled"]}


def ec_directory(cfg: ECTransferConfig, fingerprint: str) -> Path:
    """``shared_storage_path/<fingerprint[:16]>-ec``: the rows of one model's vision weights."""
    return Path(cfg.ec_connector_extra_config["shared_storage_path"]) / f"{fingerprint[:16]}-ec"


def build_ec_connector(cfg: ECTransferConfig | dict | str, fingerprint: str, hidden_size: int,
                       dtype: torch.dtype) -> SharedStorageECConnector:
    """The connector of ``cfg`` (an :class:`ECTransferConfig`, or its dict / JSON as the flag takes it) for rows of
    ``hidden_size`` x ``dtype`` under ``fingerprint``: a :class:`SharedStorageECConnector` on
    :func:`ec_directory` with ``max_bytes`` from the extra config (default 8 GiB). Raises ValueError for a bad
    config (:meth:`ECTransferConfig.from_cli`) or a ``max_bytes`` that is not a non-negative int."""
    if not isinstance(cfg, ECTransferConfig):
        cfg = ECTransferConfig.from_cli(cfg)
    max_bytes = cfg.ec_connector_extra_config.get("max_bytes", DEFAULT_MAX_BYTES)
    if type(max_bytes) is not int or max_bytes < 0:
        raise ValueError(f"--ec-transfer-config: max_bytes must be an integer >= 0, got {max_bytes!r}")
    return SharedStorageECConnector(ec_directory(cfg, fingerprint), fingerprint, hidden_size, dtype, max_bytes)


def ec_fingerprint(model: torch.nn.Module, path: str | Path | None = None) -> str:
    """Hex sha256 naming what computes an image's aligner rows (module docstring).

    ``model``: anything with ``config`` (a :class:`~deepseek_v41.config.ModelConfig` with a ``vision_config``)
    and the ``vision`` / ``aligner`` modules (the full ``Transformer`` or the
    :class:`~deepseek_v41.model.vision.VisionModel` of :func:`deepseek_v41.disagg.vision_only.load_vision_only`:
    both give the same value). ``path``: the model directory it was loaded from (then the content digests of
    ``config.json`` and of the files holding the vision tensors are hashed, remembered across restarts by
    :func:`~deepseek_v41.cache.fingerprint.file_digests`), or None for a model built in memory (its vision
    tensors are hashed). Raises ValueError for a model without a vision path, OSError for unreadable files.
    """
    config = model.config
    if config.vision_config is None or getattr(model, "aligner", None) is None:
        raise ValueError("this model has no vision path (no vision_config / aligner): there are no rows to move")
    digest = hashlib.sha256(f"deepseek_v41 encoder cache transfer v{EC_FORMAT_VERSION}\0".encode())
    dtype = _dtype_name(model.aligner.w2.weight.dtype)
    digest.update(json.dumps({"dtype": dtype, "hidden_size": config.hidden_size,
                              "vision_config": dataclasses.asdict(config.vision_config)}, sort_keys=True).encode())
    names = sorted(n for n in model.state_dict() if n.startswith(VISION_PREFIXES))
    if path is None:
        state = model.state_dict()
        for name in names:
            digest.update(name.encode() + b"\0")
            digest.update(state[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
    path = Path(path)
    files = weight_files(path)
    held = {files[c] for n in names for c in checkpoint_name_candidates(n) if c in files}
    chosen = [path / "config.json", *sorted(held)]
    for file, content in zip(chosen, file_digests(chosen), strict=True):
        digest.update(f"{file.relative_to(path)}\0{content}\0".encode())
    return digest.hexdigest()
