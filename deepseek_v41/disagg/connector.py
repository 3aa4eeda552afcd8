"""KV connectors: where a prefill server puts a prompt's global KV pages and a decode server finds them (issue 29).

One interface for the persistent prefix cache and for disaggregated transfer: a connector is a page tier with the
disk store's methods (:class:`KVConnector`), holding pages in the checksummed format of
:class:`~deepseek_v41.cache.store.PageCodec` (SPEC.md §4.3), so the unit that persists a prefix is the unit that
moves it. Only global KV moves (main entries + index keys of the kv-source layers, and the open compressor pair):
the decode side rebuilds the window state by replay. A page that is partial, corrupt, of another model or of
another layout is a miss; the decode side then computes those positions itself.

- ``SharedStorageConnector``: :class:`~deepseek_v41.cache.store.PageStore` on
  ``shared_storage_path/<fingerprint[:16]>`` (atomic renames: a reader never sees a partial page);
- ``RedisConnector``: :class:`~deepseek_v41.cache.redis_store.RedisPages` (``url``);
- ``NixlConnector``: :class:`deepseek_v41.disagg.nixl_connector.NixlPages` (the optional ``nixl`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from deepseek_v41.cache.redis_store import RedisPages, RedisStore
from deepseek_v41.cache.store import Layout, PageCodec, PageStore
from deepseek_v41.disagg.config import KVTransferConfig
from deepseek_v41.disagg.nixl_connector import NixlPages  # (imports without nixl; NixlPages() says what to install)

DEFAULT_SHARED_STORAGE_BYTES = 64 * 1024**3


class KVConnector(Protocol):
    """A page tier (the disk store's interface). ``get`` returns ``None`` on any miss (absent, partial, corrupt,
    other model or layout), never wrong data; ``put`` returns whether the page is stored; ``flush`` waits (at most
    ``timeout`` seconds) for queued writes; ``contains`` says whether a page is there now (what a prefill response
    may promise); ``stats`` has at least ``read_bytes``, ``read_seconds``."""

    read_tier: str

    def get(self, block_hash: str) -> dict[str, torch.Tensor] | None: ...

    def put(self, block_hash: str, page: dict[str, torch.Tensor]) -> bool: ...

    def flush(self, timeout: float = 10.0) -> bool: ...

    def contains(self, block_hash: str) -> bool: ...

    @property
    def stats(self) -> dict[str, Any]: ...


class SharedStoragePages:
    """``SharedStorageConnector``: the page store on a directory every server of the deployment mounts.

    ``directory``: ``shared_storage_path/<fingerprint[:16]>``; ``max_bytes``: the store's budget (LRU beyond it).
    Writes are synchronous (an fsync and a rename per page), so :meth:`flush` has nothing to wait for."""

    read_tier = "remote"

    def __init__(self, directory: str | Path, fingerprint: str, layout: Layout, max_bytes: int):
        self.store = PageStore(directory, fingerprint, layout, max_bytes)
        self.directory = self.store.directory

    def get(self, block_hash: str) -> dict[str, torch.Tensor] | None:
        return self.store.get(block_hash)

    def put(self, block_hash: str, page: dict[str, torch.Tensor]) -> bool:
        return self.store.put(block_hash, page)

    def contains(self, block_hash: str) -> bool:
        return self.store.contains(block_hash)

    def flush(self, timeout: float = 10.0) -> bool:
        return True

    @property
    def stats(self) -> dict[str, Any]:
        return self.store.stats


def build_kv_connector(cfg: KVTransferConfig, fingerprint: str, layout: Layout) -> KVConnector:
    """The connector ``cfg`` names, for pages of ``layout`` of the model ``fingerprint``. Raises ValueError for a
    shared-storage path that is not a writable directory (or cannot be made one) and ImportError (naming the
    extra to install) for NixlConnector without ``nixl``."""
    extra = cfg.kv_connector_extra_config
    if cfg.kv_connector == "SharedStorageConnector":
        root = Path(str(extra["shared_storage_path"])).expanduser()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--kv-transfer-config: shared_storage_path {str(root)!r} is not a directory this "
                             f"process can create or write: {exc.strerror}") from exc
        max_bytes = int(extra.get("max_bytes", DEFAULT_SHARED_STORAGE_BYTES))
        return SharedStoragePages(root / fingerprint[:16], fingerprint, layout, max_bytes)
    if cfg.kv_connector == "RedisConnector":
        store = RedisStore(str(extra["url"]), namespace=f"{fingerprint[:32]}-kvt")
        return RedisPages(store, PageCodec(fingerprint, layout))
    return NixlPages(PageCodec(fingerprint, layout), extra, cfg.kv_role)
