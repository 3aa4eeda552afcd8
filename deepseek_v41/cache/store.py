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
fails validation (truncated, oversize, corrupted, other format version, other model fingerprint, other layout,
other hash) is moved to ``quarantine/`` and the read is a miss. Only regular files are opened, and never through a
symlink (``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``): a FIFO, a device, a directory or a symlink named like a page
is quarantined without being read, and no read goes past the exact size a valid page of that hash has. A ``put``
over an existing file checks it like a read does and replaces it when it is bad, so a damaged directory heals as
pages are written again.

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
import stat
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


class PageCodec:
    """The page file format of the module docstring, for one model and layout (SPEC.md §4.3).

    Shared by :class:`PageStore` (files) and the Redis page tier (values): the same bytes, checked the same way.

    Args:
        fingerprint: the model fingerprint written into (and required in) every page.
        layout: name -> (shape, dtype string) of every tensor of a page.
        format_version: written into each page; pages of another version are rejected.
    """

    def __init__(self, fingerprint: str, layout: Layout, format_version: int = 1):
        self.fingerprint = fingerprint
        self.layout = {name: (tuple(int(d) for d in shape), str(_torch_dtype(dt)).removeprefix("torch."))
                       for name, (shape, dt) in layout.items()}
        self.format_version = format_version
        self._header_layout = [[name, list(shape), dt] for name, (shape, dt) in self.layout.items()]
        self._dtypes = {name: _torch_dtype(dt) for name, (_, dt) in self.layout.items()}
        self.payload_bytes = sum(self._dtypes[name].itemsize * _numel(shape)
                                 for name, (shape, _) in self.layout.items())
        self._header_bytes_without_hash = len(self._header(""))

    def size(self, block_hash: str) -> int:
        """The exact byte size of a valid page stored under ``block_hash`` (the JSON header is fixed but for the
        hash's length)."""
        return _PREFIX.size + self._header_bytes_without_hash + len(block_hash) + self.payload_bytes

    def check_page(self, page: dict[str, torch.Tensor]) -> None:
        """Raise ValueError when ``page``'s names, shapes or dtypes differ from the layout."""
        if set(page) != set(self.layout):
            raise ValueError(f"page tensors {sorted(page)} differ from the layout {sorted(self.layout)}")
        for name, (shape, _) in self.layout.items():
            t = page[name]
            if tuple(t.shape) != shape or t.dtype != self._dtypes[name]:
                raise ValueError(f"page tensor {name!r} is {tuple(t.shape)} {t.dtype}, the layout says "
                                 f"{shape} {self._dtypes[name]}")

    def _header(self, block_hash: str) -> bytes:
        return json.dumps({"block_hash": block_hash, "fingerprint": self.fingerprint,
                           "layout": self._header_layout}, separators=(",", ":")).encode()

    def encode(self, block_hash: str, page: dict[str, torch.Tensor]) -> bytes:
        """The page's bytes (prefix, header, payload). The page must match the layout (see ``check_page``)."""
        header = self._header(block_hash)
        payload = b"".join(page[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                           for name in self.layout)
        digest = hashlib.sha256(header + payload).digest()
        return _PREFIX.pack(MAGIC, self.format_version, len(header), len(payload), digest) + header + payload

    def verify(self, block_hash: str, data: bytes) -> str:
        """"" when ``data`` is a valid page of ``block_hash``, else the rejection kind ("truncated", "oversize",
        "bad magic", "other format version", "checksum mismatch", "bad header", "other model fingerprint",
        "other layout", "other block hash"). Checks run from the cheapest and most specific to the payload."""
        if len(data) < _PREFIX.size:
            return "truncated"
        magic, version, header_len, payload_len, digest = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            return "bad magic"
        if version != self.format_version:
            return "other format version"
        end = _PREFIX.size + header_len + payload_len
        if len(data) < end:
            return "truncated"
        if len(data) > end or hashlib.sha256(memoryview(data)[_PREFIX.size :]).digest() != digest:
            return "checksum mismatch"
        try:
            header = json.loads(data[_PREFIX.size : _PREFIX.size + header_len])
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "bad header"
        if not isinstance(header, dict):
            return "bad header"
        if header.get("fingerprint") != self.fingerprint:
            return "other model fingerprint"
        if header.get("layout") != self._header_layout or payload_len != self.payload_bytes:
            return "other layout"
        if header.get("block_hash") != block_hash:
            return "other block hash"
        return ""

    def decode(self, block_hash: str, data: bytes) -> tuple[dict[str, torch.Tensor] | None, str]:
        """(page, "") with fresh CPU tensors the caller owns, or (None, rejection kind) (see ``verify``)."""
        kind = self.verify(block_hash, data)
        if kind:
            return None, kind
        page, offset = {}, _PREFIX.size + _PREFIX.unpack_from(data)[2]
        for name, (shape, _) in self.layout.items():
            dtype = self._dtypes[name]
            nbytes = dtype.itemsize * _numel(shape)
            # bytearray: a private, aligned copy per tensor, so callers may write into what they get.
            raw = bytearray(data[offset : offset + nbytes])
            page[name] = (torch.frombuffer(raw, dtype=dtype).reshape(shape) if nbytes
                          else torch.empty(shape, dtype=dtype))
            offset += nbytes
        return page, ""


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

    read_tier = "disk"  # the ``tier`` label of its read counters (``dsv41:prefix_cache_read_bytes_total``)

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
        self.codec = PageCodec(fingerprint, layout, format_version)
        self.fingerprint, self.layout, self.format_version = fingerprint, self.codec.layout, format_version
        self.max_bytes = max_bytes
        self.ttl_seconds = ttl_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # block hash -> file bytes, least recent first
        self._last_stamp_ns = 0
        self._warned: set[str] = set()
        self._stats = dict(pages_read=0, pages_written=0, bytes_used=0, evictions=0, rejected=0, expired=0,
                           disabled=False, read_bytes=0, read_seconds=0.0)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            self._disable(exc)

    # ----------------------------------------------------------------------------------------- public API

    def put(self, block_hash: str, page: dict[str, torch.Tensor], codec: PageCodec | None = None) -> bool:
        """Persist ``page`` under ``block_hash``; True when it is on disk afterwards.

        ``codec``: the layout of this page when the store holds pages of several layouts (the encoder-cache
        transfer: one image's rows, their count set by its grid; deepseek_v41/disagg/ec_connector.py); default
        the store's own. It must have the store's fingerprint and format version.

        A valid page already stored (here or by another process) is only marked as recently used: pages are
        content-addressed. A file there that fails the checks of ``get`` (corrupt, truncated, expired, not a
        regular file) is quarantined and replaced. False when the store is disabled, the hash is not lowercase
        hex, the page alone exceeds ``max_bytes`` or the write fails. Raises ValueError when the page's names,
        shapes or dtypes differ from the layout.
        """
        codec = self._codec(codec)
        codec.check_page(page)
        if not self._valid_hash(block_hash):
            return False
        with self._lock:
            if self._stats["disabled"]:
                return False
            path = self._path(block_hash)
            data, st, kind = self._read_file(path, block_hash, codec)
            if not kind:
                kind = "expired" if self._expired(st.st_mtime_ns) else codec.verify(block_hash, data)
                if not kind:
                    if not self._touch(path):
                        self._forget(block_hash)
                        return False
                    self._remember(block_hash, st.st_size)
                    return True
            if kind == "expired":
                self._stats["expired"] += 1
            elif kind != "missing":
                self._quarantine(path, st.st_ino, block_hash, kind)
            data = codec.encode(block_hash, page)
            if len(data) > self.max_bytes:
                self._forget(block_hash)
                return False
            try:
                self._write_atomic(path, data)
            except OSError as exc:
                self._disable(exc)
                return False
            self._remember(block_hash, len(data))
            self._stats["pages_written"] += 1
            return block_hash in self._index

    def get(self, block_hash: str, codec: PageCodec | None = None) -> dict[str, torch.Tensor] | None:
        """The page stored under ``block_hash`` (fresh CPU tensors of the layout), or None on a miss.

        Misses: no file, an expired file (deleted), a file that is not a regular file, is larger than a valid page
        or fails validation (quarantined, one warning per kind), an I/O error. ``codec``: the layout demanded of
        this page (as in :meth:`put`; a file of another layout is rejected), default the store's own.
        """
        if not self._valid_hash(block_hash):
            return None
        codec = self._codec(codec)
        with self._lock:
            start = time.perf_counter()
            path = self._path(block_hash)
            data, st, kind = self._read_file(path, block_hash, codec)
            if kind == "missing":
                self._forget(block_hash)
                return None
            if not kind and self._expired(st.st_mtime_ns):
                self._remove(path, st.st_ino)
                self._forget(block_hash)
                self._stats["expired"] += 1
                return None
            page, kind = (None, kind) if kind else codec.decode(block_hash, data)
            if page is None:
                self._quarantine(path, st.st_ino, block_hash, kind)
                return None
            self._stats["read_seconds"] += time.perf_counter() - start  # the file read and its decoding
            self._stats["read_bytes"] += len(data)
            self._stats["pages_read"] += 1
            if not self._stats["disabled"]:
                self._touch(path)
            self._remember(block_hash, len(data))  # a page another process wrote is now counted here too
            return page

    def contains(self, block_hash: str) -> bool:
        """True when an unexpired regular file exists for ``block_hash`` (not validated: ``get`` may still reject
        it). Does not count as an access for LRU."""
        if not self._valid_hash(block_hash):
            return False
        try:
            st = os.lstat(self._path(block_hash))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and not self._expired(st.st_mtime_ns)

    @property
    def stats(self) -> dict:
        """Counters: pages_read, pages_written, bytes_used (bytes of the known page files), evictions, rejected
        (files quarantined), expired, disabled (True once writes are off); read_bytes and read_seconds (bytes of
        the page files ``get`` returned a page from, and the seconds spent reading and decoding them: their ratio
        is the read bandwidth; misses and rejected files are not counted)."""
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

    def _encode(self, block_hash: str, page: dict[str, torch.Tensor]) -> bytes:
        return self.codec.encode(block_hash, page)

    # ----------------------------------------------------------------------------------------- files

    @staticmethod
    def _valid_hash(block_hash: str) -> bool:
        # Hex only: a name with "/" or ".." must never reach the file system.
        return isinstance(block_hash, str) and _HEX.fullmatch(block_hash) is not None

    def _path(self, block_hash: str) -> Path:
        return self.directory / f"{block_hash}{PAGE_SUFFIX}"

    def _codec(self, codec: PageCodec | None) -> PageCodec:
        """``codec`` (checked to be of this store's model and format) or the store's own."""
        if codec is None:
            return self.codec
        if codec.fingerprint != self.fingerprint or codec.format_version != self.format_version:
            raise ValueError("a page codec given to a PageStore must have the store's fingerprint and format version")
        return codec

    def _read_file(self, path: Path, block_hash: str, codec: PageCodec | None = None
                   ) -> tuple[bytes, os.stat_result | None, str]:
        """(bytes, stat, "") of the regular file at ``path``, at most the size of a valid page of ``block_hash`` in
        ``codec``'s layout (default the store's); else (b"", stat, kind) with kind "missing" (gone, unreadable),
        "symlink", "not a regular file" or "oversize" — without reading the file or opening what it is not.

        The file is opened without following a symlink and without blocking (a FIFO would block ``open`` until a
        writer comes), and checked again through ``fstat`` (it may have been replaced since ``lstat``).
        """
        try:
            st = os.lstat(path)
        except OSError:
            return b"", None, "missing"
        if stat.S_ISLNK(st.st_mode):
            return b"", st, "symlink"
        if not stat.S_ISREG(st.st_mode):
            return b"", st, "not a regular file"
        expected = (codec or self.codec).size(block_hash)
        if st.st_size > expected:
            return b"", st, "oversize"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return b"", None, "missing"  # replaced since the lstat: the next access sees what is there now
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return b"", st, "not a regular file"
            data = self._read_all(fd, expected + 1)
        except OSError:
            return b"", None, "missing"
        finally:
            os.close(fd)
        if len(data) > expected:  # grew since the fstat
            return b"", st, "oversize"
        return data, st, ""

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
    def _read_all(fd: int, limit: int) -> bytes:
        """Up to ``limit`` bytes from ``fd`` (fewer at end of file)."""
        chunks, total = [], 0
        while total < limit:
            chunk = os.read(fd, limit - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)

    def _touch(self, path: Path) -> bool:
        """Stamp ``path`` as just used; False when it is gone. Never follows a symlink (one swapped in since the
        checks would otherwise stamp its target)."""
        stamp = self._stamp_ns()
        try:
            os.utime(path, ns=(stamp, stamp), follow_symlinks=False)
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
            if inode is not None and os.lstat(path).st_ino != inode:
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
        stale temp files; quarantine what is named like a page but is not a regular file."""
        found = []
        for entry in os.scandir(self.directory):
            name = entry.name
            is_page = name.endswith(PAGE_SUFFIX) and self._valid_hash(name[: -len(PAGE_SUFFIX)])
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # deleted under us
            if not stat.S_ISREG(st.st_mode):
                if is_page:
                    kind = "symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                    self._quarantine(Path(entry.path), st.st_ino, name[: -len(PAGE_SUFFIX)], kind)
                continue
            if name.endswith(".tmp"):
                if self.clock() - st.st_mtime_ns / 1e9 > STALE_TEMP_SECONDS:
                    self._remove(entry.path)
            elif is_page:
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
        """Move the rejected ``path`` (a file, a symlink itself, a FIFO, a directory) to ``quarantine/``, or delete
        it when it cannot be moved; log the first rejection of each kind."""
        self._forget(block_hash)
        self._stats["rejected"] += 1
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("prefix cache: rejected %s (%s), moved to %s/; further rejections of this kind are only "
                        "counted", path, kind, QUARANTINE)
        folder = self.directory / QUARANTINE
        try:
            if os.lstat(path).st_ino != inode:
                return  # replaced by another process since we read it: leave the new file alone
            folder.mkdir(exist_ok=True)
            os.replace(path, folder / f"{block_hash}.{kind.replace(' ', '-')}.{uuid.uuid4().hex[:8]}")
            kept = sorted((e for e in os.scandir(folder) if not e.is_dir(follow_symlinks=False)),
                          key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns)
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
