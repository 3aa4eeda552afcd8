"""Prefix cache across requests and restarts: every hit path of SPEC.md §4.3 against a cold run (issue 6).

Float64 models: the exact paths must give the cold run's numbers (tokens equal; no quantization flips).
"""

import pytest
import torch

from deepseek_v41.engine import LLM, SamplingParams

W, P = 16, 16  # tiny config's window and the default page size
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SHORT = [1, 2, 3, W - 1, W, W + 1, W + 2, 2 * W - 1, 2 * W, 2 * W + 1]
LONG = [1000, 1001]
# Every path runs the short prefix lengths in the fast suite and the long ones in the slow one.
SETS = [pytest.param(SHORT, id="short"), pytest.param(LONG, id="long", marks=pytest.mark.slow)]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm, prompt, params=GREEDY):
    return llm.generate({"prompt_token_ids": prompt}, params)[0]


def engine(model, **args):
    return LLM(model, max_model_len=2048, max_num_batched_tokens=2048, **args)


class Cold(dict):
    """Cold-run tokens of prefix + suffix per (prefill mode, prefix length), computed when first asked."""

    def __init__(self, model):
        super().__init__()
        self.llms = {mode: engine(model, prefill_mode=mode, enable_prefix_caching=False) for mode in ("ced", "exact")}

    def __missing__(self, key):
        mode, n = key
        self[key] = run(self.llms[mode], tokens(n, n) + tokens(3, 7)).outputs[0].token_ids
        return self[key]


@pytest.fixture(scope="module")
def cold(model64):
    return Cold(model64)


def expected_cached(n: int) -> int:
    return P * (min(n, n + 3 - 1) // P)


@pytest.mark.parametrize("lengths", SETS)
@pytest.mark.parametrize("mode", ["ced", "exact"])
def test_device_pages_and_snapshot(model64, cold, mode, lengths):
    llm = engine(model64, prefill_mode=mode, swa_pool_bytes=1 << 28)
    for n in lengths:
        run(llm, tokens(n, n))
        hit = run(llm, tokens(n, n) + tokens(3, 7))
        assert hit.num_cached_tokens == expected_cached(n), n
        assert hit.num_replayed_tokens == 0
        assert hit.outputs[0].token_ids == cold[mode, n], n


@pytest.mark.parametrize("lengths", SETS)
def test_disk_pages_and_snapshot(model64, cold, tmp_path, lengths):
    llm = engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=1 << 28)
    for n in lengths:
        run(llm, tokens(n, n))
        llm.engine.prefix_cache.drop_device_tier()
        read = llm.stats["prefix_cache"]["disk_pages_read"]
        hit = run(llm, tokens(n, n) + tokens(3, 7))
        assert hit.num_cached_tokens == expected_cached(n), n
        assert llm.stats["prefix_cache"]["disk_pages_read"] - read == expected_cached(n) // P
        assert hit.outputs[0].token_ids == cold["ced", n], n


@pytest.mark.parametrize("lengths", SETS)
def test_disk_and_exact_replay_after_a_restart(model64, cold, tmp_path, lengths):
    writer = engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0)
    for n in lengths:
        run(writer, tokens(n, n))
    for n in lengths:  # a new engine: nothing on the device, no snapshots, the pages on disk
        reader = engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0, replay="exact")
        hit = run(reader, tokens(n, n) + tokens(3, 7))
        assert hit.num_cached_tokens == expected_cached(n), n
        assert hit.outputs[0].token_ids == cold["ced", n], n
        reader.engine.prefix_cache.flush()  # pages already on disk are not counted as written again
        stats = reader.stats["prefix_cache"]
        assert stats["disk_pages_written"] == stats["disk"]["pages_written"], n
        total = n + 3 + len(hit.outputs[0].token_ids)  # at most the pages past the cached ones are new
        assert stats["disk_pages_written"] <= total // P - expected_cached(n) // P, n


