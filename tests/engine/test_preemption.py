"""Preemption, eviction of cached pages and prefix-cache hits together (issue 22, items 2 and 6).

A preempted sequence comes back with its prompt and output; the prefix cache may hand it its own pages (or
another request's), with or without an SWA snapshot. Whatever it gets, it must compute what it would have
computed unpreempted: float64 greedy tokens equal to a run without preemption.
"""

import pytest
import torch

from deepseek_v41.engine import LLM, SamplingParams

W = 16  # the tiny config's sliding window (and the default page size)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_preempted(llm: LLM, prompt: list[int], params: SamplingParams, after: int) -> list[int]:
    """Generate ``prompt`` alone, preempting it once it has ``after`` output tokens; its tokens."""
    engine = llm.engine
    engine.add_request("r", prompt, params)
    seq = engine.requests["r"][0]
    preempted = False
    while engine.has_unfinished_requests():
        if not preempted and len(seq.output_token_ids) >= after:
            engine.scheduler.preempt(seq)
            preempted = True
        engine.step()
    assert preempted
    engine.release("r")
    return list(seq.output_token_ids)


VARIANTS = {
    "bounded": {},
    "exact-replay": {"replay": "exact"},
    "no-swa-pool": {"swa_pool_bytes": 0},
    "dspark": {"speculative": "dspark", "speculative_cost_table": "fixed"},
    "exact-prefill": {"prefill_mode": "exact"},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_preempted_sequence_resumes_from_the_cache_with_the_same_tokens(model64, variant):
    """Item 6: a 40-token request preempted after 40 generated tokens comes back to its own cached pages (4 full
    pages, reaching far past its decoder start 24) and its prompt's snapshot at 32. Before the fix: "residuals of
    positions [a, b) are not in slot 0's ring" (bounded, exact replay, DSpark), AttributeError without an SWA
    pool, and a full recompute in exact prefill mode (only the longest match's snapshot was looked for)."""
    args = VARIANTS[variant]
    prompt = prompt_of(40, seed=1)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    reference = LLM(model64, max_model_len=256, enable_prefix_caching=False,
                    prefill_mode=args.get("prefill_mode"))
    expected = reference.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    llm = LLM(model64, max_model_len=256, **args)
    assert run_preempted(llm, prompt, params, after=40) == expected
    stats = llm.stats
    assert stats["num_preemptions"] == 1 and stats["kv_pages_used"] == 0
    counters = stats["prefix_cache"]
    if variant == "no-swa-pool":  # exact replay over 4 of its own pages (64 tokens), from position 0
        assert (counters["cached_tokens"], counters["replayed_tokens"]) == (64, 64)
    else:  # the prompt's snapshot at 32: the latest boundary whose window reaches back to the decoder start
        assert (counters["cached_tokens"], counters["snapshots_hit"]) == (32, 1)


def test_a_hit_on_the_last_free_pages_plans_no_empty_chunk(model64):
    """Item 2: a request whose prefix hit takes the pool's last free pages (a snapshot hit: it would start at
    its last full page) gets no chunk that step instead of an empty one (before the fix: a zero-length prefill
    reached the C kernels, a segfault, or ValueError from the runner), and every output matches a roomy run."""
    llm = LLM(model64, num_kv_pages=4, max_model_len=64)  # 4 pages of 16 tokens
    engine = llm.engine
    b_prompt, a_prompt = prompt_of(20, seed=3), prompt_of(32, seed=4)
    c_prompt = a_prompt + prompt_of(5, seed=5)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request("b", b_prompt, long)
    engine.step()  # b: 2 pages
    engine.add_request("a", a_prompt, one)
    engine.step()  # a: 2 pages, finished: they go back to the free list with their hashes
    assert engine.requests["a"][0].finished and engine.cache.blocks.num_free == 2
    engine.add_request("c", c_prompt, long)
    plan = engine.scheduler.schedule()  # c hits a's 2 pages and its snapshot at 32: no page left for [32, 37)
    assert all(end > start for _, start, end in plan.prefills)
    assert engine.requests["c"][0].num_computed == 32
    engine._run(plan)
    while engine.has_unfinished_requests():
        engine.step()
    roomy = LLM(model64, max_model_len=64, enable_prefix_caching=False)
    for rid, prompt in (("b", b_prompt), ("c", c_prompt)):
        expected = roomy.generate({"prompt_token_ids": prompt}, long)[0].outputs[0].token_ids
        assert engine.requests[rid][0].output_token_ids == expected, rid
    assert engine.cache.blocks.num_used == 0


def test_the_runner_refuses_an_empty_chunk(model64):
    llm = LLM(model64, max_model_len=64)
    engine = llm.engine
    engine.add_request("r", prompt_of(5), SamplingParams(max_tokens=1))
    seq = engine.requests["r"][0]
    with pytest.raises(ValueError, match=r"0 <= start < end <= 5"):
        engine.runner.prefill(seq, 3, 3)
