"""The model fingerprint that keys the prefix cache: what the model computes, weights included (SPEC.md §4.3).

Two engines may share cached KV only if they compute the same KV: same architecture, same weights, same load
dtype, same Engram token map. For a model directory the fingerprint is sha256 over

- the cache format version and the dtypes the weights were loaded in;
- the *content* of every file the loader reads: ``config.json``, ``model.safetensors.index.json`` when present,
  every weight shard, and ``tokenizer.json`` when present (it builds the Engram token map).

A file's content digest is sha256 over the sha256 of each 64 MiB chunk of the memory-mapped file (chunks hashed in
parallel threads; hashlib releases the GIL), then the file size. Hashing a checkpoint once costs a read of it
(~1.5 GB/s per core); the digest is then remembered in a small file keyed by the file's identity — device, inode,
size, mtime and ctime in nanoseconds — under ``$DSV41_CACHE_HOME`` (default ``$XDG_CACHE_HOME/deepseek_v41`` or
``~/.cache/deepseek_v41``) in ``weight-digests/``, so a restart rehashes nothing. Any write to a file changes its
mtime and ctime (ctime cannot be set back), so a changed file is hashed again. A digest is not remembered for a
file modified in the last two seconds: a write in the same timestamp tick could otherwise go unseen. The digests
live outside the checkpoint, so read-only and shared model directories work, and nothing is written beside them.

A model built in memory (no directory) is fingerprinted by its config and every tensor of its state dict.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from deepseek_v41.model.checkpoint import weight_files

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
CHUNK_BYTES = 64 << 20
# A file modified this recently is hashed but its digest not remembered (a write in the same mtime tick).
RACY_SECONDS = 2.0


def model_fingerprint(model: torch.nn.Module, path: str | Path | None = None) -> str:
    """Hex sha256 identifying what ``model`` computes (see the module docstring).

    ``path``: the model directory ``model`` was loaded from (its files' content is hashed, remembered by file
    identity), or None for a model built in memory (its config and state dict are hashed). Raises OSError when a
    file of the directory cannot be read.
    """
    digest = hashlib.sha256(f"deepseek_v41 prefix cache v{CACHE_FORMAT_VERSION}\0".encode())
    if path is None:
        digest.update(json.dumps(model.config.to_dict(), sort_keys=True).encode())
        for name, tensor in model.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
    path = Path(path)
    dtypes = sorted({str(t.dtype) for t in model.state_dict().values()})
    digest.update(f"dtypes {dtypes}\0".encode())
    files = checkpoint_files(path)
    for file, content in zip(files, file_digests(files), strict=True):
        digest.update(f"{file.relative_to(path)}\0{content}\0".encode())
    return digest.hexdigest()


def checkpoint_files(path: Path) -> list[Path]:
    """The files of the model directory ``path`` that decide what the loaded model computes: config.json, the
    shard index and the shards it names (or every ``*.safetensors``), tokenizer.json when present."""
    files = [path / "config.json"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files.append(index)
    files += sorted(set(weight_files(path).values()))
    files += [t for t in (path / "tokenizer.json", path / "tokenizer" / "tokenizer.json") if t.is_file()][:1]
    return files


def digest_home() -> Path:
    """Where remembered file digests live: ``$DSV41_CACHE_HOME/weight-digests`` (default
    ``$XDG_CACHE_HOME/deepseek_v41`` or ``~/.cache/deepseek_v41``)."""
    base = os.environ.get("DSV41_CACHE_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "deepseek_v41"
    return Path(base) / "weight-digests"


def file_digests(files: list[Path]) -> list[str]:
    """The content digest of each file (hex sha256 over its chunks' sha256 and its size), remembered by file
    identity so that an unchanged file is not read again. Raises OSError when a file cannot be read."""
    home = digest_home()
    stats = [os.stat(f) for f in files]
    keys = [_identity_key(st) for st in stats]
    out: list[str | None] = [_recall(home, key) for key in keys]
    todo = [i for i, d in enumerate(out) if d is None]
    if not todo:
        return out  # type: ignore[return-value]
    total = sum(stats[i].st_size for i in todo)
    start = time.monotonic()
    jobs = [(i, offset) for i in todo for offset in range(0, max(stats[i].st_size, 1), CHUNK_BYTES)]
    workers = max(1, min(len(jobs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                         else os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers, thread_name_prefix="dsv41-weight-hash") as pool:
        chunks = list(pool.map(lambda job: _hash_chunk(files[job[0]], job[1], stats[job[0]].st_size), jobs))
    per_file = {i: hashlib.sha256() for i in todo}
    for (i, _), chunk in zip(jobs, chunks, strict=True):
        per_file[i].update(chunk)
    now = time.time()
    for i in todo:
        per_file[i].update(f"size {stats[i].st_size}".encode())
        out[i] = per_file[i].hexdigest()
        # A file changed while it was hashed (or just before) is hashed again at the next start.
        if _identity_key(os.stat(files[i])) == keys[i] and now - stats[i].st_mtime_ns / 1e9 > RACY_SECONDS:
            _remember(home, keys[i], out[i])
    log.info("prefix cache: hashed %d file(s), %.2f GiB of the checkpoint, in %.1f s for the model fingerprint "
             "(remembered in %s)", len(todo), total / 2**30, time.monotonic() - start, home)
    return out  # type: ignore[return-value]


def _hash_chunk(file: Path, offset: int, size: int) -> bytes:
    """sha256 of ``file``'s bytes [offset, offset + CHUNK_BYTES), read through a memory map (no copy)."""
    length = min(CHUNK_BYTES, size - offset)
    if length <= 0:
        return hashlib.sha256().digest()
    with file.open("rb") as f, mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=offset) as view:
        return hashlib.sha256(view).digest()


def _identity_key(st: os.stat_result) -> str:
    identity = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{CHUNK_BYTES}"
    return hashlib.sha256(identity.encode()).hexdigest()


def _recall(home: Path, key: str) -> str | None:
    try:
        text = (home / key).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else None


def _remember(home: Path, key: str, digest: str) -> None:
    """Write the digest atomically; a home that cannot be written only costs hashing again next time."""
    tmp = home / f".{key}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        home.mkdir(parents=True, exist_ok=True)
        tmp.write_text(digest + "\n")
        os.replace(tmp, home / key)
    except OSError as exc:
        log.warning("prefix cache: cannot remember weight digests in %s (%s); the checkpoint will be hashed again "
                    "at the next start", home, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()
