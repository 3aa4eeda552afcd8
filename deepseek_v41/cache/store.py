"""Persistent store of global KV pages: one checksummed file per page, byte budget, LRU, TTL (SPEC.md §4.3).

Only global KV goes here (main entries + index keys of the kv-source layers); window KV never does. A page is
``dict[str, torch.Tensor]`` whose names, shapes and dtypes are fixed by the store's ``layout``. The store is a
cache: every failure is a miss, never an exception and never wrong data.

File format (``<directory>/<block_hash>.page``, little-endian)::

    offset  size  field
    0       8     magic b"DSV41PG\\0"
    8       4     format version (u32)
    12      4     header length H (u32)
    16      8     payload length (u64)
    24      32    sha256 of header || payload
    56      H     header: UTF-8 JSON {"block_hash", "fingerprint", "layout": [[name, shape, dtype], ...]}
    56+H    ...   payload: each tensor's raw bytes (C order), in layout order

Writes go to a temp file in the same directory, are fsynced, stamped and renamed over the final name
(``os.replace``), so a reader sees either the old file, the new one or none — never a partial page. A file that
fails validation (truncated, corrupted, other format version, other model fingerprint, other layout, other hash)
is moved to ``quarantine/`` and the read is a miss.

The access order survives restarts through the files' mtime, which the store sets itself (to its clock) on write
and on every hit: a new store sorts the files by mtime. The TTL counts from the last access.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAGIC = b"DSV41PG\0"
_PREFIX = struct.Struct("<8sIIQ32s")  # magic, format version, header length, payload length, sha256
PAGE_SUFFIX = ".page"
QUARANTINE = "quarantine"
# Quarantine keeps evidence for debugging, not an archive: the oldest files beyond this count are deleted.
QUARANTINE_MAX_FILES = 64
# A temp file this much older than the store's clock belongs to a writer that died; younger ones may be in flight
# in another process sharing the directory.
STALE_TEMP_SECONDS = 3600.0
_HEX = re.compile(r"[0-9a-f]{1,128}")

Layout = dict[str, tuple[tuple[int, ...], str]]


def _torch_dtype(name: str) -> torch.dtype:
    """``"uint8"`` or ``"torch.uint8"`` -> ``torch.uint8``. Raises ValueError for a name that is not a dtype."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the page layout")
    return dtype


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (a module function so that tests can make the disk full)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class PageStore:
    """Global KV pages on local disk, keyed by the prefix hash chain's block hash (SPEC.md §4.3).

    Args:
        directory: where the page files live; created when missing. Several processes may share it.
        fingerprint: the model fingerprint; a file written for another model is rejected.
        layout: name -> (shape, dtype string) of every tensor of a page, e.g. ``{"main.0": ((4, 72), "uint8")}``.
        max_bytes: budget in bytes over the page files (headers included); least recently used pages are deleted
            beyond it. Processes sharing a directory each enforce it over the pages they know (written, read or
            found at start), so give each its share.
        ttl_seconds: a page not accessed for this many seconds is a miss and is deleted (default 72 h).
        format_version: written into each file; files of another version are rejected.
        clock: seconds since the epoch (injectable for tests); it also stamps the files' mtime.

    Never raises on I/O: an unwritable or full directory disables writes with one warning
    (``stats["disabled"]``); files replaced or deleted by another process are misses. ``put`` raises ValueError
    only for a page that does not match ``layout`` (a caller bug).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        fingerprint: str,
        layout: Layout,
        max_bytes: int,
        ttl_seconds: float = 72 * 3600,
        format_version: int = 1,
        clock: Callable[[], float] = time.time,
    ):
        if max_bytes < 0 or ttl_seconds <= 0:
            raise ValueError(f"max_bytes must be >= 0 and ttl_seconds > 0, got {max_bytes}, {ttl_seconds}")
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.layout = {name: (tuple(int(d) for d in shape), str(_torch_dtype(dt)).removeprefix("torch."))
                       for name, (shape, dt) in layout.items()}
        self.max_bytes = max_bytes
        self.ttl_seconds = ttl_seconds
        self.format_version = format_version
        self.clock = clock
        self._header_layout = [[name, list(shape), dt] for name, (shape, dt) in self.layout.items()]
        self._dtypes = {name: _torch_dtype(dt) for name, (_, dt) in self.layout.items()}
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # block hash -> file bytes, least recent first
        self._last_stamp_ns = 0
        self._warned: set[str] = set()
        self._stats = dict(pages_read=0, pages_written=0, bytes_used=0, evictions=0, rejected=0, expired=0,
                           disabled=False)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            self._disable(exc)

    # ----------------------------------------------------------------------------------------- public API

    def put(self, block_hash: str, page: dict[str, torch.Tensor]) -> bool:
        """Persist ``page`` under ``block_hash``; True when it is on disk afterwards.

        A page already stored is only marked as recently used (pages are content-addressed). False when the store
        is disabled, the hash is not lowercase hex, the page alone exceeds ``max_bytes`` or the write fails.
        Raises ValueError when the page's names, shapes or dtypes differ from the layout.
        """
        self._check_page(page)
        if not self._valid_hash(block_hash):
            return False
        with self._lock:
            if self._stats["disabled"]:
                return False
            path = self._path(block_hash)
            # Content-addressed: a page already on disk (written here or by another process) is only marked used.
            if self._touch(path):
                try:
                    self._remember(block_hash, os.stat(path).st_size)
                except FileNotFoundError:
                    self._forget(block_hash)
                    return False
                return True
            if self._stats["disabled"]:  # the touch may have found the directory read-only
                return False
            data = self._encode(block_hash, page)
            if len(data) > self.max_bytes:
                return False
            try:
                self._write_atomic(path, data)
            except OSError as exc:
                self._disable(exc)
                return False
            self._remember(block_hash, len(data))
            self._stats["pages_written"] += 1
            return block_hash in self._index

    def get(self, block_hash: str) -> dict[str, torch.Tensor] | None:
        """The page stored under ``block_hash`` (fresh CPU tensors of the layout), or None on a miss.

        Misses: no file, an expired file (deleted), a file that fails validation (quarantined), an I/O error.
        """
        if not self._valid_hash(block_hash):
            return None
        with self._lock:
            path = self._path(block_hash)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                self._forget(block_hash)
                return None
            try:
                st = os.fstat(fd)
                data = self._read_all(fd, st.st_size)
            except OSError:
                self._forget(block_hash)
                return None
            finally:
                os.close(fd)
            if self._expired(st.st_mtime_ns):
                self._remove(path, st.st_ino)
                self._forget(block_hash)
                self._stats["expired"] += 1
                return None
            page, kind = self._decode(block_hash, data)
            if page is None:
                self._quarantine(path, st.st_ino, block_hash, kind)
                return None
            self._stats["pages_read"] += 1
            if not self._stats["disabled"]:
                self._touch(path)
            self._remember(block_hash, len(data))  # a page another process wrote is now counted here too
            return page

    def contains(self, block_hash: str) -> bool:
        """True when an unexpired file exists for ``block_hash`` (not validated: ``get`` may still reject it).

        Does not count as an access for LRU.
        """
        if not self._valid_hash(block_hash):
            return False
        try:
            st = os.stat(self._path(block_hash))
        except OSError:
            return False
        return not self._expired(st.st_mtime_ns)

    @property
    def stats(self) -> dict:
        """Counters: pages_read, pages_written, bytes_used (bytes of the known page files), evictions, rejected
        (files quarantined), expired, disabled (True once writes are off)."""
        with self._lock:
            return dict(self._stats)

    def clear(self) -> None:
        """Delete every page file and quarantined file in the directory (this process's and others')."""
        with self._lock:
            for folder in (self.directory, self.directory / QUARANTINE):
                try:
                    entries = list(os.scandir(folder))
                except OSError:
                    continue
                for entry in entries:
                    if entry.is_file(follow_symlinks=False) and (folder != self.directory
                                                                  or entry.name.endswith(PAGE_SUFFIX)):
                        self._remove(entry.path)
            self._index.clear()
            self._stats["bytes_used"] = 0

    # ----------------------------------------------------------------------------------------- encoding

    def _check_page(self, page: dict[str, torch.Tensor]) -> None:
        if set(page) != set(self.layout):
            raise ValueError(f"page tensors {sorted(page)} differ from the layout {sorted(self.layout)}")
        for name, (shape, _) in self.layout.items():
            t = page[name]
            if tuple(t.shape) != shape or t.dtype != self._dtypes[name]:
                raise ValueError(f"page tensor {name!r} is {tuple(t.shape)} {t.dtype}, the layout says "
                                 f"{shape} {self._dtypes[name]}")

    def _encode(self, block_hash: str, page: dict[str, torch.Tensor]) -> bytes:
        header = json.dumps({"block_hash": block_hash, "fingerprint": self.fingerprint,
                             "layout": self._header_layout}, separators=(",", ":")).encode()
        payload = b"".join(page[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                           for name in self.layout)
        digest = hashlib.sha256(header + payload).digest()
        return _PREFIX.pack(MAGIC, self.format_version, len(header), len(payload), digest) + header + payload

    def _decode(self, block_hash: str, data: bytes) -> tuple[dict[str, torch.Tensor] | None, str]:
        """(page, "") or (None, rejection kind). Checks run from the cheapest and most specific to the payload."""
        if len(data) < _PREFIX.size:
            return None, "truncated"
        magic, version, header_len, payload_len, digest = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            return None, "bad magic"
        if version != self.format_version:
            return None, "other format version"
        end = _PREFIX.size + header_len + payload_len
        if len(data) < end:
            return None, "truncated"
        if len(data) > end or hashlib.sha256(memoryview(data)[_PREFIX.size :]).digest() != digest:
            return None, "checksum mismatch"
        try:
            header = json.loads(data[_PREFIX.size : _PREFIX.size + header_len])
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None, "bad header"
        if not isinstance(header, dict):
            return None, "bad header"
        if header.get("fingerprint") != self.fingerprint:
            return None, "other model fingerprint"
        if header.get("layout") != self._header_layout:
            return None, "other layout"
        if header.get("block_hash") != block_hash:
            return None, "other block hash"
        page, offset = {}, _PREFIX.size + header_len
        for name, (shape, _) in self.layout.items():
            dtype = self._dtypes[name]
            nbytes = dtype.itemsize * _numel(shape)
            if offset + nbytes > end:
                return None, "other layout"
            # bytearray: a private, aligned copy per tensor, so callers may write into what they get.
            raw = bytearray(data[offset : offset + nbytes])
            page[name] = (torch.frombuffer(raw, dtype=dtype).reshape(shape) if nbytes
                          else torch.empty(shape, dtype=dtype))
            offset += nbytes
        if offset != end:
            return None, "other layout"
        return page, ""

    # ----------------------------------------------------------------------------------------- files

    @staticmethod
    def _valid_hash(block_hash: str) -> bool:
        # Hex only: a name with "/" or ".." must never reach the file system.
        return isinstance(block_hash, str) and _HEX.fullmatch(block_hash) is not None

    def _path(self, block_hash: str) -> Path:
        return self.directory / f"{block_hash}{PAGE_SUFFIX}"

    def _stamp_ns(self) -> int:
        # Strictly increasing within a process so that a restart recovers the exact access order from mtimes.
        self._last_stamp_ns = max(int(self.clock() * 1e9), self._last_stamp_ns + 1)
        return self._last_stamp_ns

    def _expired(self, mtime_ns: int) -> bool:
        return self.clock() - mtime_ns / 1e9 > self.ttl_seconds

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = self.directory / f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, data)
                # fsync before the rename: after a power loss the name must not point at unwritten blocks. The
                # directory is not fsynced: losing the rename only loses a cache entry.
                os.fsync(fd)
            finally:
                os.close(fd)
            stamp = self._stamp_ns()
            os.utime(tmp, ns=(stamp, stamp))
            os.replace(tmp, path)
        except BaseException:
            self._remove(tmp)
            raise

    @staticmethod
    def _read_all(fd: int, size: int) -> bytes:
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, max(size - total, 1 << 16))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)

    def _touch(self, path: Path) -> bool:
        """Stamp ``path`` as just used; False when it is gone."""
        stamp = self._stamp_ns()
        try:
            os.utime(path, ns=(stamp, stamp))
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._disable(exc)
            return False
        return True

    @staticmethod
    def _remove(path: str | Path, inode: int | None = None) -> None:
        """Delete ``path``, tolerating that it is gone; with ``inode``, only if it is still that file (another
        process may have replaced it with a good page in the meantime)."""
        try:
            if inode is not None and os.stat(path).st_ino != inode:
                return
            os.unlink(path)
        except OSError:
            pass

    def _forget(self, block_hash: str) -> None:
        size = self._index.pop(block_hash, None)
        if size is not None:
            self._stats["bytes_used"] -= size

    def _remember(self, block_hash: str, size: int) -> None:
        """Index ``block_hash`` as the most recently used page, then evict down to the budget."""
        self._forget(block_hash)
        self._index[block_hash] = size
        self._stats["bytes_used"] += size
        self._evict_to_budget()

    def _evict_to_budget(self) -> None:
        while self._stats["bytes_used"] > self.max_bytes and self._index:
            victim = next(iter(self._index))
            self._forget(victim)
            self._remove(self._path(victim))
            self._stats["evictions"] += 1

    def _scan(self) -> None:
        """Index the page files already in the directory, least recently used first; delete expired pages and
        stale temp files."""
        found = []
        for entry in os.scandir(self.directory):
            name = entry.name
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # deleted under us
            if name.endswith(".tmp"):
                if self.clock() - st.st_mtime_ns / 1e9 > STALE_TEMP_SECONDS:
                    self._remove(entry.path)
            elif name.endswith(PAGE_SUFFIX) and self._valid_hash(name[: -len(PAGE_SUFFIX)]):
                if self._expired(st.st_mtime_ns):
                    self._remove(entry.path)
                    self._stats["expired"] += 1
                else:
                    found.append((st.st_mtime_ns, name[: -len(PAGE_SUFFIX)], st.st_size))
        for mtime_ns, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self._stats["bytes_used"] += size
            self._last_stamp_ns = max(self._last_stamp_ns, mtime_ns)
        self._evict_to_budget()

    def _quarantine(self, path: Path, inode: int, block_hash: str, kind: str) -> None:
        self._forget(block_hash)
        self._stats["rejected"] += 1
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("prefix cache: rejected %s (%s), moved to %s/; further rejections of this kind are only "
                        "counted", path, kind, QUARANTINE)
        folder = self.directory / QUARANTINE
        try:
            if os.stat(path).st_ino != inode:
                return  # replaced by another process since we read it: leave the new file alone
            folder.mkdir(exist_ok=True)
            os.replace(path, folder / f"{block_hash}.{kind.replace(' ', '-')}.{uuid.uuid4().hex[:8]}")
            kept = sorted(os.scandir(folder), key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns)
            for entry in kept[:-QUARANTINE_MAX_FILES]:
                self._remove(entry.path)
        except OSError:
            self._remove(path, inode)  # cannot quarantine (read-only disk, gone): at least never read it again

    def _disable(self, exc: OSError) -> None:
        if not self._stats["disabled"]:
            self._stats["disabled"] = True
            reason = errno.errorcode.get(exc.errno, "") if exc.errno else ""
            log.warning("prefix cache: %s is not writable (%s %s); persistence is off for this process",
                        self.directory, reason, exc)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
