"""/metrics of the prefix cache against live servers: the SWA pool occupancy gauge is a 0..1 fraction of the pool's
capacity (it used to read a key the engine never sets and stayed 0), and the hit counters grow by path
(snapshot / replay, in tokens) and by tier (device / disk, in pages) when a long prompt is repeated."""

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


def test_swa_pool_occupancy_and_snapshot_hits(server):
    prompt = "The city is Paris, 123. Snapshot metrics test. " * 12  # many full pages
    before = metrics(server.url)
    complete(server, prompt)
    usage = complete(server, prompt)
    after = metrics(server.url)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0

    pool = server.llm.engine.prefix_cache.swa_pool
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


def test_replay_hits_from_disk_without_a_pool(model_dir, tmp_path):
    live = start_server(model_dir, cache_dir=str(tmp_path / "cache"), swa_pool_bytes=0)
    try:
        prompt = "Hello world! The city is Paris, 123. Disk tier test. " * 10
        complete(live, prompt)
        prefix_cache = live.llm.engine.prefix_cache
        prefix_cache.flush()
        prefix_cache.drop_device_tier()  # the engine is idle: the repeat must load its pages from disk
        usage = complete(live, prompt)
        values = metrics(live.url)
    finally:
        live.stop()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert value(values, "dsv41:prefix_cache_hits_total", path="replay") == cached
    assert value(values, "dsv41:prefix_cache_hits_total", path="snapshot") == 0
    assert value(values, "dsv41:prefix_cache_page_hits_total", tier="disk") == cached // 16
    assert value(values, "dsv41:prefix_cache_pages_written_total", tier="disk") > 0
    assert value(values, "dsv41:prefix_cache_disk_bytes") > 0
    # No pool: capacity 0 and the occupancy fraction 0 (not a division by zero).
    assert value(values, "dsv41:swa_pool_capacity_bytes") == value(values, "dsv41:swa_pool_occupancy") == 0