@pytest.mark.parametrize("lengths", SETS)
def test_disk_and_bounded_replay_counts_its_work(model64, tmp_path, lengths):
    writer = engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0)
    plan = model64.plan
    for n in lengths:
        run(writer, tokens(n, n))
        reader = engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0)
        prompt = tokens(n, n) + tokens(3, 7)
        N, cached = len(prompt), expected_cached(n)
        hit = run(reader, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        replayed = min(cached, W)
        assert (hit.num_cached_tokens, hit.num_replayed_tokens) == (cached, replayed), n
        stats = reader.stats
        for j in plan.encoder_layers:  # the replay range plus the suffix, nothing before
            assert stats["layer_tokens"][j] == N - (cached - replayed), (n, j)
        for j in plan.decoder_layers:
            assert stats["layer_tokens"][j] == min(N, W), (n, j)
        for layer, m in reader.engine.cache.ratio.items():  # compressors wrote entries of [L', N) only
            assert stats["entries_written"].get(layer, 0) == N // m - cached // m, (n, layer)


def test_partial_sharing_rounds_down_to_a_page(model64):
    llm = engine(model64, swa_pool_bytes=1 << 28)
    shared = tokens(45, 1)
    run(llm, shared + tokens(9, 2))
    hit = run(llm, shared + tokens(12, 3))
    assert hit.num_cached_tokens == P * (45 // P)


def test_salts_keep_caches_apart(model64):
    llm = engine(model64, swa_pool_bytes=1 << 28)
    prompt = tokens(70, 4)
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, GREEDY)
    other = llm.generate({"prompt_token_ids": prompt + [9], "cache_salt": "bob"}, GREEDY)[0]
    same = llm.generate({"prompt_token_ids": prompt + [9], "cache_salt": "alice"}, GREEDY)[0]
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 64


def test_pages_are_shared_and_return_to_the_pool(model64):
    llm = engine(model64, swa_pool_bytes=1 << 28)
    prompt = tokens(100, 5)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert llm.stats["kv_pages_used"] == 0


def test_disk_pages_written_counts_files_not_pages_found_stored(model64, tmp_path):
    prompt = tokens(4 * P, 5)  # whole pages: a hit leaves the last one to compute, and it is already on disk
    writer = engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0)
    run(writer, prompt)
    writer.engine.prefix_cache.flush()
    reader = engine(model64, cache_dir=str(tmp_path), swa_pool_bytes=0)
    hit = run(reader, prompt)
    reader.engine.prefix_cache.flush()
    stats = reader.stats["prefix_cache"]
    assert hit.num_cached_tokens == 3 * P
    assert stats["disk_pages_written"] == stats["disk"]["pages_written"] == 0


def test_the_runner_rebuilds_the_engram_history_after_a_hit(model64):
    """A hit is planned by the KV cache manager (pages, snapshot, restart point) and marked; the model runner
    rebuilds the slot's Engram history from the tokens before the restart point at the first chunk, to what a
    cold run has there (the cache layer never runs the model)."""
    llm = engine(model64, swa_pool_bytes=1 << 28)
    hasher, eng = model64.hasher, llm.engine
    prompt = tokens(40, 1) + tokens(3, 7)
    run(llm, prompt[:40])
    eng.add_request("hit", prompt, GREEDY)
    seq = eng.requests["hit"][0]
    (s, start, end), = eng.scheduler.schedule().prefills
    assert s is seq and start == seq.num_computed == 32 and seq.rebuild_engram_history  # the prompt's snapshot
    assert (eng.cache.engram_history[seq.slot] == -1).all()  # admission left the model's work to the runner
    eng.runner.prefill(seq, start, end)
    cold = hasher.next_history(torch.tensor([prompt[:end]]), None, hasher.start_history(1, "cpu"))
    assert not seq.rebuild_engram_history
    assert eng.cache.engram_history[seq.slot, : hasher.depth].tolist() == cold[0].tolist()
    eng.abort_request("hit")
