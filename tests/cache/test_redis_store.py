"""RedisStore against a real redis-server: sharing by namespace, TTL through Redis, pages, failures, a Redis that
does not answer (SPEC.md §4.3, issue 22 items 9 and 11)."""

import contextlib
import logging
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import safetensors.torch
import torch
from optional_deps import require

from deepseek_v41.cache.swa_pool import SwaPool, copy_snapshot


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
    assert a.put("blk", snap) and a.flush()
    assert b.contains("blk") and same(b.get("blk"), snap)
    assert b.get("other") is None
    assert a.put("blk", snapshot(2)) and a.flush() and same(b.get("blk"), snapshot(2))  # a put replaces
    assert a.put("empty", {}) and a.flush() and b.get("empty") == {}
    assert a.put_page("ab" * 32, b"page ab") and a.put_page("cd" * 32, b"page cd") and a.flush()
    assert b.get_page("ab" * 32) == b"page ab" and b.get_page("cd" * 32) == b"page cd"
    assert b.get_page("ef" * 32) is None
    b.delete_page("ab" * 32)
    assert b.flush() and a.get_page("ab" * 32) is None and a.get_page("cd" * 32) == b"page cd"
    zero = dict(hits=0, misses=0, puts=0, errors=0, dropped=0, unavailable=0, pages_read=0, pages_written=0,
                read_bytes=0)
    a_stats, b_stats = a.stats, b.stats
    assert a_stats.pop("read_seconds") == 0 and b_stats.pop("read_seconds") > 0  # get_page alone counts no read
    snapshot_bytes = sum(len(safetensors.torch.save(copy_snapshot(snapshot(i)))) for i in (1, 2))
    assert a_stats == {**zero, "puts": 3, "pages_written": 2, "pages_read": 1}
    assert b_stats == {**zero, "hits": 3, "misses": 1, "pages_read": 2,
                       "read_bytes": snapshot_bytes + len(safetensors.torch.save({}))}


def test_other_namespace_sees_nothing(redis_url, store_cls, namespace):
    a, b = store_cls(redis_url, namespace), store_cls(redis_url, namespace + "-other-model")
    a.put("blk", snapshot(1))
    a.put_page("ab" * 32, b"page")
    a.flush()
    assert b.get("blk") is None and not b.contains("blk") and b.get_page("ab" * 32) is None
    assert b.occupancy_bytes == 0
    glob = store_cls(redis_url, "fp*")  # glob characters in a namespace are literal
    assert glob.occupancy_bytes == 0


def test_same_api_as_swa_pool(store_cls):
    # clear: the in-memory pool's reset (reset_prefix_cache); a Redis pool is a persistent tier it leaves alone.
    public = {n for n in dir(SwaPool) if not n.startswith("_")} - {"capacity_bytes", "clear"}
    assert public <= set(dir(store_cls))


def test_occupancy_counts_serialized_bytes(redis_url, store_cls, namespace):
    import redis
    import safetensors.torch

    s = store_cls(redis_url, namespace)
    for i in range(3):
        s.put(f"k{i}", snapshot(i))
    assert s.occupancy_bytes == 0  # not measured yet: the first read queues a measurement, never waits for it
    s.flush()
    raw = redis.Redis.from_url(redis_url)
    assert s.occupancy_bytes == sum(len(raw.get(f"dsv41:{namespace}:swa:k{i}")) for i in range(3))
    # The stored value is a plain safetensors file: no pickle on the wire.
    assert same(safetensors.torch.load(raw.get(f"dsv41:{namespace}:swa:k0")), snapshot(0))


def test_ttl_through_redis_expire(redis_url, store_cls, namespace):
    import redis

    raw = redis.Redis.from_url(redis_url)
    s = store_cls(redis_url, namespace, ttl_seconds=0.8)
    s.put("k", snapshot(1))
    s.flush()
    key = f"dsv41:{namespace}:swa:k"
    assert 0 < raw.pttl(key) <= 800
    time.sleep(0.4)
    assert s.get("k") is not None  # a hit restarts the TTL
    assert raw.pttl(key) > 600
    time.sleep(0.4)
    assert s.contains("k")  # 0.8 s after the put, 0.4 s after the hit
    time.sleep(0.5)
    assert s.get("k") is None and not s.contains("k")


def test_page_ttl_through_redis_expire(redis_url, store_cls, namespace):
    import redis

    raw = redis.Redis.from_url(redis_url)
    s = store_cls(redis_url, namespace, page_ttl_seconds=100.0)
    s.put_page("01", b"x")
    s.flush()
    assert 99_000 < raw.pttl(f"dsv41:{namespace}:page:01") <= 100_000
    raw.pexpire(f"dsv41:{namespace}:page:01", 5000)
    assert s.get_page("01") == b"x" and raw.pttl(f"dsv41:{namespace}:page:01") > 99_000  # a hit restarts it


