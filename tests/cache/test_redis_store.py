"""RedisStore against a real redis-server: sharing by namespace, TTL through Redis, the page index, failures
(SPEC.md §4.3)."""

import logging
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch
from optional_deps import require

from deepseek_v41.cache.swa_pool import SwaPool


@pytest.fixture
def store_cls():
    require("redis")
    from deepseek_v41.cache.redis_store import RedisStore

    return RedisStore


@pytest.fixture
def namespace():
    return f"fp-{uuid.uuid4().hex}"


def snapshot(seed: int, rows: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "window.0": torch.randint(0, 256, (rows, 72), dtype=torch.uint8, generator=g),
        "positions": torch.arange(seed, seed + rows, dtype=torch.int32),
        "residual.bf16": torch.randn(rows, 16, generator=g).to(torch.bfloat16),
        "residual.f64": torch.randn(rows, 16, generator=g, dtype=torch.float64),
        "strided": torch.randn(4, rows, generator=g).t(),
        "empty": torch.empty(0, 3),
    }


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_same_namespace_shares_snapshots_and_pages(redis_url, store_cls, namespace):
    a, b = store_cls(redis_url, namespace), store_cls(redis_url, namespace)
    snap = snapshot(1)
    assert a.put("blk", snap)
    assert b.contains("blk") and same(b.get("blk"), snap)
    assert b.get("other") is None
    assert a.put("blk", snapshot(2)) and same(b.get("blk"), snapshot(2))  # a put replaces
    assert a.put("empty", {}) and b.get("empty") == {}
    a.add_pages(["ab" * 32, "cd" * 32])
    assert b.has_page("ab" * 32) and b.has_page("cd" * 32) and not b.has_page("ef" * 32)
    b.remove_page("ab" * 32)
    assert not a.has_page("ab" * 32) and a.has_page("cd" * 32)
    assert a.stats == dict(hits=0, misses=0, puts=3, errors=0)
    assert b.stats == dict(hits=3, misses=1, puts=0, errors=0)


def test_other_namespace_sees_nothing(redis_url, store_cls, namespace):
    a, b = store_cls(redis_url, namespace), store_cls(redis_url, namespace + "-other-model")
    a.put("blk", snapshot(1))
    a.add_pages(["ab" * 32])
    assert b.get("blk") is None and not b.contains("blk") and not b.has_page("ab" * 32)
    assert b.occupancy_bytes == 0
    glob = store_cls(redis_url, "fp*")  # glob characters in a namespace are literal
    assert glob.occupancy_bytes == 0


def test_same_api_as_swa_pool(store_cls):
    public = {n for n in dir(SwaPool) if not n.startswith("_")} - {"capacity_bytes"}
    assert public <= set(dir(store_cls))


def test_occupancy_counts_serialized_bytes(redis_url, store_cls, namespace):
    import redis
    import safetensors.torch

    s = store_cls(redis_url, namespace)
    for i in range(3):
        s.put(f"k{i}", snapshot(i))
    raw = redis.Redis.from_url(redis_url)
    assert s.occupancy_bytes == sum(len(raw.get(f"dsv41:{namespace}:swa:k{i}")) for i in range(3))
    # The stored value is a plain safetensors file: no pickle on the wire.
    assert same(safetensors.torch.load(raw.get(f"dsv41:{namespace}:swa:k0")), snapshot(0))


def test_ttl_through_redis_expire(redis_url, store_cls, namespace):
    import redis

    raw = redis.Redis.from_url(redis_url)
    s = store_cls(redis_url, namespace, ttl_seconds=0.8)
    s.put("k", snapshot(1))
    key = f"dsv41:{namespace}:swa:k"
    assert 0 < raw.pttl(key) <= 800
    time.sleep(0.4)
    assert s.get("k") is not None  # a hit restarts the TTL
    assert raw.pttl(key) > 600
    time.sleep(0.4)
    assert s.contains("k")  # 0.8 s after the put, 0.4 s after the hit
    time.sleep(0.5)
    assert s.get("k") is None and not s.contains("k")


