"""SwaPool: round trips of snapshots, copies, capacity + LRU against a model, TTL, threads (SPEC.md §4.3)."""

import threading
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepseek_v41.cache.swa_pool import SwaPool, default_swa_pool_bytes


class Clock:
    def __init__(self, t: float = 50.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def snapshot(seed: int, rows: int = 8) -> dict[str, torch.Tensor]:
    """A snapshot of every kind the engine stores: uint8 window rows, int32 positions, residuals in several dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "window.0": torch.randint(0, 256, (rows, 72), dtype=torch.uint8, generator=g),
        "positions": torch.arange(seed, seed + rows, dtype=torch.int32),
        "residual.bf16": torch.randn(rows, 16, generator=g).to(torch.bfloat16),
        "residual.f64": torch.randn(rows, 16, generator=g, dtype=torch.float64),
        "residual.f32": torch.randn(rows, 3, generator=g),
    }


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def nbytes(snap: dict) -> int:
    return sum(t.numel() * t.element_size() for t in snap.values())


@pytest.mark.parametrize("snap", [
    snapshot(1),
    {},
    {"empty": torch.empty(0, 72, dtype=torch.uint8), "scalar": torch.tensor(2.5, dtype=torch.float64)},
    {"large": torch.ones(4096, 1024, dtype=torch.bfloat16)},
], ids=["mixed", "empty-dict", "empty-tensor", "large"])
def test_round_trip(snap):
    pool = SwaPool(1 << 30)
    assert pool.put("k", snap)
    assert pool.contains("k")
    assert same(pool.get("k"), snap)
    assert pool.occupancy_bytes == nbytes(snap)
    stats = pool.stats
    assert stats.pop("read_seconds") >= 0
    assert stats == dict(hits=1, misses=0, puts=1, evictions=0, expired=0, entries=1,
                         occupancy_bytes=nbytes(snap), read_bytes=nbytes(snap))


def test_hits_count_the_bytes_copied_out_and_the_seconds():
    """read_bytes / read_seconds (dsv41:prefix_cache_read_*_total{tier="swa_pool"}): the tensor bytes of every
    snapshot a get returned and the time its copy took; misses read nothing."""
    pool = SwaPool(1 << 30)
    big = {"window.0": torch.ones(2048, 1024, dtype=torch.uint8), "positions": torch.arange(2048, dtype=torch.int32)}
    assert pool.put("a", big) and pool.put("b", snapshot(1))
    assert pool.get("missing") is None
    assert pool.stats["read_bytes"] == 0 and pool.stats["read_seconds"] == 0
    pool.get("a")
    first = pool.stats["read_seconds"]
    assert pool.stats["read_bytes"] == nbytes(big) and first > 0
    pool.get("a")
    pool.get("b")
    assert pool.stats["read_bytes"] == 2 * nbytes(big) + nbytes(snapshot(1)) and pool.stats["read_seconds"] > first
    assert pool.read_tier == "swa_pool"


def test_stores_and_returns_copies():
    pool = SwaPool(1 << 20)
    snap = snapshot(2)
    expected = {k: v.clone() for k, v in snap.items()}
    snap["strided"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    expected["strided"] = snap["strided"].clone()
    pool.put("k", snap)
    for t in snap.values():
        t.zero_()  # the engine reuses its buffers
    got = pool.get("k")
    assert same(got, expected)
    for t in got.values():
        t.zero_()  # so may whoever gets it
    assert same(pool.get("k"), expected)


def test_capacity_zero_disables():
    pool = SwaPool(0)
    assert not pool.put("k", snapshot(3)) and not pool.put("e", {})
    assert pool.get("k") is None and pool.get("e") is None and not pool.contains("k")
    assert pool.occupancy_bytes == 0 and pool.capacity_bytes == 0


def test_too_large_is_refused_and_drops_the_old_value():
    snap = snapshot(4)
    pool = SwaPool(nbytes(snap))
    assert pool.put("k", snap)
    assert not pool.put("k", snapshot(4, rows=9))
    assert pool.get("k") is None and pool.occupancy_bytes == 0


def test_not_a_snapshot():
    with pytest.raises(TypeError):
        SwaPool(100).put("k", {"a": [1, 2]})
    with pytest.raises(ValueError):
        SwaPool(-1)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "contains"]), st.integers(0, 7), st.integers(0, 6)),
                    max_size=40),
       capacity=st.integers(0, 3000))
def test_lru_matches_a_model(ops, capacity):
    pool = SwaPool(capacity, ttl_seconds=1e9)
    model: OrderedDict[int, int] = OrderedDict()  # key -> rows
    for op, key, rows in ops:
        if op == "put":
            snap = snapshot(key, rows)
            size = nbytes(snap)
            fits = capacity > 0 and size <= capacity
            assert pool.put(str(key), snap) == fits
            model.pop(key, None)
            if fits:
                while sum(nbytes(snapshot(k, r)) for k, r in model.items()) + size > capacity:
                    model.popitem(last=False)
                model[key] = rows
        elif op == "get":
            got = pool.get(str(key))
            assert (got is not None) == (key in model)
            if got is not None:
                assert same(got, snapshot(key, model[key]))
                model.move_to_end(key)
        else:
            assert pool.contains(str(key)) == (key in model)
        assert pool.occupancy_bytes == sum(nbytes(snapshot(k, r)) for k, r in model.items()) <= capacity


def test_ttl_counts_from_last_access():
    clock = Clock()
    pool = SwaPool(1 << 20, ttl_seconds=300.0, clock=clock)
    pool.put("a", snapshot(1))
    pool.put("b", snapshot(2))
    clock.t += 200
    assert pool.get("a") is not None
    clock.t += 150
    assert pool.contains("a") and not pool.contains("b")
    assert pool.get("b") is None
    assert pool.occupancy_bytes == nbytes(snapshot(1))
    clock.t += 301
    assert pool.get("a") is None
    stats = pool.stats
    assert stats.pop("read_seconds") > 0
    assert stats == dict(hits=1, misses=2, puts=2, evictions=0, expired=2, entries=0, occupancy_bytes=0,
                         read_bytes=nbytes(snapshot(1)))


def test_threads():
    snaps = [snapshot(i, rows=4) for i in range(16)]
    pool = SwaPool(5 * nbytes(snaps[0]))
    errors = []

    def work(k: int):
        for i in range(300):
            j = (i * 7 + k) % 16
            if i % 2:
                pool.put(str(j), snaps[j])
            else:
                got = pool.get(str(j))
                if got is not None and not same(got, snaps[j]):
                    errors.append(j)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = pool.stats
    assert stats["entries"] == 5 and stats["occupancy_bytes"] == 5 * nbytes(snaps[0]) == pool.occupancy_bytes
    assert stats["puts"] == 8 * 150 and stats["hits"] + stats["misses"] == 8 * 150


def test_default_pool_bytes_is_a_tenth_of_ram():
    with open("/proc/meminfo") as f:
        mem_total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    value = default_swa_pool_bytes()
    assert 0 < value <= mem_total // 10 + 4096
