"""PageStore: round trips, atomic writes, rejection of bad files, LRU + byte budget, TTL, restart, degraded
directories, a shared directory (SPEC.md §4.3)."""

import errno
import json
import logging
import os
import stat
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepseek_v41.cache.store as store_mod
from deepseek_v41.cache.store import PageStore

FP = "f" * 64
LAYOUT = {"main.0": ((4, 72), "uint8"), "index.0": ((4, 36), "uint8"), "main.3": ((1, 72), "uint8")}


def h(i: int) -> str:
    """A block hash of fixed length (so that every page file has the same size)."""
    return f"{i:064x}"


def make_page(seed: int, layout=LAYOUT) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    page = {}
    for name, (shape, dt) in layout.items():
        dtype = getattr(torch, dt.removeprefix("torch."))
        if dtype == torch.bool:
            page[name] = torch.randint(0, 2, shape, generator=g).bool()
            continue
        raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), dtype=torch.uint8, generator=g)
        page[name] = raw.view(dtype).reshape(shape)  # every bit pattern, NaNs included
    return page


def same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def new_store(path, **kw) -> PageStore:
    kw.setdefault("max_bytes", 1 << 30)
    return PageStore(path, kw.pop("fingerprint", FP), kw.pop("layout", LAYOUT), **kw)


def page_file_size(tmp_path) -> int:
    s = new_store(tmp_path / "probe")
    s.put(h(0), make_page(0))
    return s.stats["bytes_used"]


# ------------------------------------------------------------------------------------------------ round trips


def test_round_trip(tmp_path):
    s = new_store(tmp_path)
    page = make_page(1)
    assert not s.contains(h(1)) and s.get(h(1)) is None
    assert s.put(h(1), page)
    assert s.contains(h(1))
    got = s.get(h(1))
    assert same_bytes(got, page)
    got["main.0"].zero_()  # the caller owns what it gets
    assert same_bytes(s.get(h(1)), page)
    st_ = s.stats
    assert (st_["pages_written"], st_["pages_read"], st_["rejected"], st_["disabled"]) == (1, 2, 0, False)
    assert st_["bytes_used"] == (tmp_path / f"{h(1)}.page").stat().st_size


def test_reads_count_the_page_file_bytes_and_seconds(tmp_path, monkeypatch):
    """read_bytes / read_seconds (dsv41:prefix_cache_read_*_total{tier="disk"}): the bytes of every page file a
    get returned a page from and the time spent reading and decoding it; misses and rejected files count
    nothing, nor does a put reading an existing file."""
    s = new_store(tmp_path)
    assert s.read_tier == "disk"
    for i in (1, 2):
        assert s.put(h(i), make_page(i))
    assert s.put(h(1), make_page(1))  # already there: put reads the file to check it, not a read of a hit
    size = (tmp_path / f"{h(1)}.page").stat().st_size
    assert s.get(h(9)) is None
    assert (s.stats["read_bytes"], s.stats["read_seconds"]) == (0, 0)
    assert s.get(h(1)) is not None and s.get(h(2)) is not None and s.get(h(1)) is not None
    assert s.stats["read_bytes"] == 3 * size and s.stats["read_seconds"] > 0
    # The seconds are the time of the read itself: a slow read shows.
    real_read = PageStore._read_file
    monkeypatch.setattr(PageStore, "_read_file", lambda self, *a: (time.sleep(0.05), real_read(self, *a))[1])
    before = s.stats["read_seconds"]
    assert s.get(h(2)) is not None
    assert s.stats["read_seconds"] - before >= 0.05
    monkeypatch.undo()
    (tmp_path / f"{h(2)}.page").write_bytes(b"garbage")  # rejected: quarantined, not counted
    assert s.get(h(2)) is None and s.stats["read_bytes"] == 4 * size