def test_unreadable_value_is_a_miss_and_deleted(redis_url, store_cls, namespace, caplog):
    import redis

    raw = redis.Redis.from_url(redis_url)
    raw.set(f"dsv41:{namespace}:swa:k", b"not a safetensors file")
    s = store_cls(redis_url, namespace)
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.redis_store"):
        assert s.get("k") is None
    s.flush()
    assert raw.exists(f"dsv41:{namespace}:swa:k") == 0
    assert len(caplog.records) == 1


def test_connection_refused_is_a_miss_with_one_warning(store_cls, caplog):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = store_cls(f"redis://127.0.0.1:{port}/0", "fp")
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.redis_store"):
        assert s.get("k") is None
        assert not s.put("k", snapshot(1)) and not s.contains("k")
        assert not s.put_page("ab", b"x") and s.get_page("ab") is None
        s.delete_page("ab")
        assert s.occupancy_bytes == 0 and s.flush()
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1
    # Later calls skip Redis until a background check finds it back.
    assert (s.stats["errors"], s.stats["misses"], s.stats["unavailable"], s.stats["dropped"]) == (1, 1, 2, 3)


def test_reconnects_after_the_retry_delay(redis_url, store_cls, namespace, caplog):
    import deepseek_v41.cache.redis_store as redis_store_mod

    t = [0.0]
    s = store_cls(redis_url, namespace, clock=lambda: t[0])
    s.flush()
    good = s._redis
    s._redis = redis_store_mod.redis.Redis.from_url("redis://127.0.0.1:1/0")
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.redis_store"):
        assert s.get("k") is None
        s._redis = good  # the server is back
        assert not s.put("k", snapshot(1))  # still inside the retry delay: not even checked
        assert s.get("k") is None
        t[0] += redis_store_mod.RETRY_SECONDS + 1
        assert s.get("k") is None  # starts one background check, answers a miss at once
        deadline = time.monotonic() + 10
        while not s.put("k", snapshot(1)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert s.flush() and s.get("k") is not None
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_two_processes_share_one_redis(redis_url, store_cls, namespace):
    code = (
        "import sys, torch; from deepseek_v41.cache.redis_store import RedisStore; "
        "s = RedisStore(sys.argv[1], sys.argv[2]); "
        "x = {'x': torch.arange(5, dtype=torch.int32), 'y': torch.ones(2, dtype=torch.bfloat16)}; "
        "assert s.put('from-child', x); "
        "assert s.put_page('0a0b', b'page'); assert s.flush(); "
        "got = s.get('from-parent'); print(got['z'].tolist())"
    )
    parent = store_cls(redis_url, namespace)
    parent.put("from-parent", {"z": torch.tensor([1.5, -2.0], dtype=torch.float64)})
    parent.flush()
    out = subprocess.run([sys.executable, "-c", code, redis_url, namespace], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.5, -2.0]"
    assert same(parent.get("from-child"), {"x": torch.arange(5, dtype=torch.int32),
                                           "y": torch.ones(2, dtype=torch.bfloat16)})
    assert parent.get_page("0a0b") == b"page"


def test_namespace_is_required(store_cls):
    with pytest.raises(ValueError, match="fingerprint"):
        store_cls("redis://127.0.0.1:1/0", "")
    with pytest.raises(ValueError):
        store_cls("redis://127.0.0.1:1/0", "fp x")


# ------------------------------------------------------------------------------------------------ a frozen Redis


class SilentServer:
    """A TCP server that accepts connections and never answers: a frozen Redis (SIGSTOPped, or a stuck host)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        self.conns = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self):
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        self.sock.close()
        self.thread.join(5)
        for c in self.conns:
            c.close()


@pytest.fixture
def silent():
    server = SilentServer()
    yield server
    server.close()


def test_a_frozen_redis_costs_one_bounded_wait_then_nothing(silent, store_cls, caplog):
    s = store_cls(silent.url, "fp", read_timeout=0.3)
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.redis_store"):
        start = time.monotonic()
        assert s.get("k") is None
        assert time.monotonic() - start < 1.0  # one read waits read_timeout, not the socket timeouts
        start = time.monotonic()
        for i in range(200):  # marked down: no more waiting
            assert s.get(f"k{i}") is None and s.get_page(f"{i:x}") is None and not s.contains("k")
            assert not s.put(f"k{i}", snapshot(1)) and not s.put_page(f"{i:x}", b"x")
        assert time.monotonic() - start < 0.5
    assert s.stats["errors"] >= 1 and s.stats["unavailable"] == 600 and s.stats["dropped"] == 400
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1


def test_writes_to_a_frozen_redis_never_block_the_caller_and_are_bounded(silent, store_cls, monkeypatch):
    import deepseek_v41.cache.redis_store as redis_store_mod

    monkeypatch.setattr(redis_store_mod, "SOCKET_TIMEOUT_SECONDS", 0.3)
    s = store_cls(silent.url, "fp", max_pending_bytes=1000)
    start = time.monotonic()
    queued = [s.put_page(f"{i:x}", b"x" * 300) for i in range(50)]
    assert time.monotonic() - start < 0.2
    assert 1 <= sum(queued) <= 4  # the queue holds 1000 bytes (and the one being sent)
    assert s.flush(timeout=10)  # the stuck write times out on the socket, the rest is dropped
    assert s.stats["errors"] >= 1 and s.stats["pages_written"] == 0


def test_a_redis_stopped_mid_run_is_a_miss_and_comes_back(redis_server, store_cls, monkeypatch):
    import signal

    import deepseek_v41.cache.redis_store as redis_store_mod

    monkeypatch.setattr(redis_store_mod, "RETRY_SECONDS", 0.5)
    proc, url = redis_server
    s = store_cls(url, "fp", read_timeout=0.3)
    assert s.put_page("0a", b"page") and s.flush()
    assert s.get_page("0a") == b"page"
    proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert s.get_page("0a") is None and s.get_page("0a") is None
        assert time.monotonic() - start < 1.0 and s.stats["errors"] == 1 and s.stats["unavailable"] == 1
    finally:
        proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + redis_store_mod.RETRY_SECONDS + 10
    while s.get_page("0a") is None:  # a background check finds it back after RETRY_SECONDS
        assert time.monotonic() < deadline
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------ pages


def test_pages_round_trip_and_bad_values_are_deleted(redis_url, store_cls, namespace, caplog):
    import redis

    from deepseek_v41.cache.redis_store import RedisPages
    from deepseek_v41.cache.store import PageCodec

    layout = {"main.0": ((4, 72), "uint8"), "index.0": ((4, 36), "uint8")}
    g = torch.Generator().manual_seed(0)
    page = {"main.0": torch.randint(0, 256, (4, 72), dtype=torch.uint8, generator=g),
            "index.0": torch.randint(0, 256, (4, 36), dtype=torch.uint8, generator=g)}
    a = RedisPages(store_cls(redis_url, namespace), PageCodec("f" * 64, layout))
    b = RedisPages(store_cls(redis_url, namespace), PageCodec("f" * 64, layout))
    other_model = RedisPages(store_cls(redis_url, namespace), PageCodec("e" * 64, layout))
    hashes = [f"{i:064x}" for i in range(4)]
    for h in hashes:
        assert a.put(h, page)
    assert a.flush()
    assert same(b.get(hashes[0]), page)
    raw = redis.Redis.from_url(redis_url)
    key = f"dsv41:{namespace}:page:"
    data = raw.get(key + hashes[1])
    # read_bytes / read_seconds (dsv41:prefix_cache_read_*_total{tier="remote"}): the page value's bytes and
    # the time of its GET and decode; misses and the rejected values below count nothing.
    assert b.get("ab" * 32) is None
    read = b.stats
    assert read["read_bytes"] == len(data) and read["read_seconds"] > 0 and b.store.read_tier == "remote"
    raw.set(key + hashes[1], data[:-1] + bytes([data[-1] ^ 1]))  # a flipped payload bit
    raw.set(key + hashes[2], data + b"\0" * 10)  # oversize
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.cache.redis_store"):
        assert b.get(hashes[1]) is None and b.get(hashes[2]) is None
        assert other_model.get(hashes[3]) is None  # a page of another model (same namespace, by mistake)
    b.flush()
    other_model.flush()
    assert raw.exists(key + hashes[1], key + hashes[2], key + hashes[3]) == 0
    assert b.stats["rejected"] == 2 and other_model.stats["rejected"] == 1
    assert b.stats["read_bytes"] == len(data) and b.stats["read_seconds"] == read["read_seconds"]
    assert other_model.stats["read_bytes"] == 0
    assert len(caplog.records) == 3
    with pytest.raises(ValueError, match="layout"):
        a.put(hashes[0], {"main.0": page["main.0"]})
