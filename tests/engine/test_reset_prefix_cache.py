"""``reset_prefix_cache`` (vLLM's name): forget this process's cached prefixes, e.g. after changing the weights in
place, so that no later request reuses KV computed before; refused (False) while requests hold KV pages."""

import pytest
import torch
from engine_oracles import tiny_model

from deepseek_v41.cache.swa_pool import SwaPool
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.kernels import fast

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
P = 16  # the default page size


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm, prompt):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]


def engine(model, **args):
    return LLM(model, max_model_len=512, max_num_batched_tokens=512, swa_pool_bytes=1 << 28, **args)


@pytest.mark.parametrize("mode", ["ced", "exact"])
def test_reset_forgets_the_device_tier_and_the_swa_pool(model64, mode):
    llm = engine(model64, prefill_mode=mode)
    blocks = llm.engine.kv_cache_manager.blocks
    free_before = blocks.num_free
    prompt = tokens(3 * P + 5, 1)
    cold = run(llm, prompt)
    assert cold.num_cached_tokens == 0
    hit = run(llm, prompt)
    assert hit.num_cached_tokens == 3 * P
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    pool = llm.engine.prefix_cache.swa_pool
    assert isinstance(pool, SwaPool) and pool.stats["entries"] > 0 and blocks.hash_page
    hits_before = llm.stats["prefix_cache"]["device_pages_hit"]

    assert llm.reset_prefix_cache() is True
    assert blocks.num_free == free_before and blocks.num_used == 0
    assert not blocks.hash_page and not blocks.page_hash
    assert pool.stats["entries"] == 0 and pool.occupancy_bytes == 0

    again = run(llm, prompt)
    assert again.num_cached_tokens == 0 and again.num_replayed_tokens == 0
    assert llm.stats["prefix_cache"]["device_pages_hit"] == hits_before  # no page came from the device index
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    assert blocks.num_free == free_before
    # The cache fills again after a reset.
    assert run(llm, prompt).num_cached_tokens == 3 * P


def test_reset_without_prefix_caching_is_a_no_op(model64):
    llm = engine(model64, enable_prefix_caching=False)
    run(llm, tokens(2 * P + 1, 2))
    assert llm.reset_prefix_cache() is True
    eng = llm.engine
    eng.add_request("r", tokens(2 * P + 1, 2), GREEDY)
    eng.step()
    assert eng.scheduler.running
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    assert eng.scheduler.num_preemptions == 0 and eng.scheduler.running  # nothing cached: nobody preempted


def test_reset_while_a_request_holds_pages_is_refused_and_changes_nothing(model64):
    llm = engine(model64)
    eng = llm.engine
    blocks = eng.kv_cache_manager.blocks
    shared = tokens(2 * P, 3)
    cold = run(llm, shared + tokens(5, 4))
    cached = dict(blocks.hash_page)
    pool = eng.prefix_cache.swa_pool
    entries = pool.stats["entries"]
    assert cached and entries

    # In flight: a request sharing the cached prefix, admitted and prefilled (it holds the cached pages).
    eng.add_request("r", shared + tokens(5, 4), GREEDY)
    eng.step()
    assert eng.scheduler.running and blocks.num_used
    used = blocks.num_used
    assert eng.reset_prefix_cache() is False
    assert llm.reset_prefix_cache() is False
    assert all(blocks.hash_page[h] == p for h, p in cached.items())
    assert blocks.num_used == used and pool.stats["entries"] >= entries
    outputs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            outputs[out.request_id] = out
    assert outputs["r"].finished and outputs["r"].num_cached_tokens == 2 * P
    assert outputs["r"].outputs[0].token_ids == cold.outputs[0].token_ids
    eng.release("r")

    # Finished: the reset goes through, and the next run is cold and gives the same tokens.
    assert blocks.num_used == 0
    assert llm.reset_prefix_cache() is True
    again = run(llm, shared + tokens(5, 4))
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == cold.outputs[0].token_ids


def test_reset_running_requests_preempts_them_and_their_tokens_do_not_change(model64):
    llm = engine(model64)
    eng = llm.engine
    blocks = eng.kv_cache_manager.blocks
    prompts = [tokens(2 * P + 3, 6), tokens(P + 9, 7)]
    cold = [run(llm, p).outputs[0].token_ids for p in prompts]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    eng.step()
    eng.step()
    assert len(eng.scheduler.running) == 2 and blocks.num_used
    preemptions = eng.scheduler.num_preemptions
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    assert eng.scheduler.num_preemptions == preemptions + 2 and not eng.scheduler.running
    assert blocks.num_used == 0 and not blocks.hash_page
    outputs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            outputs[out.request_id] = out
    assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(2)] == cold


def test_reset_after_changing_the_weights_matches_a_fresh_engine():
    model = tiny_model(torch.float32, seed=0)
    new = tiny_model(torch.float32, seed=1)
    prompt = tokens(3 * P + 5, 5)
    fresh = run(engine(tiny_model(torch.float32, seed=1)), prompt)

    llm = engine(model)
    old = run(llm, prompt)
    assert run(llm, prompt).num_cached_tokens == 3 * P
    with torch.no_grad():
        model.load_state_dict(new.state_dict())  # the weights change in place (e.g. an RL weight sync)
    fast.install(llm.engine.model)  # the fast paths read the weights captured at install time
    # Without a reset the old weights' KV is reused:
    assert run(llm, prompt).num_cached_tokens == 3 * P
    assert llm.reset_prefix_cache() is True
    after = run(llm, prompt)
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert old.outputs[0].token_ids != fresh.outputs[0].token_ids  # (the change shows in the tokens)
    hit = run(llm, prompt)  # the cache of the new weights is consistent with them
    assert hit.num_cached_tokens == 3 * P and hit.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_reset_keeps_the_disk_tier_and_says_so(model64, tmp_path, caplog):
    # The disk pages are keyed by the fingerprint taken at load (shared with other processes serving the same
    # checkpoint): a reset keeps them, and warns that changed weights need a new engine and cache_dir.
    llm = engine(model64, cache_dir=str(tmp_path), replay="exact")  # (no snapshot after the reset: exact replay)
    prompt = tokens(3 * P + 5, 8)
    cold = run(llm, prompt)
    with caplog.at_level("WARNING", logger="deepseek_v41.engine.engine"):
        assert llm.reset_prefix_cache() is True
    assert "persistent tiers (cache_dir, Redis) are kept" in caplog.text
    read = llm.stats["prefix_cache"]["disk_pages_read"]
    again = run(llm, prompt)
    assert again.num_cached_tokens == 3 * P and llm.stats["prefix_cache"]["disk_pages_read"] == read + 3
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