@pytest.mark.parametrize("layout", [
    {"bf16": ((3, 5), "bfloat16"), "f64": ((2, 2), "float64"), "i32": ((7,), "int32"), "u8": ((2, 3, 4), "uint8"),
     "scalar": ((), "float32"), "flags": ((5,), "bool")},
    {"empty": ((0, 72), "uint8"), "also_empty": ((3, 0), "torch.bfloat16")},
    {"large": ((64, 1 << 16), "uint8"), "large_f64": ((1 << 16,), "float64")},
], ids=["dtypes", "empty", "large"])
def test_round_trip_layouts(tmp_path, layout):
    s = new_store(tmp_path, layout=layout)
    page = make_page(3, layout)
    assert s.put(h(3), page)
    assert same_bytes(new_store(tmp_path, layout=layout).get(h(3)), page)


def test_non_contiguous_and_put_again(tmp_path):
    s = new_store(tmp_path)
    page = make_page(4)
    page["main.0"] = page["main.0"].t().contiguous().t()  # same values, other strides
    assert s.put(h(4), page) and s.put(h(4), page)
    assert s.stats["pages_written"] == 1  # content-addressed: the second put only marks it used
    assert same_bytes(s.get(h(4)), page)


def test_page_must_match_layout(tmp_path):
    s = new_store(tmp_path)
    page = make_page(5)
    with pytest.raises(ValueError, match="layout"):
        s.put(h(5), {k: v for k, v in page.items() if k != "main.3"})
    with pytest.raises(ValueError, match="main.0"):
        s.put(h(5), {**page, "main.0": page["main.0"][:3]})
    with pytest.raises(ValueError, match="main.0"):
        s.put(h(5), {**page, "main.0": page["main.0"].to(torch.int16)})


@pytest.mark.parametrize("bad", ["../" + h(1), "/etc/passwd", "", "ABCDEF", "12g4", "a/b", "a" * 129, "a.page", None])
def test_not_hex_hash_is_refused(tmp_path, bad):
    s = new_store(tmp_path / "store")
    assert not s.put(bad, make_page(1))
    assert s.get(bad) is None and not s.contains(bad)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["store"]


# ------------------------------------------------------------------------------------------------ atomic write


