"""The KV cache manager (SPEC.md §4.1, §4.3): salted prefix hashes, lookup and page registration owned by the
cache layer and driven by the scheduler; the model is never run here (no weights: the cache never touches one)."""

import ast
from pathlib import Path

import pytest

from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.cache.kv_cache_manager import CacheConfig, KVCacheManager, num_kv_pages
from deepseek_v41.cache.prefix_cache import PrefixCache, chain_hashes
from deepseek_v41.config import tiny_config
from deepseek_v41.engine.detokenizer import IncrementalDetokenizer
from deepseek_v41.engine.sampler import SamplingState
from deepseek_v41.engine.sampling_params import SamplingParams
from deepseek_v41.engine.scheduler import Scheduler
from deepseek_v41.engine.sequence import Sequence
from deepseek_v41.plan import build_layer_plan

P = 16  # block size
CFG = tiny_config()  # sliding_window 16, CED layout
PROMPT = [(5 * i + 3) % CFG.vocab_size for i in range(70)]  # 4 full blocks, 70 - 16 = decoder start 54


def manager(prefix: bool = True, num_pages: int = 32) -> KVCacheManager:
    cache = PagedKVCache(CFG, num_pages, P, 4, 16, "cpu")
    pc = PrefixCache(cache, "f" * 64, exact_prefill=False) if prefix else None  # bounded replay, no SWA pool
    return KVCacheManager(cache, pc)


def sequence(prompt=PROMPT, salt: str | None = None, seq_id: int = 0) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return Sequence(seq_id, str(seq_id), 0, list(prompt), params, SamplingState(params, prompt),
                    IncrementalDetokenizer(None, prompt, params),
                    decoder_start=build_layer_plan(CFG).decoder_start(len(prompt)), cache_salt=salt)


def computed(kv: KVCacheManager, seq: Sequence) -> None:
    """What the engine reports after a forward over the whole prompt (pages assumed written)."""
    kv.blocks.grow(seq.block_table, len(seq.prompt_token_ids))
    seq.num_computed = len(seq.prompt_token_ids)
    kv.on_computed(seq, prompt_done=True)


def test_a_second_request_takes_the_first_ones_pages_and_restarts_at_the_replay_start():
    kv = manager()
    first = sequence()
    kv.admit(first, len(PROMPT))
    assert first.num_computed == 0 and not first.rebuild_engram_history  # a miss: nothing to rebuild
    computed(kv, first)
    root = kv.prefix_cache.root(None)
    assert first.block_hashes == chain_hashes(root, PROMPT, P) and first.registered_pages == 4
    kv.free(first)
    second = sequence(seq_id=1)
    kv.admit(second, len(PROMPT))
    cached = 4 * P  # L' = P * floor(min(match, N - 1) / P)
    start = min(max(0, cached - CFG.sliding_window), second.decoder_start)  # bounded replay (SPEC.md §4.3)
    assert (second.num_computed, second.write_from) == (start, cached)
    assert (second.num_cached_tokens, second.num_replayed_tokens) == (cached, cached - start)
    assert second.block_table == first_pages(kv, PROMPT) and second.rebuild_engram_history
    assert kv.stats()["prefix_cache"]["cached_tokens"] == cached


def first_pages(kv: KVCacheManager, prompt: list[int]) -> list[int]:
    return [kv.blocks.lookup(h) for h in chain_hashes(kv.prefix_cache.root(None), prompt, P)]


def test_a_salt_keeps_prefixes_apart():
    kv = manager()
    first = sequence(salt="tenant-a")
    kv.admit(first, len(PROMPT))
    computed(kv, first)
    other = sequence(salt="tenant-b", seq_id=1)
    kv.admit(other, len(PROMPT))
    assert other.num_computed == 0 and other.block_table == [] and other.block_hashes != first.block_hashes
    same = sequence(salt="tenant-a", seq_id=2)
    kv.admit(same, len(PROMPT))
    assert same.write_from == 4 * P and same.block_hashes == first.block_hashes


def test_free_returns_pages_and_slot_and_clears_the_rebuild_mark():
    kv = manager()
    first = sequence()
    kv.admit(first, len(PROMPT))
    computed(kv, first)
    kv.free(first)
    second = sequence(seq_id=1)
    kv.admit(second, len(PROMPT))
    assert second.rebuild_engram_history
    kv.free(second)
    assert second.slot is None and second.block_table == [] and second.registered_pages == 0
    assert not second.rebuild_engram_history and kv.blocks.num_used == 0 and len(kv.cache.free_slots) == 4


def test_without_prefix_caching_admission_takes_a_slot_only():
    kv = manager(prefix=False)
    seq = sequence()
    kv.admit(seq, len(PROMPT))
    computed(kv, seq)
    assert seq.slot is not None and seq.block_hashes == [] and seq.registered_pages == 0
    assert "prefix_cache" not in kv.stats() and kv.stats()["kv_pages_used"] == 5


def test_the_scheduler_admits_through_its_manager():
    """A hit found at admission moves the first chunk to the restart point: the scheduler asks the manager it
    owns, no callback into the engine."""
    kv = manager()
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=256)
    first = sequence()
    scheduler.add(first)
    (seq, start, end), = scheduler.schedule().prefills
    assert (seq, start, end) == (first, 0, len(PROMPT))
    computed(kv, first)
    scheduler.finish(first)
    second = sequence(seq_id=1)
    scheduler.add(second)
    (seq, start, end), = scheduler.schedule().prefills
    assert seq is second and start == second.num_computed > 0 and end == len(PROMPT)


def test_the_pool_is_sized_from_the_settings():
    assert num_kv_pages(CFG, CacheConfig(max_model_len=64, num_kv_pages=10)) == 11  # + the null page
    with pytest.raises(ValueError, match=r"cannot hold one sequence of max_model_len=64 tokens: that needs 4 pages"):
        num_kv_pages(CFG, CacheConfig(max_model_len=64, num_kv_pages=3))


def test_the_kv_cache_manager_never_imports_the_model_or_the_engine():
    """Hashing, lookup, registration, snapshots and restore live in the cache layer; the model's work after a hit
    (Engram history, replay) is the model runner's: the manager, the prefix cache, the block manager and the cache
    tensors import nothing from deepseek_v41.model or deepseek_v41.engine."""
    root = Path(__file__).resolve().parents[2] / "deepseek_v41" / "cache"
    upward = []
    for name in ("kv_cache_manager.py", "prefix_cache.py", "block_manager.py", "kv_cache.py"):
        for node in ast.walk(ast.parse((root / name).read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            upward += [f"{name}: {n}" for n in names if n.startswith(("deepseek_v41.model", "deepseek_v41.engine"))]
    assert not upward