def test_page_index_ttl(redis_url, store_cls, namespace):
    import redis

    t = [1000.0]
    s = store_cls(redis_url, namespace, page_ttl_seconds=100.0, clock=lambda: t[0])
    s.add_pages(["01"])
    t[0] += 60
    s.add_pages(["02"])
    assert s.has_page("01") and s.has_page("02")
    t[0] += 60
    assert not s.has_page("01") and s.has_page("02")
    s.add_pages(["03"])  # trims entries older than the TTL
    assert redis.Redis.from_url(redis_url).zcard(f"dsv41:{namespace}:pages") == 2
    s.add_pages([])


def test_unreadable_value_is_a_miss_and_deleted(redis_url, store_cls, namespace, caplog):
    import redis

    raw = redis.Redis.from_url(redis_url)
    raw.set(f"dsv41:{namespace}:swa:k", b"not a safetensors file")
    s = store_cls(redis_url, namespace)
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.redis_store"):
        assert s.get("k") is None
    assert raw.exists(f"dsv41:{namespace}:swa:k") == 0
    assert len(caplog.records) == 1


def test_connection_refused_is_a_miss_with_one_warning(store_cls, caplog):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = store_cls(f"redis://127.0.0.1:{port}/0", "fp")
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.redis_store"):
        assert not s.put("k", snapshot(1))
        assert s.get("k") is None and not s.contains("k")
        s.add_pages(["ab"])
        assert not s.has_page("ab")
        s.remove_page("ab")
        assert s.occupancy_bytes == 0
    assert len(caplog.records) == 1 and "Redis" in caplog.records[0].getMessage()
    assert s.stats["errors"] == 1  # later calls skip Redis until the retry delay has passed
    assert s.stats["misses"] == 1


def test_reconnects_after_the_retry_delay(redis_url, store_cls, namespace, caplog, monkeypatch):
    import deepseek_v41.cache.redis_store as redis_store_mod

    t = [0.0]
    s = store_cls(redis_url, namespace, clock=lambda: t[0])
    good = s._redis
    s._redis = redis_store_mod.redis.Redis.from_url("redis://127.0.0.1:1/0")
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.redis_store"):
        assert not s.put("k", snapshot(1))
        s._redis = good  # the server is back
        assert not s.put("k", snapshot(1))  # still inside the retry delay
        t[0] += redis_store_mod.RETRY_SECONDS + 1
        assert s.put("k", snapshot(1)) and s.get("k") is not None
    assert len(caplog.records) == 1


def test_two_processes_share_one_redis(redis_url, store_cls, namespace):
    code = (
        "import sys, torch; from deepseek_v41.cache.redis_store import RedisStore; "
        "s = RedisStore(sys.argv[1], sys.argv[2]); "
        "x = {'x': torch.arange(5, dtype=torch.int32), 'y': torch.ones(2, dtype=torch.bfloat16)}; "
        "assert s.put('from-child', x); "
        "s.add_pages(['0a0b']); "
        "got = s.get('from-parent'); print(got['z'].tolist())"
    )
    parent = store_cls(redis_url, namespace)
    parent.put("from-parent", {"z": torch.tensor([1.5, -2.0], dtype=torch.float64)})
    out = subprocess.run([sys.executable, "-c", code, redis_url, namespace], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.5, -2.0]"
    assert same(parent.get("from-child"), {"x": torch.arange(5, dtype=torch.int32),
                                           "y": torch.ones(2, dtype=torch.bfloat16)})
    assert parent.has_page("0a0b")


def test_namespace_is_required(store_cls):
    with pytest.raises(ValueError, match="fingerprint"):
        store_cls("redis://127.0.0.1:1/0", "")
    with pytest.raises(ValueError):
        store_cls("redis://127.0.0.1:1/0", "fp x")
