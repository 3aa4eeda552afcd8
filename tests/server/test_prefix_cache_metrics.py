"""/metrics of the prefix cache against live servers: the SWA pool occupancy gauge is a 0..1 fraction of the pool's
capacity (it used to read a key the engine never sets and stayed 0), and the hit counters grow by path
(snapshot / replay, in tokens) and by tier (device / disk, in pages) when a long prompt is repeated; the read
counters show what each tier read and for how long (bytes per page file, SWA snapshot or Redis value), and replays
count once per hit with the replayed tokens."""

import httpx
import pytest
from serving_helpers import KEYS, MODEL, auth, metrics, start_server


def complete(server, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    response = httpx.post(server.v1 + "/completions", json=body, headers=auth(KEYS[0]), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def value(values, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def gained(before, after, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


READ_TIERS = ("disk", "swa_pool", "remote")


def reads(before, after) -> dict[str, tuple[float, float]]:
    """Per tier, the growth of (read bytes, read seconds) between two scrapes."""
    return {tier: (gained(before, after, "dsv41:prefix_cache_read_bytes_total", tier=tier),
                   gained(before, after, "dsv41:prefix_cache_read_seconds_total", tier=tier)) for tier in READ_TIERS}


def replays(before, after) -> tuple[float, float, float, float]:
    """Growth of (replays, replayed prompt tokens, replay-length histogram count, its sum)."""
    return (gained(before, after, "dsv41:prefix_cache_replays_total"),
            gained(before, after, "dsv41:prompt_tokens_replayed_total"),
            gained(before, after, "dsv41:prefix_cache_replay_tokens_count"),
            gained(before, after, "dsv41:prefix_cache_replay_tokens_sum"))


def bounded_replay(live, usage: dict) -> int:
    """Tokens a new request's bounded replay recomputes (SPEC.md §4.3): from max(0, L' - w), at most its decoder
    start max(0, N - w), up to the cached length L'."""
    window = live.llm.engine.cache.config.sliding_window
    cached, n = usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]
    return cached - min(max(0, cached - window), max(0, n - window))


def test_swa_pool_occupancy_and_snapshot_hits(server, monkeypatch):
    prompt = "The city is Paris, 123. Snapshot metrics test. " * 12  # many full pages
    pool = server.llm.engine.prefix_cache.swa_pool
    returned: list[int] = []  # the tensor bytes of every snapshot the pool hands out

    def get(key, real=pool.get):
        snapshot = real(key)
        returned.extend(t.numel() * t.element_size() for t in (snapshot or {}).values())
        return snapshot

    monkeypatch.setattr(pool, "get", get)
    before = metrics(server.url)
    complete(server, prompt)
    usage = complete(server, prompt)
    after = metrics(server.url)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0

    used, capacity = value(after, "dsv41:swa_pool_used_bytes"), value(after, "dsv41:swa_pool_capacity_bytes")
    assert used == pool.occupancy_bytes > 0 and capacity == pool.capacity_bytes > 0
    occupancy = value(after, "dsv41:swa_pool_occupancy")
    assert 0 < occupancy <= 1 and occupancy == pytest.approx(used / capacity)
    # The repeat restored the window from a snapshot: its cached tokens count under path="snapshot".
    gained = {path: value(after, "dsv41:prefix_cache_hits_total", path=path)
              - value(before, "dsv41:prefix_cache_hits_total", path=path) for path in ("snapshot", "replay")}
    assert gained == {"snapshot": cached, "replay": 0}
    assert value(after, "dsv41:swa_pool_snapshots_total", event="hit") > value(before, "dsv41:swa_pool_snapshots_total",
                                                                              event="hit")
    assert value(after, "dsv41:prefix_cache_page_hits_total", tier="device") \
        >= value(before, "dsv41:prefix_cache_page_hits_total", tier="device") + cached // 16
    queried = value(after, "dsv41:prefix_cache_queries_total") - value(before, "dsv41:prefix_cache_queries_total")
    assert queried == 2 * usage["prompt_tokens"]
    # The snapshot copied out of the host pool counts its tensor bytes under tier="swa_pool"; nothing else read.
    read = reads(before, after)
    assert read["swa_pool"][0] == sum(returned) > 0 and read["swa_pool"][1] > 0
    assert read["disk"] == read["remote"] == (0, 0)
    assert replays(before, after) == (0, 0, 0, 0)  # a snapshot hit replays nothing


def test_replay_hits_from_disk_without_a_pool(model_dir, tmp_path):
    live = start_server(model_dir, cache_dir=str(tmp_path / "cache"), swa_pool_bytes=0)
    try:
        prompt = "Hello world! The city is Paris, 123. Disk tier test. " * 10
        complete(live, prompt)
        prefix_cache = live.llm.engine.prefix_cache
        prefix_cache.flush()
        prefix_cache.drop_device_tier()  # the engine is idle: the repeat must load its pages from disk
        before = metrics(live.url)
        usage = complete(live, prompt)
        values = metrics(live.url)
        text = httpx.get(live.url + "/metrics", timeout=10).text
        page_file = next(prefix_cache.page_store.directory.glob("*.page")).stat().st_size
        expected_replay = bounded_replay(live, usage)
    finally:
        live.stop()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    # Every page the hit loaded was read from its file: page-file bytes under tier="disk", in measurable time.
    read = reads(before, values)
    assert read["disk"][0] == (cached // 16) * page_file and read["disk"][1] > 0
    assert read["swa_pool"] == read["remote"] == (0, 0)
    # One replay, of the bounded replay's length, in the counter, the replayed tokens and the histogram.
    assert 0 < expected_replay <= cached
    assert replays(before, values) == (1, expected_replay, 1, expected_replay)
    for series in ('dsv41:prefix_cache_read_bytes_total{model_name="tiny",tier="disk"}',
                   'dsv41:prefix_cache_read_seconds_total{model_name="tiny",tier="swa_pool"}',
                   'dsv41:prefix_cache_read_bytes_total{model_name="tiny",tier="remote"}',
                   'dsv41:prefix_cache_replays_total{model_name="tiny"}',
                   'dsv41:prefix_cache_replay_tokens_count{model_name="tiny"}'):
        assert series in text, series
    assert value(values, "dsv41:prefix_cache_hits_total", path="replay") == cached
    assert value(values, "dsv41:prefix_cache_hits_total", path="snapshot") == 0
    assert value(values, "dsv41:prefix_cache_page_hits_total", tier="disk") == cached // 16
    assert value(values, "dsv41:prefix_cache_pages_written_total", tier="disk") > 0
    assert value(values, "dsv41:prefix_cache_disk_bytes") > 0
    # No pool: capacity 0 and the occupancy fraction 0 (not a division by zero).
    assert value(values, "dsv41:swa_pool_capacity_bytes") == value(values, "dsv41:swa_pool_occupancy") == 0


def test_redis_reads_count_once_under_remote(model_dir, redis_url):
    """Redis serves the pages and (as the SWA pool) the snapshots: its reads count under tier="remote", once
    (the store plays both roles), and the page values' bytes are those of the page format."""
    live = start_server(model_dir, redis_url=redis_url)
    try:
        prompt = "Redis tier test: the city is Paris, 123. " * 12
        complete(live, prompt)
        prefix_cache = live.llm.engine.prefix_cache
        prefix_cache.flush()
        prefix_cache.drop_device_tier()  # the repeat loads its pages (and its snapshot) from Redis
        store = prefix_cache.remote_pages.store
        store_before = store.stats["read_bytes"]
        before = metrics(live.url)
        usage = complete(live, prompt)
        after = metrics(live.url)
        page_value = prefix_cache.remote_pages.codec.size("0" * 64)
        store_read = store.stats["read_bytes"] - store_before
    finally:
        live.stop()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and gained(before, after, "dsv41:prefix_cache_page_hits_total", tier="remote") == cached // 16
    read = reads(before, after)
    snapshot_hit = gained(before, after, "dsv41:swa_pool_snapshots_total", event="hit")
    assert snapshot_hit == 1  # the window came back from the Redis pool
    assert read["remote"][0] == store_read > (cached // 16) * page_value and read["remote"][1] > 0
    assert read["disk"] == read["swa_pool"] == (0, 0)
