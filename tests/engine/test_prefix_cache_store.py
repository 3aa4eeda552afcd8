"""The persistent and shared tiers seen from the engine: restarts, bad files, bad directories, Redis (issue 6)."""

import gc
import logging
import signal
import threading
import time

import pytest
import torch

from deepseek_v41.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def tokens(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm, prompt):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]


def engine(model, **args):
    return LLM(model, max_model_len=1024, **args)


def test_bad_page_files_are_misses_and_never_produce_text(model64, tmp_path):
    prompt = tokens(80, 1)
    cold = run(engine(model64, enable_prefix_caching=False), prompt + [7]).outputs[0].token_ids
    run(engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0), prompt)
    files = sorted(tmp_path.rglob("*.page"), key=lambda f: f.stat().st_mtime)
    assert len(files) == 5
    data = bytearray(files[2].read_bytes())
    data[-10] ^= 0xFF  # corrupt the third page's payload
    files[2].write_bytes(bytes(data))
    files[3].write_bytes(files[3].read_bytes()[:100])  # truncate the fourth
    reader = engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0, replay="exact")
    hit = run(reader, prompt + [7])
    assert hit.num_cached_tokens == 32  # the two good pages before the first bad one
    assert hit.outputs[0].token_ids == cold
    assert list(tmp_path.rglob("quarantine/*"))


def test_other_models_never_read_the_pages(model64, tmp_path):
    from engine_oracles import tiny_model

    prompt = tokens(80, 2)
    run(engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0), prompt)
    other = tiny_model(torch.float64, seed=1)
    assert run(engine(other, cache_dir=str(tmp_path), swa_pool_bytes=0), prompt + [7]).num_cached_tokens == 0