def test_partial_temp_file_is_never_a_page(tmp_path):
    s = new_store(tmp_path)
    full = s.codec.encode(h(7), make_page(7))
    # A writer killed mid-write leaves only its temp file: the page name never existed.
    tmp = tmp_path / f".{h(7)}.12345.deadbeef.tmp"
    tmp.write_bytes(full[: len(full) // 2])
    assert s.get(h(7)) is None and not s.contains(h(7))
    assert new_store(tmp_path).stats["bytes_used"] == 0
    assert tmp.exists()  # young: may be another process's write in flight
    os.utime(tmp, (0, 0))
    new_store(tmp_path)
    assert not tmp.exists()  # stale: deleted at start


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def die_halfway(fd, data):
        os.write(fd, data[: len(data) // 2])
        raise KeyboardInterrupt

    s = new_store(tmp_path)
    monkeypatch.setattr(store_mod, "_write_all", die_halfway)
    with pytest.raises(KeyboardInterrupt):
        s.put(h(8), make_page(8))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ rejection


def _rewrite(path: Path, fn) -> None:
    path.write_bytes(fn(path.read_bytes()))


def _flip(offset_fn):
    def fn(data: bytes) -> bytes:
        i = offset_fn(data)
        return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
    return fn


def _header_len(data: bytes) -> int:
    return struct.unpack_from("<I", data, 12)[0]


def _edit_header(edit):
    """Rewrite the JSON header and recompute the checksum: a well-formed file that still must be refused."""
    def fn(data: bytes) -> bytes:
        import hashlib
        n = _header_len(data)
        header = json.loads(data[56 : 56 + n])
        edit(header)
        new = json.dumps(header, separators=(",", ":")).encode()  # as compact as the store writes it
        payload = data[56 + n :]
        prefix = struct.pack("<8sIIQ32s", data[:8], struct.unpack_from("<I", data, 8)[0], len(new), len(payload),
                             hashlib.sha256(new + payload).digest())
        return prefix + new + payload
    return fn


CORRUPTIONS = {
    "truncated to 10 bytes": (lambda d: d[:10], "truncated"),
    "truncated in the header": (lambda d: d[:60], "truncated"),
    "truncated in the payload": (lambda d: d[:-1], "truncated"),
    "empty file": (lambda d: b"", "truncated"),
    "flipped payload byte": (_flip(lambda d: len(d) - 5), "checksum mismatch"),
    "flipped header byte": (_flip(lambda d: 56 + _header_len(d) // 2), "checksum mismatch"),
    "flipped checksum byte": (_flip(lambda d: 30), "checksum mismatch"),
    "flipped magic": (_flip(lambda d: 0), "bad magic"),
    "extra bytes": (lambda d: d + b"\0", "oversize"),
    "other fingerprint": (_edit_header(lambda hd: hd.update(fingerprint="0" * 64)), "other model fingerprint"),
    "other layout": (_edit_header(lambda hd: hd["layout"][0][1].__setitem__(0, 8)), "other layout"),
    "header without fields": (_edit_header(lambda hd: hd.clear()), "other model fingerprint"),
    "other block hash in the header": (_edit_header(lambda hd: hd.update(block_hash=h(99))), "other block hash"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupted_file_is_rejected_and_quarantined(tmp_path, caplog, name):
    corrupt, kind = CORRUPTIONS[name]
    s = new_store(tmp_path)
    s.put(h(9), make_page(9))
    s.put(h(10), make_page(10))
    path = tmp_path / f"{h(9)}.page"
    _rewrite(path, corrupt)
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.store"):
        assert s.get(h(9)) is None
    assert not path.exists()
    assert [p.name.split(".")[:2] for p in (tmp_path / "quarantine").iterdir()] == [[h(9), kind.replace(" ", "-")]]
    assert s.stats["rejected"] == 1
    assert [r.getMessage() for r in caplog.records if kind in r.getMessage()] != []
    # The neighbour is untouched and the hash can be stored again.
    assert same_bytes(s.get(h(10)), make_page(10))
    assert s.put(h(9), make_page(9)) and same_bytes(s.get(h(9)), make_page(9))


def test_other_version_and_fingerprint_and_layout_writers(tmp_path):
    page = make_page(11)
    writers = {
        "other format version": new_store(tmp_path, format_version=2),
        "other model fingerprint": new_store(tmp_path, fingerprint="e" * 64),
        "other layout": new_store(tmp_path, layout={**LAYOUT, "main.3": ((1, 72), "int8")}),
    }
    reader = new_store(tmp_path)
    for i, (kind, writer) in enumerate(writers.items()):
        writer.put(h(20 + i), page if kind != "other layout" else {**page, "main.3": page["main.3"].to(torch.int8)})
        assert reader.get(h(20 + i)) is None, kind
        assert any(p.name.startswith(f"{h(20 + i)}.{kind.replace(' ', '-')}.")
                   for p in (tmp_path / "quarantine").iterdir())
    assert reader.stats["rejected"] == 3


def test_renamed_file_is_rejected(tmp_path):
    s = new_store(tmp_path)
    s.put(h(12), make_page(12))
    os.replace(tmp_path / f"{h(12)}.page", tmp_path / f"{h(13)}.page")
    assert s.get(h(13)) is None
    assert next((tmp_path / "quarantine").iterdir()).name.startswith(f"{h(13)}.other-block-hash.")


def test_one_warning_per_kind(tmp_path, caplog):
    s = new_store(tmp_path)
    for i in range(3):
        s.put(h(i), make_page(i))
        _rewrite(tmp_path / f"{h(i)}.page", lambda d: d[:-1])
    s.put(h(3), make_page(3))
    _rewrite(tmp_path / f"{h(3)}.page", _flip(lambda d: len(d) - 1))
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.store"):
        assert all(s.get(h(i)) is None for i in range(4))
    assert s.stats["rejected"] == 4
    assert len(caplog.records) == 2


def test_quarantine_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "QUARANTINE_MAX_FILES", 3)
    s = new_store(tmp_path)
    for i in range(6):
        s.put(h(i), make_page(i))
        _rewrite(tmp_path / f"{h(i)}.page", lambda d: d[:-1])
        assert s.get(h(i)) is None
    assert len(list((tmp_path / "quarantine").iterdir())) == 3


def _in_thread(fn, seconds: float = 10.0):
    """``fn()``'s result, failing (not hanging) when it does not return within ``seconds``."""
    result = []
    worker = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"did not return within {seconds} s"
    return result[0]


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _symlink_to_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_text("x")


def _sparse_huge(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(64 << 30)  # 64 GiB of holes: reading it whole would exhaust memory


ODD_FILES = {
    "fifo": (_fifo, "not a regular file"),
    "symlink to /dev/zero": (_symlink_to_dev_zero, "symlink"),
    "directory": (_directory, "not a regular file"),
    "sparse 64 GiB file": (_sparse_huge, "oversize"),
}


@pytest.mark.parametrize("name", list(ODD_FILES))
def test_odd_file_named_like_a_page_is_a_quarantined_miss(tmp_path, caplog, name):
    make, kind = ODD_FILES[name]
    s = new_store(tmp_path)
    path = tmp_path / f"{h(1)}.page"
    make(path)
    assert not s.contains(h(1)) or kind == "oversize"
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.store"):
        assert _in_thread(lambda: s.get(h(1))) is None
    assert not os.path.lexists(path)
    assert [p.name.split(".")[:2] for p in (tmp_path / "quarantine").iterdir()] == [[h(1), kind.replace(" ", "-")]]
    assert s.stats["rejected"] == 1 and any(kind in r.getMessage() for r in caplog.records)
    # The hash can be stored again, as a regular file.
    assert s.put(h(1), make_page(1)) and same_bytes(s.get(h(1)), make_page(1))
    assert stat.S_ISREG(os.lstat(path).st_mode)


@pytest.mark.parametrize("name", list(ODD_FILES))
def test_put_replaces_an_odd_file_without_opening_it(tmp_path, name):
    make, _ = ODD_FILES[name]
    s = new_store(tmp_path)
    path = tmp_path / f"{h(2)}.page"
    make(path)
    assert _in_thread(lambda: s.put(h(2), make_page(2)))
    assert stat.S_ISREG(os.lstat(path).st_mode) and same_bytes(s.get(h(2)), make_page(2))
    assert s.stats["rejected"] == 1 and s.stats["pages_written"] == 1


def test_symlink_to_a_valid_page_elsewhere_is_not_followed(tmp_path):
    elsewhere = new_store(tmp_path / "elsewhere")
    elsewhere.put(h(3), make_page(3))
    target = tmp_path / "elsewhere" / f"{h(3)}.page"
    os.utime(target, ns=(1, 1))
    before = target.read_bytes()
    s = new_store(tmp_path / "s")
    link = tmp_path / "s" / f"{h(3)}.page"
    link.symlink_to(target)
    assert not s.contains(h(3))
    assert s.get(h(3)) is None
    assert not os.path.lexists(link)
    assert next((tmp_path / "s" / "quarantine").iterdir()).name.startswith(f"{h(3)}.symlink.")
    assert target.read_bytes() == before and target.stat().st_mtime_ns == 1  # neither read as a page nor touched
    link.symlink_to(target)
    assert s.put(h(3), make_page(3))  # the link is replaced by a file of its own; the target is left alone
    assert not link.is_symlink() and target.stat().st_mtime_ns == 1


def test_start_quarantines_odd_entries_named_like_pages(tmp_path):
    s = new_store(tmp_path)
    s.put(h(1), make_page(1))
    os.mkfifo(tmp_path / f"{h(2)}.page")
    (tmp_path / f"{h(3)}.page").symlink_to("/dev/zero")
    (tmp_path / f"{h(4)}.page").mkdir()
    os.mkfifo(tmp_path / "unrelated-fifo")  # not named like a page: left alone
    s = _in_thread(lambda: new_store(tmp_path))
    assert s.stats["rejected"] == 3 and s.stats["bytes_used"] == (tmp_path / f"{h(1)}.page").stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{h(1)}.page", "quarantine", "unrelated-fifo"])


def test_oversize_file_is_never_read(tmp_path, monkeypatch):
    s = new_store(tmp_path)
    s.put(h(1), make_page(1))
    path = tmp_path / f"{h(1)}.page"
    with path.open("ab") as f:
        f.truncate(1 << 30)
    reads = []
    real_read = os.read
    monkeypatch.setattr(store_mod.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    assert s.get(h(1)) is None
    assert reads == []


def test_read_stops_at_the_size_of_a_valid_page(tmp_path, monkeypatch):
    """A file that grows between the size check and the read (another writer appending) is still read no further
    than one byte past a valid page."""
    s = new_store(tmp_path)
    s.put(h(1), make_page(1))
    size = (tmp_path / f"{h(1)}.page").stat().st_size
    reads = []
    real_read = os.read

    def growing_read(fd, n):
        reads.append(n)
        return b"\0" * n  # an endless file

    monkeypatch.setattr(store_mod.os, "read", growing_read)
    assert s.get(h(1)) is None
    monkeypatch.setattr(store_mod.os, "read", real_read)
    assert sum(reads) == size + 1
    assert next((tmp_path / "quarantine").iterdir()).name.startswith(f"{h(1)}.oversize.")


@pytest.mark.parametrize("name", ["flipped payload byte", "truncated in the payload", "other fingerprint",
                                  "extra bytes", "empty file"])
def test_put_replaces_a_corrupt_page(tmp_path, name):
    corrupt, kind = CORRUPTIONS[name]
    s = new_store(tmp_path)
    s.put(h(9), make_page(9))
    path = tmp_path / f"{h(9)}.page"
    _rewrite(path, corrupt)
    s = new_store(tmp_path)  # a restart: the store knows the file only from the directory
    assert s.put(h(9), make_page(9))
    assert s.stats["pages_written"] == 1 and s.stats["rejected"] == 1
    assert [p.name.split(".")[:2] for p in (tmp_path / "quarantine").iterdir()] == [[h(9), kind.replace(" ", "-")]]
    assert same_bytes(new_store(tmp_path).get(h(9)), make_page(9))


def test_put_over_a_valid_page_neither_rewrites_nor_rejects(tmp_path):
    s = new_store(tmp_path)
    s.put(h(9), make_page(9))
    inode = (tmp_path / f"{h(9)}.page").stat().st_ino
    s = new_store(tmp_path)
    assert s.put(h(9), make_page(9))
    assert (s.stats["pages_written"], s.stats["rejected"]) == (0, 0)
    assert (tmp_path / f"{h(9)}.page").stat().st_ino == inode


def test_put_replaces_an_expired_page(tmp_path):
    clock = Clock()
    s = new_store(tmp_path, ttl_seconds=100.0, clock=clock)
    s.put(h(9), make_page(9))
    clock.t += 200
    assert s.put(h(9), make_page(9)) and s.stats["pages_written"] == 2 and s.stats["expired"] == 1
    assert s.get(h(9)) is not None


# ------------------------------------------------------------------------------------------------ LRU, budget, TTL


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 5)), max_size=30),
       capacity=st.integers(0, 4), extra=st.integers(0, 100))
def test_lru_matches_a_model(ops, capacity, extra):
    with tempfile.TemporaryDirectory() as d:
        size = len(new_store(Path(d) / "probe").codec.encode(h(0), make_page(0)))
        clock = Clock()
        s = new_store(Path(d) / "s", max_bytes=capacity * size + min(extra, size - 1), clock=clock)
        model: OrderedDict[int, None] = OrderedDict()
        for op, i in ops:
            clock.t += 1.0
            if op == "put":
                assert s.put(h(i), make_page(i)) == (capacity > 0)
                if capacity:
                    model[i] = None
                    model.move_to_end(i)
                    while len(model) > capacity:
                        model.popitem(last=False)
            else:
                got = s.get(h(i))
                assert (got is not None) == (i in model)
                if got is not None:
                    assert same_bytes(got, make_page(i))
                    model.move_to_end(i)
            assert sorted(p.name for p in (Path(d) / "s").glob("*.page")) == sorted(f"{h(j)}.page" for j in model)
            assert s.stats["bytes_used"] == len(model) * size
        # A restart recovers the access order: new pages evict in the model's order.
        s2 = new_store(Path(d) / "s", max_bytes=capacity * size + min(extra, size - 1), clock=clock)
        assert s2.stats["bytes_used"] == len(model) * size
        for j in range(100, 100 + capacity):
            clock.t += 1.0
            assert s2.put(h(j), make_page(j))
            model[j] = None
            while len(model) > capacity:
                model.popitem(last=False)
            assert sorted(p.name for p in (Path(d) / "s").glob("*.page")) == sorted(f"{h(k)}.page" for k in model)


def test_page_larger_than_budget(tmp_path):
    size = page_file_size(tmp_path)
    s = new_store(tmp_path / "s", max_bytes=size - 1)
    assert not s.put(h(1), make_page(1))
    assert s.stats["bytes_used"] == 0 and not s.stats["disabled"]


def test_ttl_counts_from_last_access(tmp_path):
    clock = Clock()
    s = new_store(tmp_path, ttl_seconds=100.0, clock=clock)
    s.put(h(1), make_page(1))
    s.put(h(2), make_page(2))
    clock.t += 90
    assert s.get(h(1)) is not None  # refreshes page 1 only
    clock.t += 20
    assert s.contains(h(1)) and not s.contains(h(2))
    assert s.get(h(2)) is None
    assert not (tmp_path / f"{h(2)}.page").exists()
    assert s.stats["expired"] == 1
    clock.t += 200
    s2 = new_store(tmp_path, ttl_seconds=100.0, clock=clock)  # expired pages are deleted at start too
    assert s2.stats["bytes_used"] == 0 and s2.stats["expired"] == 1
    assert list(tmp_path.glob("*.page")) == []


def test_restart_sees_pages_and_order(tmp_path):
    size = page_file_size(tmp_path)
    clock = Clock()
    s = new_store(tmp_path / "s", max_bytes=3 * size, clock=clock)
    for i in range(3):
        s.put(h(i), make_page(i))
    s.get(h(0))  # order now 1, 2, 0
    del s
    s = new_store(tmp_path / "s", max_bytes=3 * size, clock=clock)
    assert s.stats["bytes_used"] == 3 * size
    assert same_bytes(s.get(h(2)), make_page(2))  # order now 1, 0, 2
    s.put(h(3), make_page(3))
    s.put(h(4), make_page(4))
    assert [s.contains(h(i)) for i in range(5)] == [False, False, True, True, True]
    assert s.stats["evictions"] == 2


def test_restart_with_a_smaller_budget_evicts(tmp_path):
    size = page_file_size(tmp_path)
    s = new_store(tmp_path / "s")
    for i in range(4):
        s.put(h(i), make_page(i))
    s = new_store(tmp_path / "s", max_bytes=2 * size)
    assert [s.contains(h(i)) for i in range(4)] == [False, False, True, True]


def test_clear(tmp_path):
    s = new_store(tmp_path)
    for i in range(3):
        s.put(h(i), make_page(i))
    _rewrite(tmp_path / f"{h(0)}.page", lambda d: d[:-1])
    s.get(h(0))
    (tmp_path / "unrelated.txt").write_text("kept")
    s.clear()
    assert s.stats["bytes_used"] == 0 and not any(s.contains(h(i)) for i in range(3))
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["unrelated.txt"]


# ------------------------------------------------------------------------------------------------ degraded directories


@pytest.mark.parametrize("where", ["under a regular file", "/proc"])
def test_unwritable_directory_disables_with_one_warning(tmp_path, caplog, where):
    # chmod does not stop root: a path under a regular file, or under /proc, cannot be created by anyone.
    if where == "/proc":
        directory = Path("/proc/self/dsv41-cache")
    else:
        (tmp_path / "file").write_text("x")
        directory = tmp_path / "file" / "cache"
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.store"):
        s = new_store(directory)
        assert not s.put(h(1), make_page(1)) and not s.put(h(2), make_page(2))
        assert s.get(h(1)) is None and not s.contains(h(1))
        s.clear()
    assert s.stats["disabled"] is True
    assert len(caplog.records) == 1 and "persistence is off" in caplog.records[0].getMessage()


def test_full_disk_disables_with_one_warning_and_keeps_reading(tmp_path, caplog, monkeypatch):
    s = new_store(tmp_path)
    s.put(h(1), make_page(1))

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_mod, "_write_all", full)
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.store"):
        assert not s.put(h(2), make_page(2))
        assert not s.put(h(3), make_page(3))
    assert s.stats["disabled"] is True and len(caplog.records) == 1 and "ENOSPC" in caplog.records[0].getMessage()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{h(1)}.page"]  # no temp file left behind
    assert same_bytes(s.get(h(1)), make_page(1))  # what is on disk still serves


# ------------------------------------------------------------------------------------------------ shared directory


def test_two_stores_share_a_directory(tmp_path):
    size = page_file_size(tmp_path)
    a = new_store(tmp_path / "s", max_bytes=2 * size)
    b = new_store(tmp_path / "s", max_bytes=2 * size)
    a.put(h(1), make_page(1))
    assert b.contains(h(1)) and same_bytes(b.get(h(1)), make_page(1))
    assert b.stats["bytes_used"] == size  # b now accounts for the page it read
    b.put(h(2), make_page(2))
    b.put(h(3), make_page(3))  # evicts page 1 under a
    assert a.get(h(1)) is None and a.stats["bytes_used"] == 0
    # b replaces a file a knows: a reads the new one.
    a.put(h(2), make_page(2))
    b.clear()
    b.put(h(2), make_page(2))
    assert same_bytes(a.get(h(2)), make_page(2))
    assert a.stats["rejected"] == b.stats["rejected"] == 0
    # A page another store already wrote is not written again, but counted and kept in LRU order.
    a.put(h(5), make_page(5))
    written = b.stats["pages_written"]
    assert b.put(h(5), make_page(5)) and b.stats["pages_written"] == written
    assert b.stats["bytes_used"] == 2 * size


def test_concurrent_writers_of_the_same_pages(tmp_path):
    stores = [new_store(tmp_path) for _ in range(4)]
    errors = []

    def work(s: PageStore, k: int):
        try:
            for i in range(20):
                j = (i + k) % 10
                assert s.put(h(j), make_page(j))
                # Another store may replace the file at any moment: the rename is atomic, so a read sees one whole file.
                assert same_bytes(s.get(h(j)), make_page(j))
        except AssertionError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s, k)) for k, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{h(j)}.page" for j in range(10))
    assert all(same_bytes(stores[0].get(h(j)), make_page(j)) for j in range(10))
    assert sum(s.stats["rejected"] for s in stores) == 0
