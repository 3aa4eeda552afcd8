"""Batched prefill (issue 25): prefill chunks of equal length from several sequences run as one forward
(``ModelRunner.prefill_batch``), and every sequence gets what its chunks give it run alone.

Oracles: the same engine with ``max_prefill_batch = 1`` (every chunk alone, the path before issue 25). In float64
(the reference code) the two agree to 1e-9; on the bundled checkpoint in fp32 (the CPU fast paths) bit for bit:
greedy tokens and logprobs. The speculative draft's context rows come from each row's taps: acceptance counts
must be equal too.
"""

import pytest
import torch
from engine_oracles import tiny_model

from deepseek_v41.engine import LLM, SamplingParams

BUNDLED = "checkpoints/v41-tiny"


def prompt_of(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm, prompts, batched: bool, params):
    """Outputs (tokens, top logprobs per step) of ``prompts`` with batching on or off, and how many multi-row
    prefill forwards ran."""
    engine = llm.engine
    engine.max_prefill_batch = 64 if batched else 1
    rows = []
    batch = engine.runner.prefill_batch

    def spy(chunks, taps=None):
        rows.append(len(chunks))
        return batch(chunks, taps)

    engine.runner.prefill_batch = spy
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        del engine.runner.prefill_batch
    result = [(o.outputs[0].token_ids, [{k: v.logprob for k, v in e.items()} for e in o.outputs[0].logprobs or []])
              for o in outs]
    return result, sum(1 for r in rows if r > 1)


def assert_close(a, b, tol: float) -> None:
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        for ea, eb in zip(la, lb, strict=True):
            assert ea.keys() == eb.keys()
            assert max(abs(ea[k] - eb[k]) for k in ea) <= tol


@pytest.fixture(scope="module")
def model64():
    return tiny_model(torch.float64, sliding_window=64)  # chunks batch from 32 tokens up to the window


@pytest.mark.parametrize("mode", ["exact", "ced"])
def test_batched_prefill_equals_each_chunk_alone_float64(model64, mode):
    """Equal lengths batch (also, with a budget of 64, a second chunk [64, 96) beside a fresh 32-token prompt: rows
    at different positions); other lengths, chunks after a prefix-cache hit and chunks longer than the window run alone.
    Logprobs to 1e-9, tokens equal."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    shared = prompt_of(60, seed=1)
    prompts = [prompt_of(40, seed=s) for s in range(3)] + [prompt_of(48, seed=10 + s) for s in range(2)]
    prompts += [shared, shared[:48] + prompt_of(12, seed=5), prompt_of(20, seed=7), prompt_of(80, seed=8)]

    def fresh(**kw):
        return LLM(model64, prefill_mode=mode, max_model_len=256, **kw)

    alone, _ = run(fresh(), prompts, False, params)
    together, batches = run(fresh(), prompts, True, params)
    assert batches > 0
    assert_close(together, alone, 1e-9)
    prompts = [prompt_of(96, seed=20), prompt_of(32, seed=21), prompt_of(32, seed=22)]
    alone, _ = run(fresh(max_num_batched_tokens=64), prompts, False, params)
    together, batches = run(fresh(max_num_batched_tokens=64), prompts, True, params)
    assert batches > 0
    assert_close(together, alone, 1e-9)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bundled_checkpoint_batched_prefill_keeps_greedy_tokens(dtype):
    """The bundled checkpoint (CED, Engram, fast paths) with prefix-cache hits, chunked prefill and preemption on a
    small page pool: fp32 gives the same tokens and logprobs bit for bit with and without batched prefill (on the
    CPU fast paths; the torch fallback to rounding); bf16 does not batch (its kernels are chosen by a forward's
    token count) and is unchanged."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [prompt_of(64, seed=s, vocab=8000) for s in range(12)]
    prompts += [prompts[0][:48] + prompt_of(16, seed=99, vocab=8000), prompt_of(30, seed=50, vocab=8000)]
    kw = {"dtype": getattr(torch, dtype), "max_model_len": 128, "max_num_batched_tokens": 400, "num_kv_pages": 40}
    alone, _ = run(LLM(BUNDLED, **kw), prompts, False, params)
    llm = LLM(BUNDLED, **kw)
    together, batches = run(llm, prompts, True, params)
    assert (batches > 0) == (dtype == "float32") and llm.stats["num_preemptions"] > 0
    if llm.engine.runner.fast:
        assert together == alone
    else:  # DSV41_CPU_KERNELS=0: the reference code batched agrees to rounding (measured 2.4e-7)
        assert_close(together, alone, 1e-5)


def test_speculative_draft_context_comes_from_each_rows_taps():
    """DSpark: the draft's context rows of a batched prefill are each row's taps: the same acceptance as alone."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [prompt_of(40, seed=s, vocab=8000) for s in range(6)]
    stats = {}
    for batched in (False, True):
        llm = LLM(BUNDLED, dtype=torch.float32, max_model_len=128, speculative="dspark",
                  speculative_cost_table=[1.0] * 6)
        outs, batches = run(llm, prompts, batched, params)
        assert batches > 0 or not batched
        stats[batched] = (outs, llm.stats["spec_decode_num_accepted_tokens"])
    assert stats[True] == stats[False]


def test_prefill_batch_refuses_chunks_that_do_not_line_up(model64):
    engine = LLM(model64, max_model_len=256).engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", prompt_of(40, seed=1), params)
    engine.add_request("b", prompt_of(41, seed=2), params)
    (a, sa, ea), (b, sb, eb) = engine.scheduler.schedule().prefills
    assert engine.runner.batch_key(a, sa, ea) != engine.runner.batch_key(b, sb, eb)
    with pytest.raises(ValueError, match="one batch key"):
        engine.runner.prefill_batch([(a, sa, ea), (b, sb, eb)])
    with pytest.raises(ValueError, match="0 <= start < end"):
        engine.runner.prefill_batch([(a, 3, 3)])