def test_an_unusable_cache_dir_degrades_to_no_persistence(model64, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    prompt = tokens(40, 3)
    with caplog.at_level(logging.WARNING):
        llm = engine(model64, cache_dir=str(blocker / "cache"), swa_pool_bytes=0)
        first = run(llm, prompt)
        second = run(llm, prompt + [1])
    assert first.outputs[0].token_ids and second.num_cached_tokens == 32  # the device tier still works
    assert sum("prefix" in r.getMessage().lower() or "cache" in r.getMessage().lower()
               for r in caplog.records if r.levelno >= logging.WARNING) >= 1


def test_two_engines_share_snapshots_through_redis(model64, redis_url, tmp_path):
    prompt = tokens(70, 4)
    cold = run(engine(model64, enable_prefix_caching=False), prompt + [9]).outputs[0].token_ids
    first = engine(model64, cache_dir=str(tmp_path), redis_url=redis_url)
    run(first, prompt)
    second = engine(model64, cache_dir=str(tmp_path), redis_url=redis_url)
    hit = run(second, prompt + [9])
    assert hit.num_cached_tokens == 64 and hit.num_replayed_tokens == 0  # pages from disk, snapshot from Redis
    assert hit.outputs[0].token_ids == cold


def test_a_checkpoint_of_the_same_shape_with_other_weights_never_reads_the_pages(model64, tmp_path, monkeypatch):
    """Issue 22 item 5: the fingerprint hashed config.json, the safetensors headers and the file sizes, so a
    fine-tuned checkpoint of the same shape hit the base model's pages and produced wrong tokens."""
    from engine_oracles import tiny_model

    monkeypatch.setenv("DSV41_CACHE_HOME", str(tmp_path / "digests"))
    model64.save_pretrained(tmp_path / "base")
    tiny_model(torch.float64, seed=1).save_pretrained(tmp_path / "tuned")
    assert (tmp_path / "base" / "model.safetensors").stat().st_size == \
        (tmp_path / "tuned" / "model.safetensors").stat().st_size
    prompt = tokens(80, 5)
    cache = str(tmp_path / "cache")
    base = LLM(str(tmp_path / "base"), dtype=torch.float64, max_model_len=1024, cache_dir=cache, swa_pool_bytes=0)
    run(base, prompt)
    assert run(LLM(str(tmp_path / "base"), dtype=torch.float64, max_model_len=1024, cache_dir=cache,
                   swa_pool_bytes=0), prompt + [7]).num_cached_tokens == 80  # the same checkpoint still hits
    tuned = LLM(str(tmp_path / "tuned"), dtype=torch.float64, max_model_len=1024, cache_dir=cache, swa_pool_bytes=0)
    cold = run(LLM(str(tmp_path / "tuned"), dtype=torch.float64, max_model_len=1024, enable_prefix_caching=False),
               prompt + [7]).outputs[0].token_ids
    out = run(tuned, prompt + [7])
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == cold


def test_two_engines_on_separate_cache_dirs_share_pages_through_redis(model64, redis_url, tmp_path):
    """Issue 22 item 11: with one Redis and separate cache directories the engines shared nothing (the page index
    in Redis was written but never read); the pages now travel through Redis."""
    prompt = tokens(70, 6)
    cold = run(engine(model64, enable_prefix_caching=False), prompt + [9]).outputs[0].token_ids
    run(engine(model64, cache_dir=str(tmp_path / "a"), redis_url=redis_url, swa_pool_bytes=0), prompt)
    second = engine(model64, cache_dir=str(tmp_path / "b"), redis_url=redis_url, swa_pool_bytes=0, replay="exact")
    hit = run(second, prompt + [9])
    assert hit.num_cached_tokens == 64 and hit.outputs[0].token_ids == cold
    stats = second.engine.stats["prefix_cache"]
    assert stats["remote_pages_read"] == 4 and stats["disk_pages_read"] == 0
    # What came through Redis is now in the second engine's own directory too.
    assert len(list((tmp_path / "b").rglob("*.page"))) == 4


def test_redis_alone_shares_pages_and_snapshots(model64, redis_url):
    prompt = tokens(70, 7)
    cold = run(engine(model64, enable_prefix_caching=False), prompt + [9]).outputs[0].token_ids
    run(engine(model64, redis_url=redis_url), prompt)
    hit = run(engine(model64, redis_url=redis_url), prompt + [9])
    assert hit.num_cached_tokens == 64 and hit.num_replayed_tokens == 0  # pages and snapshot from Redis
    assert hit.outputs[0].token_ids == cold


def _cache_time(llm, request_id, prompt) -> float:
    """Seconds the engine spent in prefix-cache calls (lookups, snapshots, page registration) while it ran one
    request to the end: the time Redis can add to a step (the rest is compute, noisy on a shared machine)."""
    pc, spent = llm.engine.prefix_cache, [0.0]

    def timed(method):
        def wrapper(*args, **kwargs):
            start = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.monotonic() - start
        return wrapper

    for name in ("match", "take_snapshot", "register"):
        setattr(pc, name, timed(getattr(type(pc), name).__get__(pc)))
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0] if request_id is None else None
    if out is None:
        eng = llm.engine
        eng.add_request(request_id, prompt, GREEDY)
        while eng.has_unfinished_requests():
            eng.step()
        out = eng.request_output(request_id)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    return spent[0]


def test_a_frozen_redis_never_stalls_generation(model64, redis_server, tmp_path, monkeypatch):
    """Issue 22 item 9: Redis calls ran on the engine thread with 2 s socket timeouts (and a retry): a frozen Redis
    stalled every request. Now one lookup waits at most the read timeout, the rest are misses without waiting,
    and the errors are counted in /metrics."""
    from prometheus_client import generate_latest

    import deepseek_v41.cache.redis_store as redis_store_mod
    from deepseek_v41.engine.async_engine import AsyncLLMEngine
    from deepseek_v41.server.metrics import ServerMetrics

    monkeypatch.setattr(redis_store_mod, "RETRY_SECONDS", 1000.0)  # no background check during the test
    proc, url = redis_server
    llm = engine(model64, cache_dir=str(tmp_path), redis_url=url)
    _cache_time(llm, "warm", tokens(70, 8))
    proc.send_signal(signal.SIGSTOP)
    try:
        # One lookup waits READ_TIMEOUT_SECONDS (0.5 s); the old code waited its 2 s socket timeout, twice.
        assert _cache_time(llm, "frozen-1", tokens(70, 10)) < 1.5
        remote = llm.engine.stats["prefix_cache"]["remote"]
        assert remote["errors"] == 1
        assert _cache_time(llm, "frozen-2", tokens(70, 11) + [1] * 17) < 0.45  # marked down: no wait at all
        assert llm.engine.stats["prefix_cache"]["remote"]["errors"] == 1
        start = time.monotonic()
        _cache_time(llm, None, tokens(40, 12))  # LLM.generate, its flush of the queued Redis writes included
        assert time.monotonic() - start < 30
        remote = llm.engine.stats["prefix_cache"]["remote"]
        assert remote["errors"] >= 1 and remote["unavailable"] >= 2
        text = generate_latest(ServerMetrics(AsyncLLMEngine(llm.engine), "m").registry).decode()
        assert f'dsv41:prefix_cache_remote_errors_total{{model_name="m"}} {float(remote["errors"])}' in text
        assert 'dsv41:prefix_cache_remote_skipped_total{model_name="m",op="read"}' in text
    finally:
        proc.send_signal(signal.SIGCONT)


def test_the_page_writer_starts_with_the_engine(model64, tmp_path, redis_url):
    """Issue 22 item 12: the page-writer thread started lazily inside a step."""
    def writers():
        return {t for t in threading.enumerate() if t.name == "dsv41-page-writer"}

    gc.collect()  # engines of earlier tests: their writers may end at any time, so threads are compared by identity
    before = writers()
    llm = engine(model64, cache_dir=str(tmp_path))
    writer = llm.engine.prefix_cache._writer
    assert writers() - before == {writer} and writer.is_alive()
    assert engine(model64).engine.prefix_cache._writer is None  # nothing to persist: no thread
    redis_llm = engine(model64, redis_url=redis_url)
    assert redis_llm.engine.prefix_cache._writer.is_alive()
    dropped = {writer, redis_llm.engine.prefix_cache._writer}
    llm = redis_llm = writer = None
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in dropped) and time.monotonic() < deadline:  # a dropped engine's thread ends
        time.sleep(0.01)
    assert not any(t.is_alive() for t in dropped)


def test_a_corrupt_directory_heals_in_one_pass(model64, tmp_path):
    """Issue 22 item 13: a put of an existing corrupt page only touched it, so each restart healed one page per
    chain (the first bad one, rejected on read)."""
    prompt = tokens(80, 12)
    run(engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0), prompt)
    files = sorted(tmp_path.rglob("*.page"))
    assert len(files) == 5
    for f in files:
        data = bytearray(f.read_bytes())
        data[-10] ^= 0xFF
        f.write_bytes(bytes(data))
    assert run(engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0), prompt).num_cached_tokens == 0
    hit = run(engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0), prompt + [7])
    assert hit.num_cached_tokens == 80  # every page was replaced by the run after the damage


def test_writer_threads_end_before_the_interpreter_finalizes(model64, tmp_path, redis_url):
    """A clean run with a cache_dir aborted at exit about every other time ("terminate called without an active
    exception", status 134; found by review after issue 22): the engines' page-writer (and Redis writer) daemon
    threads were only *asked* to stop at exit (weakref.finalize) and were still waking up while the interpreter
    finalized. Their finalizers now wait for them, so once a finalizer has run its thread is gone."""
    llm = engine(model64, cache_dir=str(tmp_path), redis_url=redis_url)
    run(llm, tokens(40, 3))
    cache = llm.engine.prefix_cache
    remote = cache.remote_pages.store
    page_writer, redis_writer = cache._writer, remote._writer
    assert page_writer.is_alive() and redis_writer.is_alive()
    cache._stop_writer()   # what atexit (or the collection of the engine) runs
    remote._stop_writer()
    assert not page_writer.is_alive() and not redis_writer.is_alive()


@pytest.mark.slow  # (3 interpreters x 4 engines, 17 s: with the slow tests, to keep make test under 5 minutes)
def test_a_script_with_engines_left_alive_exits_cleanly(tmp_path):
    """The same at the process level, as in the review's script: engines on the bundled checkpoint with a
    cache_dir, left referenced at exit; before the fix most such runs exited 134."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    model = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
    script = (
        "import sys\n"
        "from deepseek_v41 import LLM, SamplingParams\n"
        "keep = []\n"
        "for i in range(4):\n"
        "    llm = LLM(sys.argv[2], max_model_len=512, num_kv_pages=64, cache_dir=sys.argv[1])\n"
        "    llm.generate({'prompt_token_ids': list(range(3, 203))}, SamplingParams(temperature=0, max_tokens=16))\n"
        "    keep.append(llm)\n"
        "print('ok', flush=True)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", DSV41_CACHE_HOME=str(tmp_path / "home"))
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache"), str(model)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "ok" in done.stdout, (done.returncode, done.stderr[-2000:])
